"""Two settings of one kvxfer-bench option against each other, on the bench-peers cells
and single-page rooms/s, alternating, in one run.

- `--compare same-host` (issue 34): `--same-host require` (the same-host path) against
  `--same-host off` (libkvxfer's TCP path); the same-host runs also measure a memcpy of
  the same pages to scattered places on as many threads as the engine copies with
  (`ratio_vs_memcpy_pages`).
- `--compare integrity` (issue 36): `--integrity verify` against `--integrity off`, over
  TCP, with each side's CPU seconds per GB.
- `--compare builds --bench-b OTHER`: this build's kvxfer-bench (`--bench`) against
  another build's (`--bench-b`, say a commit before a change, built in a worktree), with
  the same options, over TCP: whether a change costs anything (issue 37).

Each cell (page size x requests in flight, the work of bench/peers/peers.py) runs
--alternations times; within an alternation kvxfer-bench runs once with each setting,
in an order rotated each time. Then the single-page preset's rooms/s, alternating the
same way. Ratios are taken inside each alternation and summarised as median [min-max].

    python3 bench/alternate.py --compare same-host|integrity [--alternations 3]
    python3 bench/alternate.py --compare builds --bench-b /path/to/other/kvxfer-bench

Run through `make bench-same-host` and `make bench-integrity`.
"""

import argparse
import json
import statistics
import subprocess
import sys

SLOT_PAGES = 128


def run(bench, args):
    out = subprocess.run([bench, *args, "--json"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"kvxfer-bench {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cell_args(page_bytes, conc, rooms):
    tokens = page_bytes // 2048  # MLA latent 1024 x 2 bytes = 2048 bytes per token
    return ["--layers", "1", "--layout", "mla", "--latent-dim", "1024", "--dtype-bytes", "2",
            "--page-tokens", str(tokens), "--prompt", str(SLOT_PAGES * tokens),
            "--chunk-tokens", str(SLOT_PAGES * tokens), "--dst-order", "shuffled",
            "--verify", "sample", "--aux-bytes", "0", "--concurrency", str(conc),
            "--rooms", str(rooms), "--repeat", "1"]


def summary(xs):
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


COMPARES = {
    # option: (setting A, setting B, names of A and B, extra options of every run)
    "same-host": ("require", "off", ("same-host", "TCP path"), []),
    "integrity": ("verify", "off", ("verify", "off"), ["--same-host", "off"]),
    "builds": ("this", "other", ("this build", "other build"), ["--same-host", "off"]),
}


def cpu_per_gb(j):
    """CPU seconds per GB of the kvxfer phases: decode process, prefill process."""
    per = j["cpu_s_per_gb"]
    return per["decode"], per["prefill"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="target/release/kvxfer-bench")
    ap.add_argument("--compare", choices=sorted(COMPARES), default="same-host")
    ap.add_argument("--alternations", type=int, default=3)
    ap.add_argument("--bench-b", help="with --compare builds: the other build's kvxfer-bench")
    a = ap.parse_args()
    va, vb, (na, nb), extra = COMPARES[a.compare]
    flag = "--" + a.compare
    if a.compare == "builds":
        if not a.bench_b:
            sys.exit("--compare builds needs --bench-b")
        print(f"{a.bench} against {a.bench_b}; load average before: {loadavg()}")
    else:
        print(f"{flag} {va} against {flag} {vb}; load average before: {loadavg()}")

    def go(m, args):
        """One run with setting `m`: its build, or its value of the option."""
        if a.compare == "builds":
            return run(a.bench if m == va else a.bench_b, args + extra)
        return run(a.bench, args + extra + [flag, m])

    rows = []
    for page, conc, rooms in [(32 << 10, 1, 200), (32 << 10, 4, 400), (1 << 20, 1, 12), (1 << 20, 4, 24)]:
        ga, gb, ratio, vs_mem, vs_stream, cpu = [], [], [], [], [], []
        for i in range(a.alternations):
            order = [va, vb] if i % 2 == 0 else [vb, va]
            got = {m: go(m, cell_args(page, conc, rooms)) for m in order}
            ja, jb = got[va], got[vb]
            ga.append(ja["gbps"])
            gb.append(jb["gbps"])
            ratio.append(ja["gbps"] / jb["gbps"])
            if ja.get("ratio_vs_memcpy_pages") is not None:
                vs_mem.append(ja["ratio_vs_memcpy_pages"])
            vs_stream.append(ja["ratio_vs_tcp"])
            cpu.append((cpu_per_gb(ja), cpu_per_gb(jb)))
        name = f"{page >> 20} MiB" if page >= 1 << 20 else f"{page >> 10} KiB"
        rows.append((f"{name} x{conc}", summary(ga), summary(gb), summary(ratio),
                     summary(vs_mem) if vs_mem else "", summary(vs_stream)))
        (da, pa), (db, pb) = [tuple(statistics.median(c[k][i] for c in cpu) for i in (0, 1))
                              for k in (0, 1)]
        print(f"{rows[-1][0]}: {na} {rows[-1][1]} GB/s, {nb} {rows[-1][2]} GB/s, "
              f"{na}/{nb} {rows[-1][3]}; CPU s/GB decode/prefill {na} {da:.3f}/{pa:.3f}, "
              f"{nb} {db:.3f}/{pb:.3f}", flush=True)
    rps_a, rps_b, rps = [], [], []
    for i in range(a.alternations):
        order = [va, vb] if i % 2 == 0 else [vb, va]
        got = {m: go(m, ["--preset", "single-page", "--repeat", "1"]) for m in order}
        ra = got[va]["kvxfer_runs_rooms_per_sec"][0]
        rb = got[vb]["kvxfer_runs_rooms_per_sec"][0]
        rps_a.append(ra)
        rps_b.append(rb)
        rps.append(ra / rb)
    print(f"load average after: {loadavg()}")
    print()
    print(f"| cell | {na} GB/s | {nb} GB/s | {na} / {nb} | {na} / memcpy of the pages (same "
          f"threads) | {na} / TCP stream |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"| single-page rooms/s | {summary(rps_a)} | {summary(rps_b)} | {summary(rps)} | | |")


if __name__ == "__main__":
    main()
