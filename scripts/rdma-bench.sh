#!/bin/bash
# rdma-bench.sh - kvxfer-bench over RDMA against perftest's ib_write_bw on the same
# soft-RoCE device, side by side in one guest (scripts/rdma-vm.sh).
#
# Usage: scripts/rdma-bench.sh [kvxfer-bench options]
#        (default: --preset llama3-8b --prompt 1024 --rooms 6 --concurrency 2 --repeat 1)
#
# Order inside the guest: ib_write_bw, kvxfer-bench --transport rdma, ib_write_bw again,
# so the link's limit is measured right before and right after. Soft-RoCE is software
# on the guest's CPUs, so the ratio matters, not the absolute figure. Prints a summary
# and leaves the logs in target/rdma-bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
OUT=$ROOT/target/rdma-bench
mkdir -p "$OUT"
cargo build --locked --release -p kvxfer-bench
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--preset llama3-8b --prompt 1024 --rooms 6 --concurrency 2 --repeat 1)

cat > "$OUT/guest.sh" <<GUEST
#!/bin/bash
set -uo pipefail
cd "$ROOT"
dev=\${RXE_DEV:-rxe0}
# One ib_write_bw run: 1 MiB writes, GID index 1 (RoCE v2, IPv4-mapped). perftest
# busy-polls its completions (its event mode does not exist for WRITE); kvxfer sleeps in
# poll(2) after a 50 us spin. Under soft-RoCE the device is software on the same two
# vCPUs, so a busy poller takes CPU from the device itself.
ibw() {
  ib_write_bw -d \$dev -x 1 -F -s 1048576 -n 200 --report_gbits >"$OUT/ibw-server-\$1.log" 2>&1 &
  local s=\$!; sleep 1
  ib_write_bw -d \$dev -x 1 -F -s 1048576 -n 200 --report_gbits \$RXE_IP >"$OUT/ibw-client-\$1.log" 2>&1
  wait \$s
  awk '\$1 == 1048576 { print \$4 }' "$OUT/ibw-client-\$1.log"   # BW average, Gb/s
}
before=\$(ibw before)
"$ROOT/target/release/kvxfer-bench" --transport rdma --json ${ARGS[*]} >"$OUT/kvxfer.log" 2>&1; rc=\$?
after=\$(ibw after)
tail -n 30 "$OUT/kvxfer.log" | grep -v '^{' || true
echo "ib_write_bw: before \$before Gb/s, after \$after Gb/s"
tail -n 1 "$OUT/kvxfer.log" > "$OUT/kvxfer.json"
python3 - "\$before" "\$after" "$OUT/kvxfer.json" <<'PY'
import json, sys
b, a = (float(x) / 8 for x in sys.argv[1:3])   # GB/s
r = json.load(open(sys.argv[3]))
link = (b + a) / 2
print(f"kvxfer rdma {r['gbps']:.3f} GB/s delivered and verified vs ib_write_bw {link:.3f} GB/s "
      f"(mean of {b:.3f} before, {a:.3f} after): ratio {r['gbps'] / link:.2f}; "
      f"vs the guest's TCP stream: {r['ratio_vs_tcp']:.2f}")
PY
exit \$rc
GUEST
chmod +x "$OUT/guest.sh"
exec scripts/rdma-vm.sh -q -t "${RDMA_VM_TIMEOUT:-900}" -m 3072 "$ROOT" -- "$OUT/guest.sh"
