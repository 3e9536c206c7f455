#!/bin/bash
# rdma-vm.sh - run a command inside a throw-away QEMU VM (Debian 6.1
# kernel) that has a soft-RoCE device rxe0 (rdma_rxe on virtio-net eth0).
#
# Usage: scripts/rdma-vm.sh [-t SECS] [-m MB] [-s CPUS] [-q] HOSTDIR -- CMD [ARGS...]
#
#   HOSTDIR is shared read-write into the VM at the SAME absolute path (9p) and
#   is the command's working directory.  The host's whole / is shared READ-ONLY
#   and the command runs chrooted into it, so every host binary and library
#   (rdma-core, perftest, your test build) is usable unchanged.  /tmp, /run,
#   /var/tmp and /dev/shm are fresh tmpfs in the VM.
#   In the VM: RXE_DEV=rxe0  RXE_IP=10.0.2.15 (IP of eth0, which rxe0 sits on;
#   RoCE GID index 1 is the IPv4-mapped GID).  Runs as root.
#   Prints the VM serial console (boot markers + command output) and exits with
#   the command's exit code; 124 = timeout, 125 = VM/infrastructure failure.
#
# Options: -t total timeout in s (default 300)  -m guest RAM MB (default 1024)
#          -s guest CPUs (default 2)  -q only print the command's output
# Env:     RXE_VM_CACHE  (default ~/.cache/kvxfer-rxe-vm) kernel + initramfs cache
#          RXE_VM_ACCEL  auto|kvm|tcg (auto = kvm unless /dev/kvm is missing or
#                        is KVM-PVM, which cannot boot a stock kernel)
#          RXE_VM_KERNEL_DEB  use this linux-image-*.deb instead of apt-get download
# Host packages: qemu-system-x86 busybox-static cpio kmod rdma-core
#                ibverbs-providers ibverbs-utils perftest iproute2 (and apt
#                access to download linux-image-amd64 once, or RXE_VM_KERNEL_DEB)
set -euo pipefail

TIMEOUT=300 MEM=1024 SMP=2 QUIET=0
while getopts "t:m:s:qh" o; do
  case $o in
    t) TIMEOUT=$OPTARG ;; m) MEM=$OPTARG ;; s) SMP=$OPTARG ;; q) QUIET=1 ;;
    *) sed -n '2,27p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND-1))
[ $# -ge 1 ] || { sed -n '2,27p' "$0"; exit 2; }
HOSTDIR=$(cd "$1" && pwd -P); shift
[ "${1:-}" = "--" ] && shift
[ $# -ge 1 ] || { echo "rdma-vm: no command given" >&2; exit 2; }

CACHE=${RXE_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvxfer-rxe-vm}
mkdir -p "$CACHE"
log() { echo "[rdma-vm] $*" >&2; }
T0=$(date +%s.%N)

# ---------------------------------------------------------------- kernel ---
exec 9>"$CACHE/.lock"; flock 9          # serialise cache building between runs
KDIR=$CACHE/kernel
if [ ! -f "$KDIR/.ok" ]; then
  rm -rf "$KDIR"; mkdir -p "$KDIR"
  deb=${RXE_VM_KERNEL_DEB:-}
  if [ -z "$deb" ]; then
    pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    log "downloading $pkg"
    (cd "$KDIR" && apt-get download "$pkg" >/dev/null 2>&1) || { log "apt-get download $pkg failed"; exit 125; }
    deb=$(ls "$KDIR"/linux-image-*.deb)
  fi
  dpkg-deb -x "$deb" "$KDIR/root"
  rm -f "$KDIR"/*.deb
  touch "$KDIR/.ok"
fi
KV=$(ls "$KDIR/root/lib/modules" | head -1)
VMLINUZ=$KDIR/root/boot/vmlinuz-$KV

# ------------------------------------------------------------- initramfs ---
SELF_SUM=$(sha1sum "$0" | cut -c1-12)
INITRD=$CACHE/initrd-$KV-$SELF_SUM.cpio.gz
if [ ! -f "$INITRD" ]; then
  B=$(mktemp -d "$CACHE/build.XXXXXX")
  mkdir -p "$B"/{bin,proc,sys,dev,mods,host,ctl}
  BB=$(command -v busybox) || { log "busybox-static not installed"; exit 125; }
  if ldd "$BB" >/dev/null 2>&1; then log "$BB is dynamically linked; install busybox-static"; exit 125; fi
  cp "$BB" "$B/bin/busybox"
  MD=$KDIR/root/lib/modules/$KV
  WANT="crc32_generic virtio_pci virtio_net 9pnet_virtio 9p rdma_rxe ib_uverbs rdma_ucm"
  if command -v modprobe >/dev/null && command -v depmod >/dev/null; then
    [ -f "$MD/modules.dep" ] || depmod -b "$KDIR/root" "$KV"
    for m in $WANT; do modprobe -d "$KDIR/root" -S "$KV" --show-depends "$m"; done |
      awk '$1=="insmod"{print $2}' | awk '!s[$0]++' > "$B/list"
  else   # no kmod on host: fixed order valid for Debian 6.1 kernels
    for m in crypto/crc32_generic drivers/virtio/virtio_ring drivers/virtio/virtio \
             drivers/virtio/virtio_pci_modern_dev drivers/virtio/virtio_pci_legacy_dev \
             drivers/virtio/virtio_pci net/core/failover drivers/net/net_failover \
             drivers/net/virtio_net net/9p/9pnet net/9p/9pnet_virtio fs/netfs/netfs \
             fs/fscache/fscache fs/9p/9p net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel \
             drivers/infiniband/core/ib_core drivers/infiniband/core/ib_uverbs \
             drivers/infiniband/sw/rxe/rdma_rxe fs/configfs/configfs \
             drivers/infiniband/core/ib_cm drivers/infiniband/core/iw_cm \
             drivers/infiniband/core/rdma_cm drivers/infiniband/core/rdma_ucm; do
      f=$(ls "$MD/kernel/$m.ko"* 2>/dev/null | head -1) && echo "$f"
    done > "$B/list"
  fi
  : > "$B/mods/order"
  while read -r f; do
    case $f in   # busybox insmod cannot read compressed modules
      *.ko.xz)  xz -dc "$f"   > "$B/mods/$(basename "$f" .xz)";  f=${f%.xz} ;;
      *.ko.zst) zstd -dcq "$f" > "$B/mods/$(basename "$f" .zst)"; f=${f%.zst} ;;
      *)        cp "$f" "$B/mods/" ;;
    esac
    basename "$f" >> "$B/mods/order"
  done < "$B/list"
  rm "$B/list"
  cat > "$B/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
up() { cut -d' ' -f1 /proc/uptime; }
echo "[rxe-vm] booted, uptime $(up)s"
for m in $(cat /mods/order); do insmod /mods/$m || echo "[rxe-vm] insmod $m failed"; done
ip link set lo up; ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2 2>/dev/null
o=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o $o,ro,cache=loose hostroot /host || echo "[rxe-vm] 9p hostroot mount failed"
for d in proc sys dev; do mount --bind /$d /host/$d; done
for d in tmp run var/tmp dev/shm; do mkdir -p /host/$d; mount -t tmpfs -o mode=1777 tmpfs /host/$d; done
mkdir -p /host/run/rxe-ctl
mount -t 9p -o $o ctl /host/run/rxe-ctl || echo "[rxe-vm] 9p ctl mount failed"
. /host/run/rxe-ctl/vars
mkdir -p "/host$WORKDIR" 2>/dev/null
mount -t 9p -o $o work "/host$WORKDIR" || echo "[rxe-vm] 9p work mount failed"
chroot /host /usr/bin/env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  rdma link add rxe0 type rxe netdev eth0 || echo "[rxe-vm] rdma link add failed"
echo "[rxe-vm] rxe0 ready (modules+9p+rxe), uptime $(up)s"
ulimit -l unlimited
echo "[rxe-vm] ===== command start ====="
timeout "$GUEST_TIMEOUT" chroot /host /usr/bin/env -i HOME=/tmp TERM=dumb LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  RXE_DEV=rxe0 RXE_IP=10.0.2.15 $SHELL_BIN /run/rxe-ctl/cmd.sh < /dev/null
rc=$?
echo "[rxe-vm] ===== command end rc=$rc ====="
echo $rc > /host/run/rxe-ctl/rc
echo "[rxe-vm] done, uptime $(up)s, mem used $(free -m | awk '/Mem:/{print $3}') MiB"
umount /host/run/rxe-ctl "/host$WORKDIR" 2>/dev/null
poweroff -f
EOF
  chmod +x "$B/init"
  (cd "$B" && find . | cpio -o -H newc 2>/dev/null | gzip -1) > "$INITRD.tmp"
  mv "$INITRD.tmp" "$INITRD"; rm -rf "$B"
fi
flock -u 9; exec 9>&-

# ------------------------------------------------------------ per-run ctl ---
RUNS=$CACHE/runs; mkdir -p "$RUNS"
CTL=$(mktemp -d "$RUNS/run.XXXXXX")
trap 'rm -rf "$CTL"' EXIT
SHELL_BIN=/bin/bash; [ -x /bin/bash ] || SHELL_BIN=/bin/sh
GUEST_TIMEOUT=$(( TIMEOUT > 30 ? TIMEOUT - 15 : TIMEOUT ))
{ printf 'WORKDIR=%q\nGUEST_TIMEOUT=%q\nSHELL_BIN=%q\n' "$HOSTDIR" "$GUEST_TIMEOUT" "$SHELL_BIN"; } > "$CTL/vars"
{ printf 'cd %q || exit 125\n' "$HOSTDIR"; printf '%q ' "$@"; printf '\n'; } > "$CTL/cmd.sh"

# ------------------------------------------------------------------ accel ---
ACCEL=${RXE_VM_ACCEL:-auto}
if [ "$ACCEL" = auto ]; then
  if [ -r /dev/kvm ] && [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ]; then ACCEL=kvm; else ACCEL=tcg; fi
fi
if [ "$ACCEL" = kvm ]; then ACC=(-accel kvm -cpu host); else ACC=(-accel tcg,thread=multi -cpu max); fi
log "kernel $KV, accel $ACCEL, ${SMP} vCPU, ${MEM} MiB, timeout ${TIMEOUT}s, dir $HOSTDIR"

# -------------------------------------------------------------------- run ---
set +e
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 "${ACC[@]}" -m "$MEM" -smp "$SMP" \
  -nodefaults -no-user-config -display none -serial stdio -no-reboot \
  -kernel "$VMLINUZ" -initrd "$INITRD" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off" \
  -netdev user,id=n0 -device virtio-net-pci,netdev=n0 \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$HOSTDIR",mount_tag=work,security_model=none,multidevs=remap \
  -virtfs local,path="$CTL",mount_tag=ctl,security_model=none \
  < /dev/null 2>&1 | tr -d '\r' | {
    if [ $QUIET = 1 ]; then
      awk '/^\[rxe-vm\] ===== command end/{p=0} p{print; fflush()} /^\[rxe-vm\] ===== command start/{p=1}'
    else cat; fi; }
qrc=${PIPESTATUS[0]}
set -e
T1=$(date +%s.%N)
if [ -f "$CTL/rc" ]; then rc=$(cat "$CTL/rc"); [ "$rc" = 143 ] && rc=124
elif [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then rc=124; log "TIMEOUT after ${TIMEOUT}s"
else rc=125; log "VM failed (qemu exit $qrc) before the command finished"; fi
log "exit code $rc, wall $(awk "BEGIN{printf \"%.1f\", $T1-$T0}")s"
exit "$rc"
