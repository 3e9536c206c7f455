#!/usr/bin/env python3
"""The server integrations on device memory, for scripts/gpu-check.sh: the vLLM
connector's worker half (ConnectorWorker with the connector's scheduler logic, stepped
as vLLM steps them) and the SGLang backend (KvxferKVManager, sender and receiver, with a
bootstrap server), each with a prefill and a decode side in this process whose KV caches
are CUDA tensors (``--mem torch``) or the CUDA driver's test double's "device" memory
(``--mem fake``, to check this script on a machine without a GPU; says nothing about
GPUs). Byte-exact checks; one JSON line per case; nonzero exit on a failure.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import sys
import time

import numpy as np

import kvxfer

BLOCKS, PAGE, LAYERS = 32, 64 << 10, 3


class DevArray:
    """A (rows, cols) uint8 array in device memory, filled from ``init``."""

    def __init__(self, mem: str, init: np.ndarray):
        self.mem, self.shape = mem, init.shape
        if mem == "torch":
            import torch

            self.t = torch.from_numpy(init).to("cuda").contiguous()
            torch.cuda.synchronize()
            self.ptr, self.device = self.t.data_ptr(), self.t.device.index
        else:
            lib = ctypes.CDLL(os.environ["KVXFER_CUDA_LIBRARY"])
            lib.fakecuda_alloc.restype = ctypes.c_void_p
            lib.fakecuda_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t]
            self.ptr, self.device = lib.fakecuda_alloc(0, init.nbytes), 0
            ctypes.memmove(self.ptr, init.ctypes.data, init.nbytes)
        self.nbytes = init.nbytes

    def read(self) -> np.ndarray:
        if self.mem == "torch":
            import torch

            torch.cuda.synchronize()
            return self.t.cpu().numpy()
        return np.frombuffer(ctypes.string_at(self.ptr, self.nbytes), np.uint8).reshape(self.shape)


def until(fn, timeout=30.0, step=None):
    end = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > end:
            raise TimeoutError("timed out")
        if step:
            step()
        time.sleep(0.002)


def case_vllm(mem: str) -> dict:
    from kvxfer.vllm.plan import PREFILL_KEY
    from kvxfer.vllm.scheduler import DecodeScheduler, PrefillScheduler
    from kvxfer.vllm.worker import ConnectorWorker, LayerBuffer

    def side(role: str, seed: int):
        rng = np.random.default_rng(seed)
        cache = [DevArray(mem, rng.integers(0, 255, (BLOCKS, PAGE), dtype=np.uint8))
                 for _ in range(LAYERS)]
        w = ConnectorWorker(role, {"transport": "tcp"})
        w.register([LayerBuffer(f"model.layers.{i}.self_attn.attn", i, c.ptr, c.nbytes, PAGE,
                                c.device) for i, c in enumerate(cache)])
        s = PrefillScheduler() if role == "prefill" else DecodeScheduler(1)
        if role == "prefill":
            s.set_addresses({0: w.address})
        return cache, w, s

    (pc, pw, ps), (dc, dw, ds) = side("prefill", 1), side("decode", 2)
    got = {"sent": set(), "recv": set(), "failed": set()}

    def step():
        pw.apply(ps.build_plan())
        r = pw.results()
        ps.finished_sending(r.finished_sending)
        got["sent"] |= r.finished_sending
        dw.apply(ds.build_plan())
        r = dw.results()
        ds.finished_recving(r.finished_recving)
        got["recv"] |= r.finished_recving
        got["failed"] |= r.failed_recving

    tokens = 3 * 16 - 5
    src, dst = [3, 4, 5], [9, 10, 11]
    keep, params = ps.request_finished("p", {"do_remote_decode": True}, src, True, tokens)
    params = copy.deepcopy(params)
    n, _ = ds.num_new_matched_tokens(params, tokens, 0)
    ds.after_alloc("d", params, tokens, dst, n)
    until(lambda: "d" in got["recv"] or got["failed"], step=step)
    bad = None
    if got["failed"]:
        bad = f"decode reported failed: {got['failed']}"
    for layer in range(LAYERS):
        if not np.array_equal(dc[layer].read()[dst], pc[layer].read()[src]):
            bad = bad or f"layer {layer} differs"
    until(lambda: "p" in got["sent"], step=step)
    pw.close()
    dw.close()
    return dict(ok=bad is None and bool(params.get(PREFILL_KEY)), error=bad)


def case_sglang(mem: str) -> dict:
    os.environ["KVXFER_KV_MEMORY"] = "cuda"
    from kvxfer.sglang import (KVArgs, KVPoll, KvxferKVBootstrapServer, KvxferKVManager,
                               KvxferKVReceiver, KvxferKVSender)

    server = KvxferKVBootstrapServer("127.0.0.1", 0)
    sa = type("ServerArgs", (), dict(host="127.0.0.1", disaggregation_bootstrap_port=server.port,
                                      tp_size=1, dp_size=1, pp_size=1))()

    def manager(role: str, seed: int):
        rng = np.random.default_rng(seed)
        kv = [DevArray(mem, rng.integers(0, 255, (BLOCKS, PAGE), dtype=np.uint8))
              for _ in range(2)]
        aux = np.full((4, 64), seed, np.uint8)
        a = KVArgs()
        a.engine_rank, a.gpu_id = 0, kv[0].device
        a.kv_data_ptrs = [x.ptr for x in kv]
        a.kv_data_lens = [x.nbytes for x in kv]
        a.kv_item_lens = [PAGE] * 2
        a.kv_layer_ids = [0, 1]
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.ctypes.data], [aux.nbytes], [64]
        a.state_data_ptrs, a.state_types = [], []
        a.page_size, a.kv_cache_dtype_str = 16, "bfloat16"
        a.pp_rank, a.system_dp_rank, a.ib_device = 0, 0, None
        return kv, aux, KvxferKVManager(a, role, sa)

    (pkv, paux, pm), (dkv, daux, dm) = manager("prefill", 1), manager("decode", 2)
    src, dst = np.array([0, 1, 7, 8], np.int32), np.array([20, 21, 5, 6], np.int32)
    snd = KvxferKVSender(pm, server.address, 77)
    rcv = KvxferKVReceiver(dm, server.address, 77)
    until(lambda: dm.try_ensure_parallel_info(server.address))
    rcv.init(0)
    until(lambda: rcv.poll() != KVPoll.Bootstrapping)
    rcv.send_metadata(dst, 2)
    until(lambda: snd.poll() != KVPoll.Bootstrapping)
    snd.init(len(src), 1)
    snd.send(src)
    until(lambda: rcv.poll() in (KVPoll.Success, KVPoll.Failed))
    until(lambda: snd.poll() in (KVPoll.Success, KVPoll.Failed))
    bad = None
    if rcv.poll() != KVPoll.Success or snd.poll() != KVPoll.Success:
        bad = f"polls: sender {snd.poll()}, receiver {rcv.poll()}"
    for b in range(2):
        if not np.array_equal(dkv[b].read()[dst], pkv[b].read()[src]):
            bad = bad or f"kv buffer {b} differs"
    if not np.array_equal(daux[2], paux[1]):
        bad = bad or "the aux row differs"
    pm.close()
    dm.close()
    server.close()
    return dict(ok=bad is None, error=bad)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", choices=["torch", "fake"], required=True)
    ap.add_argument("case", choices=["vllm", "sglang"])
    a = ap.parse_args()
    try:
        r = globals()[f"case_{a.case}"](a.mem)
    except Exception as e:  # reported as a failed case
        r = dict(ok=False, error=f"{type(e).__name__}: {e}")
    r = dict(case=a.case, mem=a.mem, **r)
    print(json.dumps(r), flush=True)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
