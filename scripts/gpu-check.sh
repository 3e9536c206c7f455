#!/usr/bin/env bash
# The one prepared check of issue 35 for a GPU machine: libkvxfer moving KV pages in CUDA
# device memory between two processes on one GPU, and the benchmark figures of the
# issue's targets. Runs in under 8 minutes; writes its log and results to OUTDIR.
#
#   scripts/gpu-check.sh OUTDIR
#
# The GPU machine has the CUDA driver, PyTorch and numpy but no Rust toolchain: build here
# with `make gpu-bundle` (a stripped release libkvxfer.so in build/gpu/) and carry
# build/gpu with the checkout (DEVELOPERS.md, "The GPU check"). The Python package runs
# from python/ in place.
#
# What it runs (scripts/gpu/pair.py, each case in two fresh processes):
#   - TCP staging with cudaMalloc memory (PyTorch's default allocator) and with VMM memory
#     (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): scattered pages byte-exact,
#     head slices 2 -> 1, a layer-wise room, aborts from either side with a poison check
#     after room_drained;
#   - the benchmark: device->device over TCP staging against host->host over TCP, at
#     1 MiB pages x 4 rooms in flight and at 32 KiB pages (target: >= 0.9x).
#   - the same cases over CUDA IPC (--path ipc: same_host=require on both engines, so a
#     pairing that cannot take it fails with the reason instead of falling back), each
#     checking the path its rooms report; and the engine's IPC figure at 1 MiB pages;
#   - CUDA IPC, the layer alone (build/gpu/ipc_check, kvxfer-bench/src/bin/ipc_check.rs):
#     two processes, cuMemAlloc memory through a legacy IPC handle and VMM memory
#     (cuMemCreate chunks exportable as POSIX descriptors) through descriptors passed over
#     a Unix socket; scattered 1 MiB pages byte-exact, a source outside the export
#     refused, and a plain device-to-device copy of the same pages in one process, the
#     baseline of the IPC target (>= 0.8x).
#   - the vLLM connector's worker half and the SGLang backend with CUDA tensors as KV
#     caches (scripts/gpu/servers.py), byte-exact.
#
# KVXFER_GPU_CHECK_MEM=fake runs the same cases on the CUDA driver's test double
# (tests/fakecuda, KVXFER_CUDA_LIBRARY pointing at a built libfakecuda.so) on a machine
# without a GPU, to check the script itself; its figures mean nothing.
set -uo pipefail

OUT=${1:?usage: scripts/gpu-check.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

MEM=${KVXFER_GPU_CHECK_MEM:-torch}
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export KVXFER_LIBRARY=${KVXFER_LIBRARY:-$ROOT/build/gpu/libkvxfer.so}
START=$(date +%s)
BUDGET=${KVXFER_GPU_CHECK_BUDGET_S:-450}
FAILED=0
PASSED=0
SKIPPED=0

echo "== gpu-check $(date -u +%FT%TZ) mem=$MEM lib=$KVXFER_LIBRARY"
if [ "$MEM" = torch ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' || {
    echo "gpu-check: PyTorch with CUDA is needed"; exit 2; }
fi
[ -f "$KVXFER_LIBRARY" ] || { echo "gpu-check: $KVXFER_LIBRARY missing (make gpu-bundle here, carry build/gpu)"; exit 2; }

# run NAME TIMEOUT [ENV=VALUE ...] -- ARGS...: one case of scripts/gpu/pair.py (or, with
# SCRIPT=servers.py among the ENVs, of that script); its JSON line goes to results.
run() {
  local name=$1 limit=$2; shift 2
  local script=pair.py
  local envs=()
  while [ "$1" != -- ]; do
    case $1 in SCRIPT=*) script=${1#SCRIPT=} ;; *) envs+=("$1") ;; esac
    shift
  done
  shift
  if (( $(date +%s) - START > BUDGET )); then
    echo "SKIPPED $name: past the time budget (${BUDGET}s)"; SKIPPED=$((SKIPPED + 1)); return
  fi
  local t0=$(date +%s) line rc
  line=$(env "${envs[@]}" timeout "$limit" "$PY" "$ROOT/scripts/gpu/$script" --mem "$MEM" "$@" \
           2> >(sed "s|^|  [$name] |" >&2) | tail -n 1)
  rc=${PIPESTATUS[0]}
  echo "$line" | grep -q '^{' && echo "$line" >> "$RESULTS"
  if [ "$rc" = 0 ] && echo "$line" | grep -q '"ok": true'; then
    echo "PASS $name ($(( $(date +%s) - t0 ))s): $line"; PASSED=$((PASSED + 1))
  else
    echo "FAIL $name (rc $rc, $(( $(date +%s) - t0 ))s): $line"; FAILED=$((FAILED + 1))
  fi
}

VMM=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for alloc in cudamalloc vmm; do
  e=(KVXFER_GPU_CHECK_ALLOC=$alloc)
  [ $alloc = vmm ] && e+=("$VMM")
  for path in staging ipc; do
    for c in scattered heads layers abort; do
      run "$c/$alloc/$path" 90 "${e[@]}" -- "$c" --path "$path"
    done
  done
done

for c in vllm sglang; do
  run "servers/$c" 90 SCRIPT=servers.py X=1 -- "$c"
done

# The benchmark: host->host over TCP, then device->device over TCP staging, same work;
# then device->device through the engine over CUDA IPC (cudaMalloc memory) at 1 MiB.
for mem in host "$MEM"; do
  MEM_SAVED=$MEM; MEM=$mem
  run "bench/$mem/1MiBx4" 120 X=1 -- bench --item 1048576 --per-room 8 --rooms 128 --inflight 4
  run "bench/$mem/32KiB" 120 X=1 -- bench --item 32768 --per-room 64 --rooms 256 --inflight 4
  MEM=$MEM_SAVED
done
run "bench/$MEM/ipc/1MiBx4" 120 KVXFER_GPU_CHECK_ALLOC=cudamalloc -- \
  bench --item 1048576 --per-room 8 --rooms 128 --inflight 4 --path ipc

# CUDA IPC, the layer (see the header): one JSON line per allocation kind.
IPC_CHECK=${KVXFER_IPC_CHECK:-$ROOT/build/gpu/ipc_check}
for alloc in legacy vmm; do
  if (( $(date +%s) - START > BUDGET )); then
    echo "SKIPPED ipc/$alloc: past the time budget (${BUDGET}s)"; SKIPPED=$((SKIPPED + 1)); continue
  fi
  if [ ! -x "$IPC_CHECK" ]; then
    echo "FAIL ipc/$alloc: $IPC_CHECK missing (make gpu-bundle here, carry build/gpu)"; FAILED=$((FAILED + 1)); continue
  fi
  t0=$(date +%s)
  line=$(timeout 120 "$IPC_CHECK" "$alloc" --item 1048576 --pages 256 --reps 20 \
           2> >(sed "s|^|  [ipc/$alloc] |" >&2) | tail -n 1)
  rc=${PIPESTATUS[0]}
  echo "$line" | grep -q '^{' && echo "$line" >> "$RESULTS"
  if [ "$rc" = 0 ] && echo "$line" | grep -q '"ok": true'; then
    echo "PASS ipc/$alloc ($(( $(date +%s) - t0 ))s): $line"; PASSED=$((PASSED + 1))
  else
    echo "FAIL ipc/$alloc (rc $rc, $(( $(date +%s) - t0 ))s): $line"; FAILED=$((FAILED + 1))
  fi
done

"$PY" - "$RESULTS" "$MEM" <<'PYEOF'
import json, sys
if sys.argv[2] == "fake":
    print("NOTE: the figures below are the CUDA driver's test double's (host memcpy), not a GPU's: meaningless")
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
bench = {(r["mem"], r["item"]): r["gbps"] for r in rows
         if r["case"] == "bench" and r["ok"] and r.get("path", "staging") == "staging"}
for item, name in ((1048576, "1 MiB x4"), (32768, "32 KiB")):
    host = bench.get(("host", item))
    dev = [v for (m, i), v in bench.items() if i == item and m != "host"]
    if host and dev:
        ratio = dev[0] / host
        print(f"TARGET d2d-staging/h2h {name}: {dev[0]:.3f} / {host:.3f} GB/s = {ratio:.3f} "
              f"({'met' if ratio >= 0.9 else 'NOT met'}: >= 0.9)")
    else:
        print(f"TARGET d2d-staging/h2h {name}: not measured")
eng = [r for r in rows if r["case"] == "bench" and r.get("path") == "ipc" and r["ok"]]
layer = [r for r in rows if r["case"] == "ipc" and r["alloc"] == "legacy" and r["ok"]]
if eng and layer:
    ratio = eng[0]["gbps"] / layer[0]["plain_gbps"]
    print(f"TARGET cuda-ipc (engine, 1 MiB x4)/plain-d2d: {eng[0]['gbps']:.3f} / "
          f"{layer[0]['plain_gbps']:.3f} GB/s = {ratio:.3f} ({'met' if ratio >= 0.8 else 'NOT met'}: >= 0.8)")
else:
    print("TARGET cuda-ipc (engine, 1 MiB x4)/plain-d2d: not measured")
for alloc in ("legacy", "vmm"):
    r = [r for r in rows if r["case"] == "ipc" and r["alloc"] == alloc and r["ok"]]
    if r:
        r = r[0]
        print(f"TARGET cuda-ipc/plain-d2d 1 MiB ({alloc}, the IPC layer alone): "
              f"{r['ipc_gbps']:.3f} / {r['plain_gbps']:.3f} GB/s = {r['ratio']:.3f} "
              f"({'met' if r['ratio'] >= 0.8 else 'NOT met'}: >= 0.8)")
    else:
        print(f"TARGET cuda-ipc/plain-d2d 1 MiB ({alloc}): not measured")
PYEOF

echo "== gpu-check done in $(( $(date +%s) - START ))s: $PASSED passed, $FAILED failed, $SKIPPED skipped (mem=$MEM)"
[ "$FAILED" = 0 ] && [ "$SKIPPED" = 0 ]
