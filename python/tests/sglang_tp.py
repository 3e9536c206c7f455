"""One prefill TP rank of SGLang's prefill scheduler, for one request, in its own process
(so that a test can SIGKILL or SIGSTOP it): the bootstrap queue until the decode's
destination arrived, then on the test's word the request's pages in a few chunks (one
per scheduler step, the last few only on the test's word) or an abort (``sender.abort()``, as on an
AbortReq), then the inflight queue until the request ended (Success -> clear, Failed
-> failure_exception).

The test drives the decode ranks itself (test_sglang_tp.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import sglang_sched

STEP_S = 0.001
REST_PAGES = 4
"""The pages a prefill rank sends only once the test said "more" (see prefill_rank)."""


def source_byte(rank: int, buf: int) -> int:
    """The byte every source page of ``rank``'s buffer ``buf`` holds (never 0 and never
    sglang_sched.POISON)."""
    return 0x10 * (rank + 1) + buf + 1


def rank_args(kv: list[np.ndarray], aux: np.ndarray, rank: int, page_bytes: int) -> Any:
    a = sglang_sched.kv_args(kv, aux, rank)
    a.kv_item_lens = [page_bytes] * len(kv)
    return a


def prefill_rank(conn: Any, rank: int, tp: int, port: int, n_pages: int, page_bytes: int,
                 config: str) -> None:
    from kvxfer.sglang import KVPoll, KVTransferError, KvxferKVManager, KvxferKVSender
    from kvxfer.sglang.conn import CONFIG_ENV

    os.environ[CONFIG_ENV] = config
    kv = [np.full((n_pages, page_bytes), source_byte(rank, b), np.uint8)
          for b in range(sglang_sched.N_BUFS)]
    aux = np.full((2, sglang_sched.AUX_BYTES), source_byte(rank, 0), np.uint8)
    mgr = KvxferKVManager(rank_args(kv, aux, rank, page_bytes), "prefill",
                          sglang_sched.server_args(port, tp))
    conn.send("up")  # registered with the bootstrap server
    room = conn.recv()
    sender = KvxferKVSender(mgr, f"127.0.0.1:{port}", room)
    deadline = time.monotonic() + 60
    while sender.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(STEP_S)
    state = sender.poll()
    if state == KVPoll.WaitingForInput:
        sender.init(n_pages, 0)
    conn.send(int(state))
    cmd = conn.recv()
    if cmd == "abort":
        sender.abort()
    elif cmd == "send":
        # Chunked prefill: all pages but the last REST_PAGES, then on the word "more"
        # those, one page per scheduler step (so the test can stop this process in the
        # first chunk's payload with the rest not yet sent).
        first = n_pages - REST_PAGES
        sender.send(np.arange(first, dtype=np.int32))
        while not conn.poll(STEP_S):
            pass
        assert conn.recv() == "more"
        for page in range(first, n_pages):
            sender.send(np.array([page], dtype=np.int32))
            time.sleep(STEP_S)
    outcome, reason = "left", None
    while time.monotonic() < deadline:
        p = sender.poll()
        if p == KVPoll.Success:
            sender.clear()
            outcome = "success"
            break
        if p == KVPoll.Failed:
            outcome = "failed"
            try:
                sender.failure_exception()
            except KVTransferError as e:
                reason = e.failure_reason
            break
        time.sleep(STEP_S)
    m = mgr.engine.metrics()
    conn.send({"outcome": outcome, "reason": reason, "rooms_draining": m["rooms_draining"],
               "inflight": m["inflight"]})
    conn.recv()
    mgr.close()
