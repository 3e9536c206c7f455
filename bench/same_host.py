"""libkvxfer's same-host path against its TCP path and a memcpy of the same pages, on the
bench-peers cells, alternating, in one run (issue 34's targets).

Each cell (page size x requests in flight, the work of bench/peers/peers.py) runs
--alternations times; within an alternation kvxfer-bench runs once with
`--same-host require` and once with `--same-host off`, in an order rotated each time.
The same-host run also measures a memcpy of the same pages to scattered places on as
many threads as the engine copies with (`ratio_vs_memcpy_pages`). Then the single-page
preset's rooms/s, alternating the same way. Ratios are taken inside each alternation
and summarised as median [min-max].

    python3 bench/same_host.py [--bench target/release/kvxfer-bench] [--alternations 3]

Run through `make bench-same-host`.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="target/release/kvxfer-bench")
    ap.add_argument("--alternations", type=int, default=3)
    a = ap.parse_args()
    print(f"load average before: {loadavg()}")
    rows = []
    for page, conc, rooms in [(32 << 10, 1, 200), (32 << 10, 4, 400), (1 << 20, 1, 12), (1 << 20, 4, 24)]:
        sh, tcp, vs_tcp, vs_mem, vs_stream = [], [], [], [], []
        for i in range(a.alternations):
            order = ["require", "off"] if i % 2 == 0 else ["off", "require"]
            got = {m: run(a.bench, cell_args(page, conc, rooms) + ["--same-host", m]) for m in order}
            s, t = got["require"], got["off"]
            sh.append(s["gbps"])
            tcp.append(t["gbps"])
            vs_tcp.append(s["gbps"] / t["gbps"])
            vs_mem.append(s["ratio_vs_memcpy_pages"])
            vs_stream.append(s["ratio_vs_tcp"])
        name = f"{page >> 20} MiB" if page >= 1 << 20 else f"{page >> 10} KiB"
        rows.append((f"{name} x{conc}", summary(sh), summary(tcp), summary(vs_tcp),
                     summary(vs_mem), summary(vs_stream)))
        print(f"{rows[-1][0]}: same-host {rows[-1][1]} GB/s, TCP path {rows[-1][2]} GB/s, "
              f"same-host/TCP {rows[-1][3]}, /memcpy of the pages {rows[-1][4]}", flush=True)
    rps_sh, rps_tcp, rps = [], [], []
    for i in range(a.alternations):
        order = ["require", "off"] if i % 2 == 0 else ["off", "require"]
        got = {m: run(a.bench, ["--preset", "single-page", "--repeat", "1", "--same-host", m])
               for m in order}
        s = got["require"]["kvxfer_runs_rooms_per_sec"][0]
        t = got["off"]["kvxfer_runs_rooms_per_sec"][0]
        rps_sh.append(s)
        rps_tcp.append(t)
        rps.append(s / t)
    print(f"load average after: {loadavg()}")
    print()
    print("| cell | same-host GB/s | TCP path GB/s | same-host / TCP path | same-host / memcpy of "
          "the pages (same threads) | same-host / TCP stream |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"| single-page rooms/s | {summary(rps_sh)} | {summary(rps_tcp)} | {summary(rps)} | | |")


if __name__ == "__main__":
    main()
