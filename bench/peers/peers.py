"""libkvxfer against NIXL and Mooncake TE on the same work, alternating, in one run.

Each cell (page size x requests in flight) is run --alternations times; within an
alternation the engines run back to back, in an order rotated each time:

- libkvxfer as `kvxfer-bench --layers 1 --layout mla --latent-dim 1024 --dtype-bytes 2
  --page-tokens B/2048 --prompt 128*B/2048 --chunk-tokens 128*B/2048 --dst-order shuffled
  --verify sample --aux-bytes 0 --concurrency C --rooms R --repeat 1 --poll-us P`, whose
  own TCP stream baseline (before and after its phase, same volume, between its two
  processes, over as many connections as the engine uses) is the "stream" of the
  alternation;
- NIXL (UCX over TCP) and Mooncake TE (TCP) through their Python APIs (pair.py): the same
  one buffer per side, R requests of 128 pages of B bytes, source pages in order,
  destination pages scattered by kvxfer-bench's permutation, WRITE, the same sampled
  check of every request that landed; their scheduler loops poll every P us
  (kvxfer-bench's sleep in the engine's wait instead, P bounding only the wait for a
  failed room to drain).

Ratios are taken inside each alternation, then summarised as median [min-max]. Run it
through `make bench-peers` (bench/peers/run.sh), which installs the peers into a virtual
environment and runs this inside a private network namespace.

With --same-host the same cells and work compare libkvxfer's same-host path
(`--same-host require`) with NIXL on UCX's same-host transports instead (samehost.py):
`make bench-peers PEERS_ARGS=--same-host`.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SLOT_PAGES = 128
NAMES = {"kvxfer": "libkvxfer", "nixl": "NIXL", "mooncake": "Mooncake"}


def size_arg(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
    for suf in sorted(mult, key=len, reverse=True):
        if s.endswith(suf):
            return int(s[: -len(suf)]) * mult[suf]
    return int(s)


def size_name(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def kvxfer_cmd(a, page_bytes, conc, rooms):
    tokens = page_bytes // 2048  # MLA latent 1024 x 2 bytes = 2048 bytes per token
    return [
        a.bench, "--layers", "1", "--layout", "mla", "--latent-dim", "1024", "--dtype-bytes", "2",
        "--page-tokens", str(tokens), "--prompt", str(SLOT_PAGES * tokens),
        "--chunk-tokens", str(SLOT_PAGES * tokens), "--dst-order", "shuffled",
        "--verify", "sample", "--aux-bytes", "0", "--concurrency", str(conc),
        "--rooms", str(rooms), "--repeat", "1", "--poll-us", str(a.poll_us), "--json",
    ] + (["--same-host", "require"] if getattr(a, "same_host", False) else [])


def log_path(a, tag):
    os.makedirs(a.log_dir, exist_ok=True)
    return os.path.join(a.log_dir, tag + ".log")


def run_kvxfer(a, page_bytes, conc, rooms, tag):
    cmd = kvxfer_cmd(a, page_bytes, conc, rooms)
    with open(log_path(a, tag), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=a.timeout)
    lines = p.stdout.strip().splitlines()
    try:
        j = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"kvxfer-bench exited {p.returncode} without JSON (see {log_path(a, tag)})"}
    if p.returncode != 0 or j.get("unexpected_failures", 0) or j.get("prefill_unexpected_failures", 0):
        return {"error": f"kvxfer-bench exited {p.returncode}: {j.get('errors')}", "raw": j}
    gb = j["bytes"] / 1e9
    return {
        "gbps": j["gbps"],
        "bytes": j["bytes"],
        "bytes_checked": j["bytes_checked"],
        "rooms_ok": j["rooms_ok"],
        "stream_gbps": j["baseline_tcp_runs_gbps"],
        "cores_busy": j["cores_busy"]["kvxfer"],
        "stream_cores_busy": j["cores_busy"]["baseline_tcp"],
        # The whole host's (the kernel's softirq threads too), where /proc/stat says.
        "host_cores_busy": j["cores_busy"].get("host_kvxfer"),
        "stream_host_cores_busy": j["cores_busy"].get("host_baseline_tcp"),
        "cpu_s_per_gb": j["cpu_s_per_gb"],
        "latency_ms": j["latency_ms"],
        "loadavg": j["loadavg"],
        "same_host": j.get("same_host"),
        "memcpy_gbps": j.get("baseline_memcpy_runs_gbps"),
        "gb": gb,
    }


def run_pair(a, engine, page_bytes, conc, rooms, tag, env_set=None, pair_args=()):
    """Both sides of a peer engine; the target's JSON line is the result. env_set
    (variables set, overriding the environment) and pair_args (pair.py options) are the
    same-host mode's: without them the run is today's (UCX over TCP on lo, unless the
    environment says otherwise)."""
    t_sock, i_sock = socket.socketpair()
    env = dict(os.environ)
    if env_set is None:
        env.setdefault("UCX_TLS", "tcp")
        env.setdefault("UCX_NET_DEVICES", "lo")
    else:
        env.update(env_set)
    env.setdefault("GLOG_minloglevel", "1")
    common = [
        sys.executable, os.path.join(HERE, "pair.py"), "--engine", engine,
        "--page-bytes", str(page_bytes), "--slot-pages", str(SLOT_PAGES),
        "--concurrency", str(conc), "--rooms", str(rooms), "--poll-us", str(a.poll_us),
    ] + list(pair_args)
    with open(log_path(a, tag), "w") as log:
        log.write("".join(f"{k}={v} " for k, v in (env_set or {}).items()) + " ".join(common) + "\n")
        log.flush()
        tgt = subprocess.Popen(
            common + ["--role", "target", "--ctl-fd", str(t_sock.fileno())],
            pass_fds=[t_sock.fileno()], stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        )
        ini = subprocess.Popen(
            common + ["--role", "initiator", "--ctl-fd", str(i_sock.fileno())],
            pass_fds=[i_sock.fileno()], stdout=log, stderr=log, text=True, env=env,
        )
        t_sock.close()
        i_sock.close()
        try:
            out, _ = tgt.communicate(timeout=a.timeout)
            ini.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for p in (tgt, ini):
                p.kill()
                p.wait()
            return {"error": f"{engine} did not finish in {a.timeout} s (see {log_path(a, tag)})"}
        finally:
            for p in (tgt, ini):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    lines = [l for l in (out or "").splitlines() if l.startswith("{")]
    if tgt.returncode != 0 or ini.returncode != 0 or not lines:
        return {"error": f"{engine}: target exited {tgt.returncode}, initiator {ini.returncode} (see {log_path(a, tag)})"}
    j = json.loads(lines[-1])
    if j["rooms_failed_verify"] or j["rooms_ok"] != rooms:
        return {"error": f"{engine}: {j['rooms_ok']} of {rooms} requests checked: {j['errors']}", "raw": j}
    j["gb"] = j["bytes"] / 1e9
    return j


def med(v):
    v = [x for x in v if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def fmt(s, digits=2):
    if s is None:
        return "-"
    m, lo, hi = (f"{s[k]:.{digits}f}" for k in ("median", "min", "max"))
    return m if lo == hi else f"{m} [{lo}-{hi}]"


def summarise(cell):
    """Per-alternation ratios, then median [min-max] of every figure."""
    per = {k: [] for k in (
        "kvxfer", "nixl", "mooncake", "stream", "kvxfer/nixl", "kvxfer/mooncake", "kvxfer/stream",
        "nixl/stream", "mooncake/stream", "cores_kvxfer", "cores_nixl", "cores_mooncake", "cores_stream",
        "host_kvxfer", "host_stream")}
    for r in cell["runs"]:
        g = {e: r[e]["gbps"] for e in ("kvxfer", "nixl", "mooncake") if e in r and "gbps" in r[e]}
        for e, v in g.items():
            per[e].append(v)
            per["cores_" + e].append(r[e].get("cores_busy"))
        stream = None
        if "kvxfer" in g:
            stream = statistics.mean(r["kvxfer"]["stream_gbps"])
            per["stream"].append(stream)
            per["cores_stream"].append(r["kvxfer"]["stream_cores_busy"])
            per["host_kvxfer"].append(r["kvxfer"].get("host_cores_busy"))
            per["host_stream"].append(r["kvxfer"].get("stream_host_cores_busy"))
        for num, den in (("kvxfer", "nixl"), ("kvxfer", "mooncake")):
            if num in g and den in g:
                per[f"{num}/{den}"].append(g[num] / g[den])
        for e in ("kvxfer", "nixl", "mooncake"):
            if e in g and stream:
                per[f"{e}/stream"].append(g[e] / stream)
    return {k: med(v) for k, v in per.items()}


def table(a, cells):
    head = ["pages", "in flight", "libkvxfer GB/s", "NIXL GB/s", "Mooncake GB/s", "TCP stream GB/s",
            "libkvxfer/NIXL", "libkvxfer/Mooncake", "libkvxfer/stream", "NIXL/stream",
            "Mooncake/stream", "cores busy kvx/NIXL/MC/stream", "host busy kvx/stream"]
    rows = []
    for c in cells:
        s = c["summary"]
        cores = "/".join(fmt(s["cores_" + e], 2).split(" ")[0] for e in ("kvxfer", "nixl", "mooncake", "stream"))
        host = "/".join(fmt(s[k], 2).split(" ")[0] for k in ("host_kvxfer", "host_stream"))
        rows.append([size_name(c["page_bytes"]), str(c["inflight"]), fmt(s["kvxfer"]), fmt(s["nixl"]),
                     fmt(s["mooncake"]), fmt(s["stream"]), fmt(s["kvxfer/nixl"]), fmt(s["kvxfer/mooncake"]),
                     fmt(s["kvxfer/stream"]), fmt(s["nixl/stream"]), fmt(s["mooncake/stream"]), cores, host])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def versions():
    v = {}
    for dist in ("nixl-cu12", "mooncake-transfer-engine-non-cuda", "numpy"):
        try:
            from importlib.metadata import version

            v[dist] = version(dist)
        except Exception:
            v[dist] = None
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="target/release/kvxfer-bench")
    ap.add_argument("--engines", default="kvxfer,nixl,mooncake", help="kvxfer is always run")
    ap.add_argument("--pages", default="32k,1m", help="page sizes, comma-separated")
    ap.add_argument("--inflight", default="1,4", help="requests in flight, comma-separated")
    ap.add_argument("--alternations", type=int, default=3)
    ap.add_argument("--gib", type=float, default=4.0, help="volume of each engine's phase, GiB")
    ap.add_argument("--poll-us", type=int, default=100, help="every scheduler loop's idle sleep")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--log-dir", default="build/bench-peers")
    ap.add_argument("--skipped", default="", help="ENGINE=why;... (said by run.sh)")
    ap.add_argument("--same-host", action="store_true",
                    help="libkvxfer's same-host path (--same-host require) against NIXL with UCX's same-host "
                         "transports instead of the TCP comparison (samehost.py)")
    ap.add_argument("--nixl-tls", default=None,
                    help="--same-host: the UCX_TLS values NIXL runs with, semicolon-separated "
                         "[samehost.DEFAULT_TLS]")
    a = ap.parse_args()
    engines = ["kvxfer"] + [e for e in a.engines.split(",") if e and e != "kvxfer"]
    pages = [size_arg(x) for x in a.pages.split(",")]
    inflight = [int(x) for x in a.inflight.split(",")]
    skipped = dict(x.split("=", 1) for x in a.skipped.split(";") if "=" in x)
    if a.same_host:
        import samehost

        if a.nixl_tls is None:
            a.nixl_tls = samehost.DEFAULT_TLS
        sys.exit(samehost.run(a, engines, pages, inflight, skipped))
    for e, why in skipped.items():
        print(f"bench-peers: {NAMES.get(e, e)} skipped: {why}", flush=True)
    cells = [{"page_bytes": b, "inflight": c, "runs": []} for b in pages for c in inflight]
    errors = []
    t_start = time.time()
    for alt in range(a.alternations):
        for cell in cells:
            b, c = cell["page_bytes"], cell["inflight"]
            rooms = max(1, round(a.gib * (1 << 30) / (SLOT_PAGES * b)))
            order = engines[alt % len(engines):] + engines[: alt % len(engines)]
            run = {"alternation": alt, "order": order, "rooms": rooms}
            for e in order:
                tag = f"{e}-{b >> 10}k-{c}-alt{alt}"
                t = time.time()
                if e == "kvxfer":
                    r = run_kvxfer(a, b, c, rooms, tag)
                else:
                    r = run_pair(a, e, b, c, rooms, tag)
                run[e] = r
                if "error" in r:
                    errors.append(f"{NAMES[e]} {size_name(b)} x{c} alternation {alt}: {r['error']}")
                    print(f"bench-peers: {errors[-1]}", flush=True)
                else:
                    extra = ""
                    if e == "kvxfer":
                        extra = " (stream " + " ".join(f"{x:.2f}" for x in r["stream_gbps"]) + ")"
                    print(f"bench-peers: alternation {alt + 1}/{a.alternations} {size_name(b)} pages, {c} in flight: "
                          f"{NAMES[e]} {r['gbps']:.2f} GB/s{extra}, cores busy {r['cores_busy']:.2f} "
                          f"[{time.time() - t:.0f} s]", flush=True)
            cell["runs"].append(run)
    for cell in cells:
        cell["summary"] = summarise(cell)
    print()
    print(f"Peers: GB/s delivered and verified (sampled), median [min-max] of {a.alternations} alternations; "
          f"ratios taken within each alternation. {SLOT_PAGES} pages per request, one buffer per side, "
          f"scattered destinations, WRITE, peers' scheduler poll {a.poll_us} us (libkvxfer's waits), ~{a.gib:g} GiB per engine phase; "
          f"{time.time() - t_start:.0f} s in all.")
    print(table(a, cells))
    for e, why in skipped.items():
        print(f"({NAMES.get(e, e)} skipped: {why})")
    for err in errors:
        print("error:", err)
    print(json.dumps({
        "bench": "peers",
        "config": {"pages": pages, "inflight": inflight, "alternations": a.alternations, "gib": a.gib,
                   "poll_us": a.poll_us, "slot_pages": SLOT_PAGES, "engines": engines,
                   "kvxfer_cmd": " ".join(kvxfer_cmd(a, pages[0], inflight[0], 0))},
        "versions": versions(),
        "loadavg": os.getloadavg()[0],
        "skipped": skipped,
        "errors": errors,
        "cells": cells,
    }))
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
