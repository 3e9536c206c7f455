"""A room's timeline with one request in flight: destination sent, first byte sent,
first and last byte received, next destination. kvxfer-bench reports a room's latency
from enqueue to SUCCESS and to the decode scheduler's first poll that saw it TRANSFERRING
(first_byte_ms), not when its first byte leaves the prefill or its last one arrives; this
reads the whole timeline off the kernel.

It runs the peers.py libkvxfer command (--concurrency 1) without baselines and records,
system-wide but only during the kvxfer phase, with CLOCK_MONOTONIC timestamps: the decode
engine's send of the room's destination (its control writer's sendmsg, or the scheduler's
own sendto on an idle connection; with one request in flight the next one's goes out only
after the room before it succeeded), sched:sched_wakeup (the prefill scheduler or control
reader waking the worker or link sender that takes the room's chunk), the sender's
sys_enter_sendmsg and the decode receivers' sys_exit_recvfrom and sys_exit_readv (with how
much each read returned). Run as root (run.sh --firstbyte).
"""

import argparse
import os
import queue
import re
import select
import signal
import statistics
import subprocess
import threading
import time

import peers

EVENTS = ("sched:sched_wakeup,syscalls:sys_enter_sendmsg,syscalls:sys_enter_sendto,"
          "syscalls:sys_exit_recvfrom,syscalls:sys_exit_readv")
LINE = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+(\d+\.\d+):\s+(\S+):\s*(.*)$")


def record(a, b, rooms, tag):
    cmd = peers.kvxfer_cmd(a, b, 1, rooms) + ["--no-baselines"]
    data = os.path.join(a.log_dir, tag + ".perf.data")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    q = queue.Queue()

    def pump():
        for line in p.stderr:
            q.put(line.rstrip("\n"))
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    # System-wide (perf record -p misses threads started after it attached, such as the
    # decode side's data receivers), counters off until the phase starts; the events of
    # other processes are left out when reading.
    child = None
    t = time.time()
    while child is None and time.time() - t < 60:
        try:
            kids = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
        except OSError:
            kids = []
        child = int(kids[0]) if kids else None
        time.sleep(0.005)
    if child is None:
        raise RuntimeError("kvxfer-bench started no prefill process")
    pids = [p.pid, child]
    ctl_r, ctl_w = os.pipe()
    ack_r, ack_w = os.pipe()
    rec = subprocess.Popen(["perf", "record", "-q", "-D", "-1", "--control", f"fd:{ctl_r},{ack_w}",
                            "-m", "4096", "-k", "CLOCK_MONOTONIC", "-e", EVENTS, "-a", "-o", data],
                           pass_fds=(ctl_r, ack_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(ctl_r)
    os.close(ack_w)
    while True:
        line = q.get(timeout=a.timeout)
        if line is None:
            raise RuntimeError("kvxfer-bench ended before its kvxfer phase")
        # "...: kvxfer, phase 1 of 1, auth off"
        if re.search(r": kvxfer, phase 1 of 1(,|$)", line):
            break
    os.write(ctl_w, b"enable\n")
    if not select.select([ack_r], [], [], 5)[0]:
        raise RuntimeError("perf record did not acknowledge 'enable'")
    # perf knows the names only of threads it saw start: the others are read from /proc
    # while the phase runs.
    comms = {}
    done = threading.Event()

    def names():
        while not done.is_set():
            for pid in pids:
                try:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        comms[int(tid)] = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                except OSError:
                    pass
            time.sleep(0.02)

    threading.Thread(target=names, daemon=True).start()
    out, _ = p.communicate(timeout=a.timeout)
    done.set()
    rec.send_signal(signal.SIGINT)
    rec.wait(timeout=60)
    script = subprocess.run(["perf", "script", "-i", data, "-F", "comm,pid,tid,time,event,trace"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    return pids[0], pids[1], script, comms


def timeline(decode_pid, prefill_pid, script, room_bytes, comms):
    """Per room, seconds: the decode engine sending its destination (a sendmsg of its
    control writer; with one request in flight the next room's goes out only after the
    last one succeeded; the control writer's sendmsg, or the decode scheduler's own send
    when the connection was idle), the wakeup of the prefill thread that takes its chunk (a
    worker, or a link's sender when the chunk was planned by the prefill scheduler's enqueue
    or by the control reader; none if it was still running), its first sendmsg, the decode
    receivers' first and last read. A stretch with under half a room of bytes (a
    heartbeat's sendmsg) is folded into the room before it."""
    segs = []
    cur = None
    for line in script.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        comm, pid, tid = m.group(1), int(m.group(2)), int(m.group(3))
        t, ev, rest = float(m.group(4)), m.group(5), m.group(6)
        comm = comms.get(tid, comm)
        # The destination: written by the control writer, or directly by the thread that
        # queued it when the connection was idle (a send from the decode scheduler).
        if (ev.startswith(("syscalls:sys_enter_sendmsg", "syscalls:sys_enter_sendto")) and pid == decode_pid
                and comm.startswith(("kvxfer-ctrl-tx", "kvxfer-bench"))):
            cur = {"dest": t, "woken": None, "by": "(running)", "send": None, "recv0": None, "recv1": None, "bytes": 0}
            segs.append(cur)
        elif cur is None:
            continue
        elif ev.startswith("sched:sched_wakeup"):
            if (pid == prefill_pid and ("comm=kvxfer-worker" in rest or "comm=kvxfer-send" in rest)
                    and cur["woken"] is None
                    and cur["send"] is None and comm.startswith(("kvxfer-bench", "kvxfer-ctrl-rx"))):
                cur["woken"], cur["by"] = t, comm
        elif ev.startswith("syscalls:sys_enter_sendmsg"):
            # The link's sender thread (a worker, before the per-link senders).
            if pid == prefill_pid and comm.startswith(("kvxfer-send", "kvxfer-worker")) and cur["send"] is None:
                cur["send"] = t
        elif ev.startswith(("syscalls:sys_exit_recvfrom", "syscalls:sys_exit_readv")):
            if pid == decode_pid and comm.startswith("kvxfer-recv"):
                ret = int(rest.split()[-1], 16)
                if 0 < ret < 1 << 40:
                    cur["recv0"] = cur["recv0"] or t
                    cur["recv1"] = t
                    cur["bytes"] += ret
    rooms = []
    for g in segs:
        if rooms and g["bytes"] < room_bytes / 2:
            r = rooms[-1]
            r["bytes"] += g["bytes"]
            r["recv1"] = g["recv1"] or r["recv1"]
            continue
        rooms.append(g)
    wakers = {}
    for r in rooms:
        wakers[r["by"]] = wakers.get(r["by"], 0) + 1
    return [r for r in rooms if r["send"] and r["recv0"] and r["bytes"] >= room_bytes], wakers


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="target/release/kvxfer-bench")
    ap.add_argument("--pages", default="1m,32k")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--poll-us", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--log-dir", default="build/bench-peers/firstbyte")
    a = ap.parse_args()
    os.makedirs(a.log_dir, exist_ok=True)
    print("| pages | rooms traced | destination sent -> first sendmsg (of which sender woken ->) "
          "| first sendmsg -> first byte read | first -> last byte read | last byte read -> next destination sent "
          "| period | idle share |")
    print("|---|---|---|---|---|---|---|---|")
    for pg in a.pages.split(","):
        b = peers.size_arg(pg)
        rooms = max(2, round(a.gib * (1 << 30) / (peers.SLOT_PAGES * b)))
        d, pf, script, comms = record(a, b, rooms, f"firstbyte-{b >> 10}k")
        tl, wakers = timeline(d, pf, script, peers.SLOT_PAGES * b, comms)
        if len(tl) < 2:
            print(f"| {peers.size_name(b)} | {len(tl)} | (too few rooms traced) |")
            continue
        us = lambda v: statistics.median(v) * 1e6 if v else float("nan")
        d2s = [r["send"] - r["dest"] for r in tl]
        woken = [r["send"] - r["woken"] for r in tl if r["woken"] is not None]
        s2r = [r["recv0"] - r["send"] for r in tl]
        data = [r["recv1"] - r["recv0"] for r in tl]
        gap = [n["dest"] - r["recv1"] for r, n in zip(tl, tl[1:])]
        period = [n["dest"] - r["dest"] for r, n in zip(tl, tl[1:])]
        idle = (us(d2s) + us(s2r) + us(gap)) / us(period)
        print(f"| {peers.size_name(b)} | {len(tl)} of {rooms} | {us(d2s):.0f} us ({us(woken):.0f}) | {us(s2r):.0f} us | "
              f"{us(data):.0f} us | {us(gap):.0f} us | {us(period):.0f} us | {idle:.1%} |", flush=True)
        print(f"(rooms handed to a sender or worker by: {wakers})", flush=True)


if __name__ == "__main__":
    main()
