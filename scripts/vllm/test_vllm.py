#!/usr/bin/env python3
"""`make test-vllm`: KvxferConnector inside real vLLM servers, checked against one vLLM.

1. A single vLLM (no disaggregation, no prefix cache) answers every prompt: the reference
   greedy tokens. It stays up as the baseline of the TTFT phase.
2. A prefill and a decode vLLM joined by KvxferConnector, and a prefill and a decode vLLM
   joined by vLLM's NixlConnector (UCX over TCP, KV in CPU memory), each pair behind
   `python -m kvxfer.vllm.proxy`, all on loopback.
3. Through the kvxfer pair: the prompts (short and long, exact block multiples, shared
   prefixes), twice over and concurrently; then client cancellations at random points
   (during the prefill leg, during the decode leg, after some tokens), mixed with normal
   requests; a request whose decode leg never comes, and one whose decode leg comes after
   the prefill gave its room up.
4. Times to first token, alternating request by request between the two pairs and the
   single vLLM, and the CPU each server used meanwhile and when idle.
5. Checks: the greedy tokens of every completed request (kvxfer and NIXL) equal the
   single vLLM's; both kvxfer servers come back to nothing running, waiting or held
   (vLLM's own gauges, `vllm:kv_cache_usage_perc` 0: no leaked block) and to no room in
   their engines (`vllm:kvxfer_rooms`, `vllm:kvxfer_pending_requests`); the decode never
   served a request whose room failed (its log names every failed room's request, and
   the late request must be among them, unserved).

Prints the checks and a TTFT table; exits 1 if a check fails. Servers are started with
scripts/vllm/vllm-serve.sh, each in its own process group, and stopped by that group.

    test_vllm.py [--venv build/vllm-venv] [--model build/tiny-llama] [--out build/vllm-test]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24  # compared tokens per request (a corrupt KV shows within 16, VLLM-NOTES 3.1)
TTFT_TOKENS = 16
PREFILL_BOOTSTRAP_MS = 15000  # how long a kvxfer prefill room waits for its decode
VOCAB = 485  # scripts/vllm/make_tiny_llama.py's tokenizer
REQUEST_TIMEOUT = 120.0  # a request still open after this is stuck
# Every server: no torch.compile (a quicker, lighter start on 2 shared cores; the tokens are
# the same, VLLM-NOTES 2.2) and 512 blocks of KV cache (64 Ki tokens).
COMMON = ["--enforce-eager", "--num-gpu-blocks-override", "512"]

FAILURES: list[str] = []


def check(ok: bool, what: str) -> bool:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILURES.append(what)
    return ok


# ---------------------------------------------------------------------------------------
# Prompts


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def correctness_prompts() -> dict[str, object]:
    """Short and long, around block boundaries (128 tokens), sharing prefixes."""
    rng = random.Random(17)
    base = ids(rng, 600)
    fox = "The quick brown fox jumps over the lazy dog. " * 40
    return {
        "text-9": "Hello world, the sea shells",
        "text-100": "Once upon a time " * 20,
        "text-440": fox,
        "text-445-shares-440": fox + "Pages of the cache.",
        "ids-1": ids(rng, 1),
        "ids-127": ids(rng, 127),
        "ids-128": ids(rng, 128),
        "ids-129": ids(rng, 129),
        "ids-256": ids(rng, 256),
        "ids-600-base": base,
        "ids-650-shares-600": base + ids(rng, 50),
        "ids-690-shares-600": base + ids(rng, 90),
        "ids-1500": ids(rng, 1500),
        "ids-1900": ids(rng, 1900),
    }


def ttft_prompts(rounds: int) -> list[dict[str, object]]:
    """One set per round, each prompt unique (no prefix-cache hit across rounds)."""
    rng = random.Random(29)
    out = []
    for r in range(rounds):
        out.append({
            f"r{r}-text-9": f"Round {r}: hello world, the sea shells",
            **{f"r{r}-ids-{n}": ids(rng, n) for n in (100, 128, 256, 512, 1024, 1500)},
        })
    return out


# ---------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    name: str
    port: int
    log: Path
    pgid: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Fleet:
    """Every process this test started, stopped by process group at the end."""

    def __init__(self, venv: Path, model: Path, out: Path):
        self.venv, self.model, self.out = venv, model, out
        self.servers: list[Server] = []
        self.proxies: list[subprocess.Popen] = []

    def start(self, specs: list[tuple[str, str, list[str], dict[str, str]]]) -> list[Server]:
        """Starts vLLM servers at once: (name, core, vLLM args, environment)."""
        procs = []
        for name, core, args, env in specs:
            s = Server(name, free_port(), self.out / f"{name}.log")
            self.servers.append(s)
            e = {**os.environ, "VENV": str(self.venv), "MODEL": str(self.model), "CORE": core,
                 "VLLM_CACHE_ROOT": str(self.out.parent / "vllm-cache"), **env}
            procs.append((s, subprocess.Popen(
                [str(ROOT / "scripts/vllm/vllm-serve.sh"), name, str(s.port), str(self.out), *args],
                env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        bad = []
        for s, p in procs:
            text, _ = p.communicate()
            pgid_file = self.out / f"{s.name}.pgid"
            if pgid_file.exists() and pgid_file.read_text().strip():
                s.pgid = int(pgid_file.read_text())
            print("  " + text.strip().replace("\n", "\n  "), flush=True)
            if p.returncode != 0:
                bad.append(s.name)
        if bad:
            raise SystemExit(f"test-vllm: {', '.join(bad)} did not start (logs in {self.out})")
        return [s for s, _ in procs]

    def proxy(self, name: str, prefill: Server, decode: Server) -> Server:
        s = Server(name, free_port(), self.out / f"{name}.log")
        p = subprocess.Popen(
            [str(self.venv / "bin/python"), "-m", "kvxfer.vllm.proxy", "--prefill", prefill.url,
             "--decode", decode.url, "--port", str(s.port)],
            stdout=s.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.proxies.append(p)
        s.pgid = p.pid
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(s.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return s
            except OSError:
                pass
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"test-vllm: proxy {name} did not start; see {s.log}")
            time.sleep(0.2)

    def stop(self, servers: list[Server] | None = None) -> None:
        targets = self.servers if servers is None else servers
        for s in targets:
            if s.pgid:
                try:
                    os.killpg(s.pgid, signal.SIGTERM)
                except ProcessLookupError:
                    s.pgid = None
        for s in targets:
            deadline = time.monotonic() + 30
            while s.pgid and time.monotonic() < deadline:
                try:
                    os.killpg(s.pgid, 0)
                except ProcessLookupError:
                    s.pgid = None
                    break
                time.sleep(0.2)
            if s.pgid:
                try:
                    os.killpg(s.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                s.pgid = None
        if servers is None:
            for p in self.proxies:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                p.wait(10)


# ---------------------------------------------------------------------------------------
# Client


@dataclasses.dataclass
class Result:
    name: str
    req_id: str
    status: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    ttft: float | None = None
    error: str | None = None
    cancelled: bool = False  # the client closed the connection before the answer ended
    done: bool = False  # the answer ended ([DONE] or a full JSON body)
    body: dict | None = None

    @property
    def served(self) -> bool:
        return self.status == 200 and self.done and bool(self.tokens)


def completion(url: str, name: str, req_id: str, prompt: object, max_tokens: int, *,
               stream: bool = True, extra: dict | None = None, cancel_after_s: float | None = None,
               cancel_after_tokens: int | None = None) -> Result:
    """One /v1/completions request, greedy; optionally closed by the client mid-flight."""
    host, port = url.removeprefix("http://").split(":")
    r = Result(name, req_id)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True, **(extra or {})}
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
    lock = threading.Lock()

    def cancel() -> None:
        with lock:
            if r.done:
                return
            r.cancelled = True
        try:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    timer = threading.Timer(cancel_after_s, cancel) if cancel_after_s is not None else None
    t0 = time.perf_counter()
    try:
        conn.connect()
        if timer:
            timer.start()
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Request-Id": req_id})
        resp = conn.getresponse()
        r.status = resp.status
        if resp.status != 200:
            r.error = resp.read()[:300].decode("utf-8", "replace")
            with lock:
                r.done = True
            return r
        if not stream:
            r.body = json.loads(resp.read())
            r.tokens = list(r.body["choices"][0].get("token_ids") or [])
            with lock:
                r.done = True
            return r
        for raw in resp:
            line = raw.strip()
            if line == b"data: [DONE]":
                with lock:
                    r.done = not r.cancelled
                break
            if not line.startswith(b"data:"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                r.error = json.dumps(chunk["error"])[:300]
                continue
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids") or []
                if got and r.ttft is None:
                    r.ttft = time.perf_counter() - t0
                r.tokens.extend(got)
            if cancel_after_tokens is not None and len(r.tokens) >= cancel_after_tokens:
                cancel()
                break
    except (OSError, http.client.HTTPException, ValueError) as e:
        if not r.cancelled:
            r.error = f"{type(e).__name__}: {e}"
    finally:
        if timer:
            timer.cancel()
        conn.close()
    return r


def prefill_leg(server: Server, req_id: str, prompt: object) -> dict:
    """What the proxy does first: the prefill's kv_transfer_params for this prompt."""
    r = completion(server.url, "prefill-leg", req_id, prompt, 1, stream=False,
                   extra={"kv_transfer_params": {"do_remote_decode": True,
                                                 "do_remote_prefill": False}})
    if r.status != 200 or not r.body or not r.body.get("kv_transfer_params"):
        raise SystemExit(f"test-vllm: prefill leg of {req_id} failed: {r.status} {r.error}")
    return r.body["kv_transfer_params"]


# ---------------------------------------------------------------------------------------
# Metrics and logs


def metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:[a-z_]+)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)$', line)
        if m and "by_reason" not in m.group(1):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by the processes of a process group."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_of(servers: list[Server]) -> dict[str, float]:
    return {s.name: group_cpu_seconds(s.pgid) for s in servers if s.pgid}


QUIET = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:kvxfer_rooms", "vllm:kvxfer_pending_requests")


def wait_quiet(server: Server, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if all(m.get(k, -1) == 0 for k in QUIET) or time.monotonic() > deadline:
            return m
        time.sleep(1)


FAILED_LINE = re.compile(r"kvxfer: (?:room (\d+) of )?request (\S+) FAILED(?P<after> after its abort)?")


def failed_rooms(log: Path) -> dict[str, tuple[bool, str]]:
    """Request id -> (failed after this side's abort, the line), from a server's log."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        m = FAILED_LINE.search(line)
        if m:
            out[m.group(2)] = (bool(m.group("after")), line.strip())
    return out


# ---------------------------------------------------------------------------------------
# The phases


def run_reference(fleet: Fleet, prompts: dict[str, tuple[object, int]]
                  ) -> tuple[Server, dict[str, list[int]]]:
    """The single vLLM's greedy tokens: name -> (prompt, tokens to generate)."""
    # No prefix cache: its TTFT later must not come from these same prompts cached now.
    [single] = fleet.start([("single", "0", COMMON + ["--no-enable-prefix-caching"], {})])
    ref = {}
    for name, (p, n) in prompts.items():
        r = completion(single.url, name, f"ref-{name}", p, n)
        if not r.served or len(r.tokens) != n:
            raise SystemExit(f"test-vllm: the single vLLM failed on {name}: {r.status} {r.error}")
        ref[name] = r.tokens
    return single, ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=ROOT / "build/vllm-venv")
    ap.add_argument("--model", type=Path, default=ROOT / "build/tiny-llama")
    ap.add_argument("--out", type=Path, default=ROOT / "build/vllm-test")
    ap.add_argument("--rounds", type=int, default=4, help="TTFT rounds (7 prompts each)")
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.out.iterdir():
        f.unlink()
    nixl = not args.no_nixl and subprocess.run(
        [str(args.venv / "bin/python"), "-c", "import nixl._api"], capture_output=True).returncode == 0
    if not nixl and not args.no_nixl:
        print("test-vllm: nixl does not import in the venv; running without the NIXL pair")

    prompts = correctness_prompts()
    ttft_sets = ttft_prompts(args.rounds)
    every = {**{k: (v, MAX_TOKENS) for k, v in prompts.items()},
             **{k: (v, TTFT_TOKENS) for s in ttft_sets for k, v in s.items()}}
    fleet = Fleet(args.venv, args.model, args.out)
    t_start = time.monotonic()
    try:
        print(f"[1] single vLLM: reference tokens of {len(every)} prompts", flush=True)
        single, ref = run_reference(fleet, every)

        print("[2] prefill/decode pairs", flush=True)
        common = COMMON
        kv = lambda role, extra: json.dumps({  # noqa: E731
            "kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm",
            "kv_role": role, "kv_connector_extra_config": extra})
        specs = [
            ("kvxfer-prefill", "0", common + ["--kv-transfer-config", kv(
                "kv_producer", {"bootstrap_timeout_ms": PREFILL_BOOTSTRAP_MS})], {}),
            ("kvxfer-decode", "1", common + ["--no-enable-prefix-caching", "--kv-transfer-config",
                                             kv("kv_consumer", {})], {}),
        ]
        if nixl:
            nx = lambda role: json.dumps({  # noqa: E731
                "kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})
            specs += [
                ("nixl-prefill", "0", common + ["--kv-transfer-config", nx("kv_producer")],
                 {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp"}),
                ("nixl-decode", "1", common + ["--no-enable-prefix-caching", "--kv-transfer-config",
                                               nx("kv_consumer")],
                 {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp"}),
            ]
        t0 = time.monotonic()
        started = fleet.start(specs)
        print(f"  {len(started)} servers up in {time.monotonic() - t0:.0f} s", flush=True)
        kp, kd = started[0], started[1]
        kproxy = fleet.proxy("kvxfer-proxy", kp, kd)
        pairs = {"kvxfer": kproxy}
        if nixl:
            pairs["NIXL"] = fleet.proxy("nixl-proxy", started[2], started[3])
        pairs["single"] = single  # the baseline: one vLLM, no disaggregation, no proxy
        for label, px in pairs.items():  # NIXL's first request includes its handshake
            w = completion(px.url, "warm-up", f"warm-{label}", prompts["text-9"], MAX_TOKENS)
            check(w.tokens == ref["text-9"], f"{label}: a warm-up request gives the reference tokens")

        rng = random.Random(args.seed)
        results: list[Result] = []
        n = 0

        def rid(kind: str) -> str:
            nonlocal n
            n += 1
            return f"t{args.seed}x{n:03d}{kind}"

        print("[3] kvxfer pair: every prompt twice, 4 at a time", flush=True)
        with cf.ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(completion, kproxy.url, name, rid("ok"), p, MAX_TOKENS)
                    for _ in range(2) for name, p in prompts.items()]
            results += [j.result() for j in jobs]

        print("[3] kvxfer pair: client cancellations mixed with normal requests", flush=True)
        late: dict[str, object] = {}

        def late_decode() -> None:
            # The decode leg arrives after the prefill gave its room up: never served.
            req = rid("late")
            params = prefill_leg(kp, req, prompts["ids-256"])
            time.sleep(PREFILL_BOOTSTRAP_MS / 1e3 + 5)
            late["result"] = completion(kd.url, "late-decode", req, prompts["ids-256"], MAX_TOKENS,
                                        extra={"kv_transfer_params": params})

        late_thread = threading.Thread(target=late_decode)
        late_thread.start()
        long_names = ["ids-1500", "ids-1900", "ids-690-shares-600", "text-440"]
        cancel_jobs = []
        with cf.ThreadPoolExecutor(8) as pool:
            for i in range(12):
                name = long_names[i % len(long_names)]
                cancel_jobs.append(pool.submit(
                    completion, kproxy.url, name, rid("cs"), prompts[name], 200,
                    cancel_after_s=rng.uniform(0.01, 0.6)))
            for k in (1, 1, 3, 3, 8, 8):
                name = rng.choice(long_names)
                cancel_jobs.append(pool.submit(
                    completion, kproxy.url, name, rid("ct"), prompts[name], 200,
                    cancel_after_tokens=k))

            def direct(name: str, after: float) -> Result:
                # The proxy's two legs by hand, the decode leg closed right after sending.
                req = rid("cd")
                params = prefill_leg(kp, req, prompts[name])
                return completion(kd.url, name, req, prompts[name], 200, cancel_after_s=after,
                                  extra={"kv_transfer_params": params})

            for after in (0.001, 0.005, 0.02, 0.05):
                cancel_jobs.append(pool.submit(direct, rng.choice(long_names), after))
            lonely = rid("lonely")
            cancel_jobs.append(pool.submit(prefill_leg, kp, lonely, prompts["ids-650-shares-600"]))
            normal = [pool.submit(completion, kproxy.url, name, rid("ok"), prompts[name], MAX_TOKENS)
                      for name in rng.sample(sorted(prompts), 8)]
            cancelled = [j.result() for j in cancel_jobs[:-1]]
            cancel_jobs[-1].result()
            results += [j.result() for j in normal]

        print(f"[4] TTFT, alternating {' / '.join(pairs)}, "
              f"{args.rounds} rounds of {len(ttft_sets[0])} prompts", flush=True)
        ttft: dict[str, list[Result]] = {label: [] for label in pairs}
        everyone = started + [single]
        cpu0, t_ttft = cpu_of(everyone), time.monotonic()
        for r_i, s in enumerate(ttft_sets):
            order = list(pairs)[r_i % len(pairs):] + list(pairs)[:r_i % len(pairs)]
            for name, p in s.items():
                for label in order:
                    ttft[label].append(completion(pairs[label].url, name, rid(label[:2]), p,
                                                  TTFT_TOKENS))
        cpu_ttft = {k: v - cpu0[k] for k, v in cpu_of(everyone).items()}
        t_ttft = time.monotonic() - t_ttft
        late_thread.join()
        results += ttft["kvxfer"]

        print("[5] checks", flush=True)
        served = [r for r in results if r.served]
        wrong = [r for r in results if not r.served or r.tokens != ref[r.name]]
        check(not wrong, f"greedy tokens of {len(served)}/{len(results)} completed kvxfer requests "
                         f"equal the single vLLM's ({MAX_TOKENS} or {TTFT_TOKENS} tokens each)")
        for r in wrong[:5]:
            print(f"       {r.req_id} {r.name}: status {r.status} {r.error or ''} "
                  f"got {r.tokens[:8]}... want {ref[r.name][:8]}...")
        for label in pairs:
            if label == "kvxfer":
                continue
            nwrong = [r for r in ttft[label] if not r.served or r.tokens != ref[r.name]]
            check(not nwrong, f"greedy tokens of {len(ttft[label]) - len(nwrong)}/"
                              f"{len(ttft[label])} {label} requests of the TTFT phase equal the "
                              "reference run's")
        if nixl:
            text = (args.out / "nixl-prefill.log").read_text(errors="replace")
            print(f"       (NIXL prefill: {text.count('Releasing expired KV blocks')} requests' blocks "
                  f"released at its lease expiry, {text.count('Potentially invalid KV blocks')} of "
                  "them read by the decode afterwards)")
        stuck = [r for r in cancelled if r.error and "timed out" in r.error]
        check(not stuck, f"no cancelled request stuck ({len(cancelled)} sent)")
        n_cancel = sum(r.cancelled for r in cancelled)
        n_tokens = sum(r.cancelled and bool(r.tokens) for r in cancelled)
        cut_ok = [r for r in cancelled
                  if r.tokens[:MAX_TOKENS] != ref[r.name][:len(r.tokens[:MAX_TOKENS])]]
        check(not cut_ok, "the tokens a cancelled request got before it was cut match the "
                          "single vLLM's")
        legs = dict(re.findall(r"request (\S+): client went away during the (\w+) leg",
                               kproxy.log.read_text(errors="replace")))
        proxied = [r for r in cancelled if r.cancelled and not r.req_id.endswith("cd")]
        direct = [r for r in cancelled if r.req_id.endswith("cd")]
        seen = {leg: sum(legs.get(r.req_id) == leg for r in proxied) for leg in ("prefill", "decode")}
        print(f"       {n_cancel} of {len(cancelled)} cancelled by the client before the answer "
              f"ended ({n_tokens} after their first tokens): through the proxy {seen['prefill']} "
              f"during the prefill leg, {seen['decode']} during the decode leg, "
              f"{len(proxied) - sum(seen.values())} as the answer ended; "
              f"{sum(r.cancelled for r in direct)} of {len(direct)} on the decode server right "
              "after their prefill leg")
        check(n_cancel >= 10, "at least 10 requests were cancelled mid-flight")

        lr: Result = late["result"]  # type: ignore[assignment]
        check(not lr.served, f"the late decode request was not served (HTTP {lr.status}: "
                             f"{(lr.error or '')[:80]})")

        # Every room ends and everything held is given back, on both sides.
        wait_s = PREFILL_BOOTSTRAP_MS / 1e3 + 60
        for s in (kp, kd):
            m = wait_quiet(s, wait_s)
            vals = ", ".join(f"{k.removeprefix('vllm:')}={m.get(k, float('nan')):g}" for k in QUIET)
            check(all(m.get(k, -1) == 0 for k in QUIET), f"{s.name} ends with {vals}")
            print(f"       {s.name} rooms: succeeded {m.get('vllm:kvxfer_rooms_succeeded_total', 0):g}, "
                  f"failed {m.get('vllm:kvxfer_rooms_failed_total', 0):g}, aborted by it "
                  f"{m.get('vllm:kvxfer_rooms_aborted_total', 0):g}")

        # The decode never served a request whose room failed.
        dfail = failed_rooms(kd.log)
        pfail = failed_rooms(kp.log)
        bad = [r.req_id for r in results + cancelled
               if r.served and any(r.req_id in k and not after for k, (after, _) in dfail.items())]
        check(not bad, f"no served request had a failed room on the decode ({len(dfail)} rooms "
                       f"failed there, {sum(a for a, _ in dfail.values())} after the decode's own abort)")
        late_lines = [line for k, (after, line) in dfail.items() if lr.req_id in k and not after]
        check(bool(late_lines), "the late request's room failed on the decode, with its reason")
        for line in late_lines:
            print("       " + line[line.index("kvxfer:"):][:200])
        lonely_lines = [line for k, (_, line) in pfail.items() if lonely in k]
        check(bool(lonely_lines) and "bootstrap" in lonely_lines[0],
              "the prefill room nobody asked for failed at its bootstrap timeout and was freed")
        for name in (kp, kd):
            text = name.log.read_text(errors="replace")
            check("Traceback" not in text, f"no Python traceback in the {name.name} log")

        print(f"[6] time to first token, seconds ({len(ttft['kvxfer'])} requests each, "
              "alternating; the pairs through their proxy)", flush=True)
        print(f"       {'':10} {'p50':>8} {'p99':>8} {'mean':>8}")
        p50s = {}
        for label, rs in ttft.items():
            xs = sorted(r.ttft for r in rs if r.ttft is not None)
            if not xs:
                continue
            p50s[label] = pct(xs, 50)
            print(f"       {label:10} {pct(xs, 50):8.3f} {pct(xs, 99):8.3f} {statistics.mean(xs):8.3f}")
        for other in ("NIXL", "single"):
            if other in p50s:
                print(f"       p50 kvxfer / {other} = {p50s['kvxfer'] / p50s[other]:.2f}")
        idle0 = cpu_of(everyone)
        time.sleep(10)
        idle = {k: (v - idle0[k]) / 10 for k, v in cpu_of(everyone).items()}
        print(f"       CPU used by each server (cores): during the {t_ttft:.0f} s of TTFT requests / "
              "idle, 10 s after the last request")
        for name in cpu_ttft:
            print(f"       {name:15} {cpu_ttft[name] / t_ttft:5.2f} / {idle[name]:4.2f}")
        load = os.getloadavg()
        print(f"       (load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores)")
    finally:
        fleet.stop()
    took = time.monotonic() - t_start
    if FAILURES:
        print(f"make test-vllm: {len(FAILURES)} check(s) FAILED in {took:.0f} s (logs in {args.out})")
        return 1
    print(f"make test-vllm: every check passed in {took:.0f} s (logs in {args.out})")
    return 0


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile, linear between the nearest ranks."""
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


if __name__ == "__main__":
    sys.exit(main())
