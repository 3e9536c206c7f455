#!/usr/bin/env python3
"""Sends a fixed set of prompts, greedy, to an OpenAI completions endpoint and prints one JSON
line per prompt: the prompt's token count, the generated token ids and the time to the first
streamed token. Two runs (say a single vLLM and a prefill/decode pair behind the proxy) are
compared with `diff` on their outputs less the timing field (--no-timing).

    complete.py http://127.0.0.1:8000 [--max-tokens 16] [--no-timing]
"""

import argparse
import http.client
import json
import sys
import time
import urllib.parse

# Short and long prompts (the tiny model's block is 128 tokens), two sharing a long prefix.
PROMPTS = [
    "Hello world, the sea shells",
    "Once upon a time " * 20,
    "The quick brown fox jumps over the lazy dog. " * 40,
    "The quick brown fox jumps over the lazy dog. " * 40 + "Pages of the cache.",
    "Pages of the cache are registered once. " * 5,
]


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft = None
    tokens: list[int] = []
    n_prompt = None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        for choice in chunk.get("choices", []):
            ids = choice.get("token_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens.extend(ids)
            if choice.get("prompt_token_ids"):
                n_prompt = len(choice["prompt_token_ids"])
    conn.close()
    return {"prompt_tokens": n_prompt, "tokens": tokens, "ttft_s": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    for p in PROMPTS:
        r = complete(args.url, p, args.max_tokens)
        if args.no_timing:
            r.pop("ttft_s")
        print(json.dumps(r), flush=True)
        if len(r["tokens"]) != args.max_tokens:
            sys.exit(f"expected {args.max_tokens} tokens, got {len(r['tokens'])}")


if __name__ == "__main__":
    main()
