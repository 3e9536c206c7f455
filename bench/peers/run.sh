#!/bin/bash
# bench/peers/run.sh [peers.py options] - what `make bench-peers` runs.
#
# Installs the peer engines into a virtual environment under build/ (NIXL's nixl-cu12
# with --no-deps plus numpy: it declares torch but does not need it; Mooncake TE's
# mooncake-transfer-engine-non-cuda), then runs bench/peers/peers.py inside a private
# network namespace with only loopback up: Mooncake binds its listeners to 0.0.0.0 and
# has no option against it, so nothing of this run is reachable from outside.
#
# A peer whose wheel cannot be installed or imported is skipped with the reason; no
# namespace support skips the whole comparison. Neither is a failure (exit status 0).
# `run.sh --profile [options]` runs bench/peers/profile.py instead (perf stat on
# libkvxfer, its TCP stream and NIXL), `run.sh --firstbyte [options]` firstbyte.py (a
# room's timeline from perf record); both install Debian's linux-perf if perf is missing.
# `run.sh --same-host [options]` (make bench-peers PEERS_ARGS=--same-host) runs
# libkvxfer's same-host path against NIXL with UCX's same-host transports instead of the
# TCP comparison (bench/peers/samehost.py); its table and JSON go to peers-same-host.out
# and .json, its logs to same-host/.
# Environment: PEERS_VENV (build/peers-venv), BENCH_BIN (target/release/kvxfer-bench),
# PEERS_NIXL and PEERS_MOONCAKE (the pip requirements, pinned to the versions measured
# in docs/BENCHMARKS.md), PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/../.."

VENV=${PEERS_VENV:-build/peers-venv}
BENCH=${BENCH_BIN:-target/release/kvxfer-bench}
NIXL_REQ=${PEERS_NIXL:-nixl-cu12==1.5.1}
MOONCAKE_REQ=${PEERS_MOONCAKE:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
PY=${PYTHON:-python3}
OUT=build/bench-peers

skip_all() {
  echo "bench-peers: skipped: $*"
  exit 0
}

[ -x "$BENCH" ] || { echo "bench-peers: $BENCH is missing (make bench-build)" >&2; exit 1; }

# The namespace: as root `unshare -n`; otherwise a user namespace mapping us to root.
UNSHARE=""
for u in "unshare -n" "unshare -rn"; do
  if $u sh -c 'ip link set lo up' 2>/dev/null; then UNSHARE=$u; break; fi
done
if [ -z "$UNSHARE" ]; then
  why=$(unshare -n sh -c 'ip link set lo up' 2>&1 | head -n 1)
  skip_all "no private network namespace here (unshare -n, then ip link set lo up: ${why:-failed}); Mooncake would listen on every interface"
fi

# The virtual environment. Debian's python3 needs python3-venv for it.
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    command -v dpkg >/dev/null && scripts/apt-install.sh python3-venv
    "$PY" -m venv "$VENV" || skip_all "cannot create a Python virtual environment with $PY"
  fi
fi
pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip numpy || skip_all "cannot install numpy into $VENV"

skipped=()
engines=kvxfer
if ! pip --no-deps "$NIXL_REQ"; then
  skipped+=("nixl=pip could not install $NIXL_REQ")
elif ! err=$("$VENV/bin/python" -c 'import os, nixl_cu12; os._exit(0)' 2>&1); then
  skipped+=("nixl=import nixl_cu12 failed: $(echo "$err" | tail -n 1)")
else
  engines+=,nixl
fi
# The Mooncake wheel links libibverbs.so.1 even for TCP; Debian's libibverbs1 has it.
mooncake_import() { "$VENV/bin/python" -c 'import os; from mooncake.engine import TransferEngine; os._exit(0)' 2>&1; }
if ! pip "$MOONCAKE_REQ"; then
  skipped+=("mooncake=pip could not install $MOONCAKE_REQ")
else
  err=$(mooncake_import)
  rc=$?
  if [ $rc -ne 0 ] && [[ $err == *libibverbs.so.1* ]] && command -v dpkg >/dev/null \
    && scripts/apt-install.sh libibverbs1; then
    err=$(mooncake_import)
    rc=$?
  fi
  if [ $rc -ne 0 ]; then
    skipped+=("mooncake=import mooncake.engine failed: $(echo "$err" | tail -n 1)")
  else
    engines+=,mooncake
  fi
fi

mkdir -p "$OUT"
case "${1:-}" in
  --profile | --firstbyte)
    tool=${1#--}
    shift
    perf stat -e task-clock true >/dev/null 2>&1 || scripts/apt-install.sh linux-perf
    perf stat -e task-clock,raw_syscalls:sys_enter true >/dev/null 2>&1 \
      || { echo "bench-peers: perf cannot count task-clock and syscall tracepoints here" >&2; exit 1; }
    if [ "$tool" = profile ] && [[ $engines != *nixl* ]]; then
      echo "bench-peers: NIXL skipped: ${skipped[*]}" >&2
      exit 1
    fi
    $UNSHARE bash -c 'ip link set lo up && exec "$@"' bash \
      "$VENV/bin/python" "bench/peers/$tool.py" --bench "$BENCH" --log-dir "$OUT/$tool" "$@" \
      | tee "$OUT/$tool.out"
    exit "${PIPESTATUS[0]}"
    ;;
esac
skip_arg=$(IFS=';'; echo "${skipped[*]:-}")
name=peers
logs=$OUT
for arg in "$@"; do
  if [ "$arg" = --same-host ]; then
    name=peers-same-host
    logs=$OUT/same-host
  fi
done
# shellcheck disable=SC2016
$UNSHARE bash -c 'ip link set lo up && exec "$@"' bash \
  "$VENV/bin/python" bench/peers/peers.py --bench "$BENCH" --engines "$engines" \
  --log-dir "$logs" --skipped "$skip_arg" "$@" | tee "$OUT/$name.out"
rc=${PIPESTATUS[0]}
tail -n 1 "$OUT/$name.out" > "$OUT/$name.json"
echo "bench-peers: JSON in $OUT/$name.json, each engine run's log in $logs/"
exit "$rc"
