"""Where the time goes: libkvxfer, its plain TCP stream and NIXL on one cell, profiled.

For each subject this attaches `perf stat --per-thread` to both of its processes, with
the counters off (-D -1) until the phase of interest starts and off again when it ends
(perf's --control), so that setup and teardown are not counted:

- libkvxfer: one `kvxfer-bench ... --repeat 1` run (the command of peers.py); the window
  is its kvxfer phase (from its "kvxfer, phase 1 of 1" line to the next "baseline tcp");
- the stream: the same run's second TCP baseline ("baseline tcp" to "baseline memcpy"),
  between the same two processes;
- NIXL: pair.py --marks, whose target waits on stdin until the counters are on.

Counted per process: task-clock (CPU), context switches, sched:sched_wakeup (wakeups
the process's threads issue, softirq work run in their context included),
raw_syscalls:sys_enter and the data-path syscalls one by one; and per thread, from
/proc/PID/task/TID/schedstat and status, CPU time and switches. Everything is reported
per GB moved in the window, next to the window's GB/s. Subjects alternate, --rounds
times. Run as root inside the network namespace (run.sh --profile does both).
"""

import argparse
import collections
import json
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import peers

HERE = os.path.dirname(os.path.abspath(__file__))
SYSCALLS = ["sendmsg", "sendto", "recvfrom", "recvmsg", "read", "write", "writev", "readv", "futex",
            "epoll_wait", "epoll_pwait", "poll", "ppoll", "clock_nanosleep", "nanosleep", "sched_yield"]
EVENTS = ["task-clock", "context-switches", "cpu-migrations", "sched:sched_wakeup", "raw_syscalls:sys_enter"] + [
    f"syscalls:sys_enter_{s}" for s in SYSCALLS]


def thread_snapshot(pids):
    """tid -> (pid, comm, on-CPU ns, voluntary switches, involuntary switches)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                comm = open(base + "/comm").read().strip()
                ns = int(open(base + "/schedstat").read().split()[0])
                st = open(base + "/status").read()
            except OSError:
                continue
            vol = int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", st).group(1))
            inv = int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", st).group(1))
            out[int(tid)] = (pid, comm, ns, vol, inv)
    return out


def thread_delta(a, b, secs):
    """Per thread name (digits folded: kvxfer-worker-3 -> kvxfer-worker-N): threads,
    cores busy over the window, switches."""
    agg = collections.defaultdict(lambda: [0, 0.0, 0, 0, 0])
    for tid, (pid, comm, ns, vol, inv) in b.items():
        ns0, vol0, inv0 = (a[tid][2], a[tid][3], a[tid][4]) if tid in a else (0, 0, 0)
        name = re.sub(r"\d+", "N", comm)
        g = agg[(pid, name)]
        g[0] += 1
        g[1] += (ns - ns0) / 1e9 / secs
        g[2] += vol - vol0
        g[3] += inv - inv0
    return agg


class Perf:
    """One `perf stat --per-thread` attached to `pids`, counting only while enabled."""

    def __init__(self, pids, out):
        self.out = out
        self.tid_pid = {}
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                self.tid_pid[int(tid)] = pid
        ctl_r, self.ctl_w = os.pipe()
        self.ack_r, ack_w = os.pipe()
        self.p = subprocess.Popen(
            ["perf", "stat", "-x,", "--per-thread", "-D", "-1", "--control", f"fd:{ctl_r},{ack_w}",
             "-e", ",".join(EVENTS), "-p", ",".join(str(p) for p in pids), "-o", out],
            pass_fds=(ctl_r, ack_w), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        os.close(ctl_r)
        os.close(ack_w)
        # perf says "Events disabled" once its counters are open.
        line = self.p.stdout.readline()
        if "disabled" not in line.lower():
            raise RuntimeError(f"perf stat did not start: {line.strip()} (is perf installed and usable?)")

    def _cmd(self, c):
        os.write(self.ctl_w, (c + "\n").encode())
        r, _, _ = select.select([self.ack_r], [], [], 5)
        if not r:
            raise RuntimeError(f"perf stat did not acknowledge '{c}'")
        os.read(self.ack_r, 64)

    def enable(self):
        self._cmd("enable")

    def disable(self):
        self._cmd("disable")

    def finish(self):
        """Per process: event -> count."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
        self.p.wait(timeout=30)
        per = collections.defaultdict(lambda: collections.defaultdict(float))
        for line in open(self.out):
            f = line.strip().split(",")
            if len(f) < 4 or line.startswith("#"):
                continue
            tid = int(f[0].rsplit("-", 1)[1])
            try:
                v = float(f[1])
            except ValueError:
                continue  # <not counted>
            per[self.tid_pid.get(tid, -1)][f[3]] += v
        return per


def figures(per_proc, names, gb, secs):
    out = {}
    for pid, ev in per_proc.items():
        if pid not in names:
            continue
        sysc = {s: ev.get(f"syscalls:sys_enter_{s}", 0) / gb for s in SYSCALLS}
        out[names[pid]] = {
            "cpu_s_per_gb": ev["task-clock"] / 1e3 / gb,
            "cores_busy": ev["task-clock"] / 1e3 / secs,
            "ctx_switches_per_gb": ev["context-switches"] / gb,
            "wakeups_per_gb": ev["sched:sched_wakeup"] / gb,
            "migrations_per_gb": ev["cpu-migrations"] / gb,
            "syscalls_per_gb": ev["raw_syscalls:sys_enter"] / gb,
            "syscalls_by_kind_per_gb": {k: v for k, v in sysc.items() if v >= 1},
        }
    return out


def threads_json(agg, names):
    return [
        {"process": names.get(pid, str(pid)), "thread": name, "threads": n, "cores_busy": busy,
         "voluntary": vol, "involuntary": inv}
        for (pid, name), (n, busy, vol, inv, _) in sorted(agg.items(), key=lambda kv: -kv[1][1])
        if busy >= 0.005
    ]


def lines_of(stream, q):
    for line in stream:
        q.put(line.rstrip("\n"))
    q.put(None)


def profile_kvxfer(a, b, c, rooms, tag):
    """The kvxfer phase and the stream after it, from one kvxfer-bench run."""
    cmd = peers.kvxfer_cmd(a, b, c, rooms)
    log = open(os.path.join(a.log_dir, tag + ".log"), "w")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    q = queue.Queue()
    threading.Thread(target=lines_of, args=(p.stderr, q), daemon=True).start()
    child = None
    t = time.time()
    while child is None and time.time() - t < 60:
        try:
            kids = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
        except OSError:
            kids = []
        child = int(kids[0]) if kids else None
        time.sleep(0.01)
    if child is None:
        raise RuntimeError("kvxfer-bench started no prefill process")
    pids = [p.pid, child]
    names = {p.pid: "decode", child: "prefill"}
    # Both processes' setup (engine, pool, registration) is done by the first
    # baseline; attach then, before the kvxfer phase.

    def wait_for(text):
        while True:
            line = q.get(timeout=a.timeout)
            if line is None:
                raise RuntimeError(f"kvxfer-bench ended before '{text}' (see {log.name})")
            log.write(line + "\n")
            # The phase line goes on (", auth off"); the baseline lines end there.
            if re.search(": " + re.escape(text) + "(,|$)", line):
                return

    wait_for("baseline tcp")
    perf_k = Perf(pids, os.path.join(a.log_dir, tag + ".perf-kvxfer"))
    perf_s = Perf(pids, os.path.join(a.log_dir, tag + ".perf-stream"))
    wait_for("kvxfer, phase 1 of 1")
    s0 = thread_snapshot(pids)
    perf_k.enable()
    tk0 = time.monotonic()
    wait_for("baseline tcp")
    perf_k.disable()
    tk1 = time.monotonic()
    s1 = thread_snapshot(pids)
    perf_s.enable()
    ts0 = time.monotonic()
    wait_for("baseline memcpy")
    perf_s.disable()
    ts1 = time.monotonic()
    out, _ = p.communicate(timeout=a.timeout)
    while True:
        line = q.get()
        if line is None:
            break
        log.write(line + "\n")
    j = json.loads(out.strip().splitlines()[-1])
    kp, sp = perf_k.finish(), perf_s.finish()
    gb = j["bytes"] / 1e9
    stream_gb = rooms * peers.SLOT_PAGES * b / 1e9
    return {
        "kvxfer": {
            "gbps": j["gbps"], "window_s": tk1 - tk0, "gb": gb,
            "processes": figures(kp, names, gb, tk1 - tk0),
            "threads": threads_json(thread_delta(s0, s1, tk1 - tk0), names),
            "bench_cpu_s_per_gb": j["cpu_s_per_gb"], "latency_ms": j["latency_ms"],
            "latency_decode_ms": j.get("latency_decode_ms"), "latency_prefill_ms": j.get("latency_prefill_ms"),
            "seconds": j["seconds"], "rooms": j["rooms_ok"],
        },
        "stream": {
            "gbps": j["baseline_tcp_runs_gbps"][-1], "window_s": ts1 - ts0, "gb": stream_gb,
            "processes": figures(sp, names, stream_gb, ts1 - ts0),
        },
    }


def profile_nixl(a, b, c, rooms, tag):
    t_sock, i_sock = socket.socketpair()
    env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"),
               UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    common = [sys.executable, os.path.join(HERE, "pair.py"), "--engine", "nixl", "--page-bytes", str(b),
              "--slot-pages", str(peers.SLOT_PAGES), "--concurrency", str(c), "--rooms", str(rooms),
              "--poll-us", str(a.poll_us)]
    log = open(os.path.join(a.log_dir, tag + ".log"), "w")
    tgt = subprocess.Popen(common + ["--role", "target", "--ctl-fd", str(t_sock.fileno()), "--marks"],
                           pass_fds=[t_sock.fileno()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    ini = subprocess.Popen(common + ["--role", "initiator", "--ctl-fd", str(i_sock.fileno())],
                           pass_fds=[i_sock.fileno()], stdout=log, stderr=log, text=True, env=env)
    t_sock.close()
    i_sock.close()
    q = queue.Queue()
    threading.Thread(target=lines_of, args=(tgt.stderr, q), daemon=True).start()
    try:
        def wait_for(mark):
            while True:
                line = q.get(timeout=a.timeout)
                if line is None:
                    raise RuntimeError(f"the NIXL target ended before '{mark}' (see {log.name})")
                log.write(line + "\n")
                if line == "pair.py: mark " + mark:
                    return

        wait_for("ready")
        pids = [tgt.pid, ini.pid]
        names = {tgt.pid: "target", ini.pid: "initiator"}
        perf = Perf(pids, os.path.join(a.log_dir, tag + ".perf"))
        s0 = thread_snapshot(pids)
        perf.enable()
        t0 = time.monotonic()
        tgt.stdin.write("\n")
        tgt.stdin.flush()
        wait_for("end")
        perf.disable()
        t1 = time.monotonic()
        s1 = thread_snapshot(pids)
        out, _ = tgt.communicate(timeout=a.timeout)
        ini.wait(timeout=30)
    finally:
        for p in (tgt, ini):
            if p.poll() is None:
                p.kill()
                p.wait()
    j = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    pp = perf.finish()
    gb = j["bytes"] / 1e9
    return {"nixl": {
        "gbps": j["gbps"], "window_s": t1 - t0, "gb": gb, "processes": figures(pp, names, gb, t1 - t0),
        "threads": threads_json(thread_delta(s0, s1, t1 - t0), names), "latency_ms": j["latency_ms"],
        "seconds": j["seconds"], "rooms": j["rooms_ok"],
    }}


def report(results):
    rows = []
    for r in results:
        for subj in ("kvxfer", "stream", "nixl"):
            if subj not in r:
                continue
            s = r[subj]
            for proc, f in s["processes"].items():
                k = f["syscalls_by_kind_per_gb"]
                top = ", ".join(f"{n} {v:,.0f}" for n, v in sorted(k.items(), key=lambda kv: -kv[1])[:4])
                rows.append(f"| {r['cell']} | {r['round']} | {subj} | {s['gbps']:.2f} | {proc} | "
                            f"{f['cores_busy']:.2f} | {f['cpu_s_per_gb']:.3f} | {f['ctx_switches_per_gb']:,.0f} | "
                            f"{f['wakeups_per_gb']:,.0f} | {f['syscalls_per_gb']:,.0f} | {top} |")
    head = ("| cell | round | subject | GB/s | process | cores busy | CPU s/GB | switches/GB | wakeups/GB | "
            "syscalls/GB | most frequent syscalls per GB |\n|---|---|---|---|---|---|---|---|---|---|---|")
    print(head)
    print("\n".join(rows))
    print()
    for r in results:
        for subj in ("kvxfer", "nixl"):
            if subj in r:
                th = ", ".join(f"{t['process']}/{t['thread']}x{t['threads']} {t['cores_busy']:.2f}"
                               for t in r[subj]["threads"][:8])
                print(f"{r['cell']} round {r['round']} {subj} threads (cores busy): {th}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="target/release/kvxfer-bench")
    ap.add_argument("--cells", default="1m:1,32k:4", help="PAGES:INFLIGHT,...")
    ap.add_argument("--subjects", default="kvxfer,nixl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--poll-us", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--log-dir", default="build/bench-peers/profile")
    a = ap.parse_args()
    os.makedirs(a.log_dir, exist_ok=True)
    results = []
    for rnd in range(a.rounds):
        for cell in a.cells.split(","):
            pg, c = cell.split(":")
            b, c = peers.size_arg(pg), int(c)
            rooms = max(1, round(a.gib * (1 << 30) / (peers.SLOT_PAGES * b)))
            subjects = a.subjects.split(",")
            if rnd % 2:
                subjects.reverse()
            for subj in subjects:
                tag = f"profile-{subj}-{b >> 10}k-{c}-r{rnd}"
                r = profile_kvxfer(a, b, c, rooms, tag) if subj == "kvxfer" else profile_nixl(a, b, c, rooms, tag)
                r.update(cell=f"{peers.size_name(b)} x{c}", round=rnd)
                results.append(r)
                print(f"profile: {r['cell']} round {rnd}: " + ", ".join(
                    f"{k} {v['gbps']:.2f} GB/s" for k, v in r.items() if isinstance(v, dict)), flush=True)
    print()
    report(results)
    print(json.dumps({"bench": "peers-profile", "loadavg": os.getloadavg()[0], "results": results}))


if __name__ == "__main__":
    main()
