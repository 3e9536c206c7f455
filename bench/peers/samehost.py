"""bench-peers' same-host mode (`peers.py --same-host`, issue 34): libkvxfer's same-host
path against NIXL with UCX restricted to its same-host transports, on the cells and the
work of the TCP comparison, alternating, in one run.

- libkvxfer: peers.py's kvxfer-bench command plus `--same-host require` (the decode
  process copies from the prefill process's registered memory with process_vm_readv; with
  require a pairing that cannot take the path fails its rooms, so a run that checks is a
  run on that path). Its JSON line's same_host says require.
- NIXL: pair.py as in the TCP comparison, with UCX_TLS set to each --nixl-tls variant and
  the UCX backend's ucx_error_handling_mode none (`pair.py --nixl-err-mode none`): UCX's
  shared-memory transports have no peer failure handler, and with the backend's default
  (peer) UCX refuses them ("no active messages transport ... no peer failure handler").
  UCX logs at info level with UCX_PROTO_INFO=y into the run's log folder; the protocol UCX
  chose for the initiator's ucp_put* to the target (its "intra-node" configuration) and
  for its active messages are read back from that log and reported for every variant, so
  the table says what NIXL really used. The variant with the highest median GB/s in a
  cell is that cell's "NIXL best same-host"; libkvxfer is divided by it inside each
  alternation.
- Mooncake: its wheel is probed for a same-host transport (TransferEngine.initialize with
  protocol "shm"); the probe's finding is printed as the reason it is skipped.
"""

import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

import peers

# UCX 1.23 (NIXL 1.5.1's): "sm" and "shm" name the same set (posix, sysv, cma; knem and
# xpmem are not in the wheel). "cma,self" alone cannot connect two processes: CMA has no
# active messages, which UCP needs for its wireup and NIXL's notifications.
DEFAULT_TLS = "sm,self;posix,cma,self;sysv,cma,self;posix,self;sysv,self"


def nixl_env(a, tls, tag):
    return {
        "UCX_TLS": tls,
        "UCX_LOG_LEVEL": "info",
        "UCX_PROTO_INFO": "y",
        "UCX_LOG_FILE": os.path.join(os.path.abspath(a.log_dir), tag + ".ucx.%p.log"),
    }


_CELL = re.compile(r"\]\s+\|(.*)\|\s*$")


def ucx_protocols(a, tag):
    """What UCX chose for the initiator's intra-node endpoint: {"put": [...], "am": [...]}
    as "RANGE DESCRIPTION CONFIG" strings, from UCX_PROTO_INFO's tables in its log."""
    out = {}
    for f in sorted(glob.glob(os.path.join(a.log_dir, glob.escape(tag) + ".ucx.*.log"))):
        with open(f, errors="replace") as fh:
            lines = fh.read().splitlines()
        if not any("UCX  INFO    initiator-" in l for l in lines):
            continue
        titles, rows = [], None
        for l in lines:
            m = _CELL.search(l)
            if not m:
                continue
            cells = [c.strip() for c in m.group(1).split("|")]
            if len(cells) == 1:
                if rows is not None:
                    titles, rows = [], None
                titles.append(cells[0])
                continue
            if cells[0] == "Range":
                rows = []
                if len(titles) == 2 and "intra-node cfg#" in titles[0]:
                    key = {
                        "remote memory write by ucp_put* from host memory to host": "put",
                        "active message by ucp_am_send* from host memory": "am",
                    }.get(titles[1])
                    if key:
                        out[key] = rows
                continue
            if rows is not None and len(cells) == 3:
                rows.append(" ".join(cells))
    return out


def mooncake_probe():
    """Whether this Mooncake wheel has a same-host transport: the reason to skip it."""
    code = (
        "import os\n"
        "from mooncake.engine import TransferEngine\n"
        "e = TransferEngine()\n"
        "print('rc', e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'shm', ''), flush=True)\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, GLOG_logtostderr="1", GLOG_minloglevel="0")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        return "its probe (TransferEngine.initialize with protocol 'shm') did not finish in 60 s"
    log = p.stdout + p.stderr
    installed = sorted(set(re.findall(r"\b(\w+Transport): listen", log)))
    if installed == ["TcpTransport"]:
        return ("its wheel has no shared-memory transport: protocol 'shm' (like any name it does not "
                "know, e.g. 'local', 'cxl') initialises its TCP transport ('TcpTransport: listen on port ...'); "
                "the wheel builds TcpTransport and RdmaTransport only")
    last = log.strip().splitlines()[-1] if log.strip() else f"exit {p.returncode}"
    return f"protocol 'shm' did not give a same-host transport this bench drives (probe said: {last})"


def variant_name(tls):
    return f"NIXL {tls}"


def summarise(cell, variants):
    per = {"kvxfer": [], "memcpy": [], "cores_kvxfer": []}
    per.update({t: [] for t in variants})
    per.update({"cores " + t: [] for t in variants})
    for r in cell["runs"]:
        k = r.get("kvxfer", {})
        if "gbps" in k:
            per["kvxfer"].append(k["gbps"])
            per["cores_kvxfer"].append(k.get("cores_busy"))
            if k.get("memcpy_gbps"):
                per["memcpy"].append(statistics.mean(k["memcpy_gbps"]))
        for t in variants:
            n = r.get("nixl:" + t, {})
            if "gbps" in n:
                per[t].append(n["gbps"])
                per["cores " + t].append(n.get("cores_busy"))
    s = {k: peers.med(v) for k, v in per.items()}
    # The best variant: the highest median among those that checked in every alternation.
    full = [t for t in variants if s[t] and s[t]["n"] == len(cell["runs"])]
    best = max(full, key=lambda t: s[t]["median"]) if full else None
    ratios = []
    if best:
        for r in cell["runs"]:
            k, n = r.get("kvxfer", {}), r.get("nixl:" + best, {})
            if "gbps" in k and "gbps" in n:
                ratios.append(k["gbps"] / n["gbps"])
    s["best"] = best
    s["kvxfer/best"] = peers.med(ratios)
    s["kvxfer/best_runs"] = ratios
    return s


def table(cells, variants):
    head = ["pages", "in flight", "libkvxfer same-host GB/s", "NIXL best same-host GB/s", "NIXL best UCX_TLS",
            "libkvxfer / NIXL best"] + [f"NIXL {t} GB/s" for t in variants] + [
            "memcpy GB/s", "cores busy kvx/NIXL best"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        s = c["summary"]
        b = s["best"]
        cores = "/".join(peers.fmt(s.get(k), 2).split(" ")[0] for k in ("cores_kvxfer", f"cores {b}"))
        row = [peers.size_name(c["page_bytes"]), str(c["inflight"]), peers.fmt(s["kvxfer"]),
               peers.fmt(s[b]) if b else "-", f"`{b}`" if b else "-", peers.fmt(s["kvxfer/best"])]
        row += [peers.fmt(s[t]) for t in variants]
        row += [peers.fmt(s["memcpy"]), cores]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def run(a, engines, pages, inflight, skipped):
    variants = [t.strip() for t in a.nixl_tls.split(";") if t.strip()] if "nixl" in engines else []
    if "mooncake" in engines:
        skipped["mooncake"] = mooncake_probe()
    for e, why in skipped.items():
        print(f"bench-peers --same-host: {peers.NAMES.get(e, e)} skipped: {why}", flush=True)
    runners = ["kvxfer"] + ["nixl:" + t for t in variants]
    cells = [{"page_bytes": b, "inflight": c, "runs": []} for b in pages for c in inflight]
    protocols = {t: [] for t in variants}
    errors = []
    t_start = time.time()
    for alt in range(a.alternations):
        for cell in cells:
            b, c = cell["page_bytes"], cell["inflight"]
            rooms = max(1, round(a.gib * (1 << 30) / (peers.SLOT_PAGES * b)))
            order = runners[alt % len(runners):] + runners[: alt % len(runners)]
            run_ = {"alternation": alt, "order": order, "rooms": rooms, "loadavg": os.getloadavg()[0]}
            for e in order:
                t = time.time()
                if e == "kvxfer":
                    tag = f"samehost-kvxfer-{b >> 10}k-{c}-alt{alt}"
                    r = peers.run_kvxfer(a, b, c, rooms, tag)
                    if "error" not in r and r.get("same_host") != "require":
                        r = {"error": f"kvxfer-bench's JSON says same_host {r.get('same_host')!r}, not 'require'"}
                    name = "libkvxfer same-host"
                else:
                    tls = e.split(":", 1)[1]
                    tag = f"samehost-nixl-{tls.replace(',', '+')}-{b >> 10}k-{c}-alt{alt}"
                    r = peers.run_pair(a, "nixl", b, c, rooms, tag, env_set=nixl_env(a, tls, tag),
                                       pair_args=["--nixl-err-mode", "none"])
                    proto = ucx_protocols(a, tag)
                    r["ucx_protocols"] = proto
                    seen = (f"put {'; '.join(proto['put'])}" if proto.get("put")
                            else "no intra-node ucp_put* table in the UCX log")
                    if seen not in protocols[tls]:
                        protocols[tls].append(seen)
                    name = variant_name(tls)
                run_[e] = r
                if "error" in r:
                    errors.append(f"{name} {peers.size_name(b)} x{c} alternation {alt}: {r['error']}")
                    print(f"bench-peers --same-host: {errors[-1]}", flush=True)
                else:
                    extra = f" (put: {seen})" if e != "kvxfer" else ""
                    print(f"bench-peers --same-host: alternation {alt + 1}/{a.alternations} {peers.size_name(b)} pages, "
                          f"{c} in flight: {name} {r['gbps']:.2f} GB/s, cores busy {r['cores_busy']:.2f}{extra} "
                          f"[{time.time() - t:.0f} s, load {os.getloadavg()[0]:.2f}]", flush=True)
            cell["runs"].append(run_)
    for cell in cells:
        cell["summary"] = summarise(cell, variants)
    print()
    print(f"Same host: GB/s delivered and verified (sampled), median [min-max] of {a.alternations} alternations; "
          f"the ratio taken within each alternation against the cell's best NIXL variant (highest median). "
          f"{peers.SLOT_PAGES} pages per request, one buffer per side, scattered destinations, WRITE, "
          f"poll {a.poll_us} us, ~{a.gib:g} GiB per engine phase; libkvxfer with --same-host require, NIXL "
          f"with UCX_TLS as named and ucx_error_handling_mode none; {time.time() - t_start:.0f} s in all.")
    print(table(cells, variants))
    print()
    print("What UCX chose for NIXL's writes (the initiator's intra-node ucp_put*, from UCX_PROTO_INFO):")
    for t in variants:
        print(f"- UCX_TLS={t}: {' | '.join(protocols[t]) or '-'}")
    for e, why in skipped.items():
        print(f"({peers.NAMES.get(e, e)} skipped: {why})")
    for err in errors:
        print("error:", err)
    print(json.dumps({
        "bench": "peers-same-host",
        "config": {"pages": pages, "inflight": inflight, "alternations": a.alternations, "gib": a.gib,
                   "poll_us": a.poll_us, "slot_pages": peers.SLOT_PAGES, "nixl_tls": variants,
                   "kvxfer_cmd": " ".join(peers.kvxfer_cmd(a, pages[0], inflight[0], 0))},
        "versions": peers.versions(),
        "loadavg": os.getloadavg()[0],
        "skipped": skipped,
        "ucx_put_protocols": protocols,
        "errors": errors,
        "cells": cells,
    }))
    return 1 if errors else 0
