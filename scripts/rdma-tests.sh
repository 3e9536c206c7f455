#!/bin/bash
# rdma-tests.sh - run libkvxfer's tests over real RDMA verbs (soft-RoCE) inside a
# throw-away QEMU guest (scripts/rdma-vm.sh), with transport=rdma.
#
# Usage: scripts/rdma-tests.sh [BUILD_DIR]      (BUILD_DIR: the CMake build, default build)
#
# Builds on the host: the Rust integration tests tests/rdma_verbs.rs, tests/rdma.rs,
# tests/transfer.rs, tests/two_process.rs, tests/hetero.rs and tests/layerwise.rs
# (feature test-hooks) and the gtest suite (already built in BUILD_DIR). Inside the guest
# it checks that the rxe device came up, then runs each with KVXFER_TEST_TRANSPORT=rdma,
# so every engine the suites create moves its data over RDMA, and then the Python
# package's python/tests/test_sglang_tp.py (the SGLang backend with TP ranks) with the
# wheel installed in build/python-venv (make python; make test runs python-test
# first). Exits nonzero if the device did not come up, the guest failed, or any test
# failed.
#
# RDMA_TESTS=python runs only the Python tests in the guest (no cargo build, no gtest).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
BUILD=${1:-build}
OUT=$ROOT/target/rdma-tests
mkdir -p "$OUT"
ONLY=${RDMA_TESTS:-all}
case $ONLY in all|python) ;; *) echo "rdma-tests: RDMA_TESTS is all or python, not '$ONLY'" >&2; exit 2 ;; esac

# The venv of Makefile.python, with the wheel, pytest and numpy.
PY=$ROOT/build/python-venv/bin/python
"$PY" -c 'import kvxfer.sglang, numpy, pytest' >/dev/null 2>&1 || {
  echo "rdma-tests: $PY cannot import kvxfer.sglang, numpy and pytest: make python (it builds" \
       "the wheel and installs it with the test dependencies into build/python-venv)" >&2; exit 1; }

bins=""
if [ "$ONLY" = all ]; then
  # Host-built test binaries (cargo prints their paths as JSON artifacts).
  bins=$(cargo test --locked --features test-hooks --no-run --message-format=json \
           --test rdma_verbs --test rdma --test transfer --test two_process --test hetero --test layerwise |
         python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])')
  [ "$(wc -w <<<"$bins")" = 6 ] || { echo "rdma-tests: expected 6 test binaries, got: $bins" >&2; exit 1; }
  [ -x "$BUILD/cpp-tests/kvxfer_tests" ] || { echo "rdma-tests: $BUILD/cpp-tests/kvxfer_tests missing (make build)" >&2; exit 1; }
fi

cat > "$OUT/guest.sh" <<GUEST
#!/bin/bash
set -uo pipefail
cd "$ROOT"
export KVXFER_TEST_TRANSPORT=rdma RUST_BACKTRACE=1
if ! grep -q PORT_ACTIVE <<<"\$(ibv_devinfo -d "\${RXE_DEV:-rxe0}" 2>/dev/null)"; then
  echo "rdma-tests: device \${RXE_DEV:-rxe0} is not up in the guest"; exit 3
fi
echo "rdma-tests: \${RXE_DEV:-rxe0} is up"
# A binary that dies on a signal leaves a core here, and its backtrace is printed.
rm -f "$OUT"/core.*
ulimit -c unlimited
echo "$OUT/core.%p" > /proc/sys/kernel/core_pattern 2>/dev/null || echo "rdma-tests: no core dumps"
rc=0
for b in $(echo $bins); do
  echo "rdma-tests: == \$(basename \$b)"
  "\$b" --test-threads=1 > "$OUT/\$(basename \$b).log" 2>&1; r=\$?
  grep -E '^test result|FAILED|panicked' "$OUT/\$(basename \$b).log" | head -40
  if [ \$r -gt 128 ]; then
    echo "rdma-tests: \$(basename \$b) died on signal \$((r - 128)); the last tests it began:"
    grep -E '^test ' "$OUT/\$(basename \$b).log" | tail -n 3
    # The guest console is quiet (loglevel=3): a kernel (rxe) warning is only in dmesg.
    echo "rdma-tests: the guest kernel's last messages:"
    dmesg 2>/dev/null | tail -n 30
    for c in "$OUT"/core.*; do
      [ -f "\$c" ] || continue
      gdb -q -batch -ex "thread apply all bt 25" "\$b" "\$c" 2>&1 | grep -E '^(Thread|#|Program terminated)' | head -150
      rm -f "\$c"
    done
  fi
  [ \$r = 0 ] || rc=1
  # A binary that ran no test passes nothing.
  grep -qE '^test result: ok\. [1-9]' "$OUT/\$(basename \$b).log" || { echo "rdma-tests: \$(basename \$b) ran no test"; rc=1; }
done
if [ "$ONLY" = all ]; then
  echo "rdma-tests: == gtest"
  "$ROOT/$BUILD/cpp-tests/kvxfer_tests" --gtest_brief=1 > "$OUT/gtest.log" 2>&1; r=\$?
  tail -n 25 "$OUT/gtest.log"
  [ \$r = 0 ] || rc=1
fi
# The SGLang backend with TP ranks over RDMA (the test reads KVXFER_TEST_TRANSPORT).
echo "rdma-tests: == python/tests/test_sglang_tp.py"
(cd "$OUT" && KVXFER_EXPECT_INSTALLED=1 timeout -k 10 300 "$PY" -m pytest -q -p no:cacheprovider \
   --durations=0 "$ROOT/python/tests/test_sglang_tp.py") > "$OUT/python.log" 2>&1; r=\$?
grep -E '^(FAILED|ERROR)|^E  |passed|failed|s call ' "$OUT/python.log" | head -60
[ \$r = 0 ] || { echo "rdma-tests: the Python tests failed (exit \$r): $OUT/python.log"; rc=1; }
grep -qE '[1-9][0-9]* passed' "$OUT/python.log" || { echo "rdma-tests: the Python tests passed nothing"; rc=1; }
exit \$rc
GUEST
chmod +x "$OUT/guest.sh"
exec scripts/rdma-vm.sh -q -t "${RDMA_VM_TIMEOUT:-900}" -m 2048 "$ROOT" -- "$OUT/guest.sh"
