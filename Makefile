# libkvxfer developer entry points. `make test` is what CI runs (.ci/run).
#
#   make deps    install the Debian packages the C++ side needs (only those missing)
#   make build   cargo + CMake build in build/ (Ninja, RelWithDebInfo)
#   make test    fmt, clippy, cargo test, ctest, ctest under ASan+UBSan, install test
#   make demo    install to build/demo-prefix, build examples/ against it, run the demo
#   make test-rdma  the Rust and gtest suites over real verbs in a soft-RoCE QEMU guest
#   make test-vllm  opt-in: a vLLM prefill/decode pair on KvxferConnector (Makefile.vllm)
#   make sim-soak  the cluster simulator's seeds for SIM_SECS seconds (default 60)
#   make header  regenerate include/kvxfer.h from src/ffi/ (after changing the C ABI)
#   make gpu-bundle  a stripped release libkvxfer.so and ipc_check in build/gpu/ for scripts/gpu-check.sh
#   make clean   remove build/, build-asan/ and cargo's target/

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := build

# cargo may live in rustup's default place without being on PATH.
export PATH := $(HOME)/.cargo/bin:$(PATH)
export DEBIAN_FRONTEND := noninteractive

BUILD_TYPE ?= RelWithDebInfo
NPROC := $(shell nproc 2>/dev/null || echo 2)
# clang and libclang-dev build rdma-mummy-sys (sideway's verbs bindings, which load
# libibverbs at run time, so the library needs no RDMA package to build or run).
# gcc: the Rust tests build the CUDA driver's test double (tests/fakecuda) with cc.
# etcd-server and etcd-client: the real etcd the discovery tests start (tests/discovery.rs).
DEBS := cmake ninja-build gcc g++ libgtest-dev pkg-config iproute2 clang libclang-dev \
  etcd-server etcd-client
CMAKE_CONFIGURE := cmake -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)
DEMO_PREFIX := $(CURDIR)/build/demo-prefix

.PHONY: deps build test demo header clean rust-checks ctest asan install-test bench-smoke \
  gpu-bundle gpu-skipped sim-soak

deps:
	@scripts/apt-install.sh $(DEBS)
	@command -v cargo >/dev/null || { echo "make deps: cargo not found (install Rust with rustup)" >&2; exit 1; }

build: deps
	$(CMAKE_CONFIGURE) -S . -B build
	cmake --build build

rust-checks: deps
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	cargo clippy --all-targets --locked --features test-hooks -- -D warnings
	# The library without discovery (cargo feature `discovery`, on by default).
	cargo clippy --lib --locked --no-default-features -- -D warnings
	# Includes tests/discovery.rs: a real etcd per test (etcd-server, installed by deps).
	cargo test --locked
	# The benchmark crate (kvxfer-bench/): its unit tests and two short two-process runs.
	cargo test --locked -p kvxfer-bench
	# Two hosts in network namespaces (root + iproute2), with a link cut and heal.
	cargo test --locked --test netns -- --ignored
	# The races of the shell held open by test-only pause points (feature test-hooks,
	# never in a release build); the silent pin and its neighbours (pin_regression,
	# hooks_complete) run above without them.
	cargo test --locked --features test-hooks --test hardening \
	  --test hardening_again --test hetero --test integrity --test cuda_ipc
	# The byte-exact suites again over the same-host path (a direct copy between the
	# processes; any pairing that cannot take it fails its rooms).
	KVXFER_TEST_SAME_HOST=require cargo test --locked --features test-hooks --test transfer \
	  --test hetero --test layerwise --test layers --test layout --test two_process

# The deterministic cluster simulator (src/engine/sim/), seed after seed for SIM_SECS
# seconds (default 60) from SIM_SEED (default: from the clock): seeds per second, the
# invariants checked, and the first failure shrunk to its schedule. make test runs its
# 2,000 seeds and the bugs it must find in the library's unit tests.
sim-soak:
	cargo test --locked --release --lib engine::sim::tests::soak -- --ignored --nocapture

ctest: build
	ctest --test-dir build --output-on-failure -j $(NPROC)

# The gtest suite under AddressSanitizer and UndefinedBehaviorSanitizer, with leak
# detection on (LeakSanitizer reports nothing for the Rust library as it stands, so no
# suppressions file is needed). A Debug build: sanitizers lose nothing at -O0, and the
# suites compile about four times faster than at -O2.
asan: deps
	cmake -G Ninja -DCMAKE_BUILD_TYPE=Debug -S . -B build-asan -DKVXFER_SANITIZE=ON
	cmake --build build-asan
	ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:check_initialization_order=1 \
	  ctest --test-dir build-asan --output-on-failure -j $(NPROC)

install-test: build
	scripts/test-install.sh build

test: deps
	@start=$$(date +%s); times=""; \
	for stage in rust-checks loom ctest asan install-test bench-smoke python-test test-rdma; do \
	  t=$$(date +%s); \
	  $(MAKE) --no-print-directory $$stage; \
	  times="$$times $$stage=$$(( $$(date +%s) - t ))s"; \
	done; \
	echo "make test: everything passed in $$(( $$(date +%s) - start )) s ($${times# })"; \
	$(MAKE) --no-print-directory gpu-skipped

# What make test does not run: the GPU tests need an NVIDIA GPU with the CUDA driver, and
# they are one script for such a machine (scripts/gpu-check.sh; DEVELOPERS.md says how it
# is run). Here the CUDA code paths run only against the driver's test double
# (tests/fakecuda), which proves the engine's use of the driver API, not GPU behaviour.
gpu-skipped:
	@echo "make test: GPU tests SKIPPED, not passed: they need an NVIDIA GPU and the CUDA driver;" \
	  "run scripts/gpu-check.sh on a GPU machine (see DEVELOPERS.md, 'The GPU check')."

# The library for scripts/gpu-check.sh on a GPU machine that has no Rust toolchain: a
# release build with its debug info stripped (the device tool carries at most 64 MiB).
gpu-bundle:
	cargo build --release --locked --lib
	cargo build --release --locked -p kvxfer-bench --bin ipc_check
	mkdir -p build/gpu
	objcopy --strip-debug target/release/libkvxfer.so build/gpu/libkvxfer.so
	objcopy --strip-debug target/release/ipc_check build/gpu/ipc_check
	@ls -l build/gpu/libkvxfer.so build/gpu/ipc_check

# The benchmark tool end to end at --quick size: it exits nonzero on any unexpected
# failure or a room whose two sides disagree. Behaviour only; timings are for make bench.
bench-smoke: bench-build
	$(BENCH_BIN) --preset single-page --quick --json | tail -n 1
	$(BENCH_BIN) --preset llama3-8b --quick --abort-rate 0.2 --json | tail -n 1
	# Prefill TP 2 -> decode TP 1 (head slices), alternating with TP 1 -> 1 (issue 13).
	$(BENCH_BIN) --preset llama3-8b --quick --prefill-tp 2 --decode-tp 1 --json | tail -n 1
	# Layer by layer with 1 ms of simulated compute per layer, against whole chunks (issue 14).
	$(BENCH_BIN) --preset llama3-8b --quick --layerwise --compute-us-per-layer 1000 --json | tail -n 1

demo: build
	rm -rf "$(DEMO_PREFIX)" build/demo-example
	cmake --install build --prefix "$(DEMO_PREFIX)"
	cmake -G Ninja -S examples -B build/demo-example -DCMAKE_PREFIX_PATH="$(DEMO_PREFIX)"
	cmake --build build/demo-example
	build/demo-example/kv_demo $(DEMO_ARGS)

header:
	KVXFER_BLESS=1 cargo test --locked --test header

clean:
	rm -rf build build-asan
	cargo clean

include Makefile.bench
include Makefile.verify
include Makefile.rdma
include Makefile.python
include Makefile.vllm
