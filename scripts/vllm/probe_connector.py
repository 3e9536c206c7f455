"""A vLLM KV connector that records every call vLLM makes on it, then does what
vLLM's ExampleConnector (shared-storage) does. Loaded with kv_connector_module_path,
it shows the exact call order, arguments, KV cache tensors and block ids on this machine.
Log: $PROBE_LOG_DIR/probe-<role>-<kv_role>-<pid>.jsonl"""

import json
import os
import time

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)


def _tensor(t):
    st = t.untyped_storage()
    return {
        "shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
        "device": str(t.device), "data_ptr": t.data_ptr(),
        "storage_ptr": st.data_ptr(), "storage_nbytes": st.nbytes(),
        "storage_offset": t.storage_offset(), "contiguous": t.is_contiguous(),
        "element_size": t.element_size(),
    }


class ProbeConnector(ExampleConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        kvr = self._kv_transfer_config.kv_role
        d = os.environ.get("PROBE_LOG_DIR", "/tmp")
        self._probe_f = open(
            os.path.join(d, f"probe-{role.name.lower()}-{kvr}-{os.getpid()}.jsonl"), "a")
        self._seen_save_layers = set()
        self._log("__init__", role=role.name, kv_role=kvr,
                  block_size=vllm_config.cache_config.block_size,
                  num_blocks=kv_cache_config.num_blocks,
                  kv_cache_tensors=[{"size": t.size, "layers": t.layers,
                                     "offset": getattr(t, "offset", None),
                                     "layer_stride": getattr(t, "layer_stride", None),
                                     "block_stride": getattr(t, "block_stride", None)}
                                    for t in kv_cache_config.kv_cache_tensors],
                  groups=[{"layers": g.layer_names, "spec": repr(g.kv_cache_spec)}
                          for g in kv_cache_config.kv_cache_groups],
                  layout=str(vllm_config.cache_config.get_resolved_kv_cache_layout()),
                  engine_id=self._kv_transfer_config.engine_id,
                  extra=self._kv_transfer_config.kv_connector_extra_config)

    def _log(self, ev, **kw):
        kw = {"t": time.time(), "ev": ev, **kw}
        self._probe_f.write(json.dumps(kw, default=repr) + "\n")
        self._probe_f.flush()

    # worker side
    def register_kv_caches(self, kv_caches):
        self._log("register_kv_caches",
                  layers={k: _tensor(v) for k, v in kv_caches.items()})
        return super().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        md = self._get_connector_metadata()
        if md.requests:
            self._log("start_load_kv", requests=[
                {"store": r.is_store, "n_tokens": len(r.token_ids),
                 "slots": r.slot_mapping[:3].tolist() + [-1] + r.slot_mapping[-2:].tolist()
                 if len(r.slot_mapping) else []} for r in md.requests])
        return super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name):
        return super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if layer_name not in self._seen_save_layers:
            self._seen_save_layers.add(layer_name)
            self._log("save_kv_layer(first)", layer=layer_name, kv_layer=_tensor(kv_layer),
                      attn_metadata=type(attn_metadata).__name__)
        return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        return super().wait_for_save()

    def get_finished(self, finished_req_ids):
        if finished_req_ids:
            self._log("get_finished", finished_req_ids=sorted(finished_req_ids))
        return super().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return super().get_block_ids_with_load_errors()

    def shutdown(self):
        self._log("shutdown")
        return super().shutdown()

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        r = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._log("get_num_new_matched_tokens", req=request.request_id,
                  n_prompt=len(request.prompt_token_ids or []),
                  num_computed_tokens=num_computed_tokens,
                  kv_transfer_params=request.kv_transfer_params, result=r)
        return r

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._log("update_state_after_alloc", req=request.request_id,
                  block_ids=blocks.get_block_ids(), num_external_tokens=num_external_tokens)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        new = [(r.req_id, r.block_ids) for r in scheduler_output.scheduled_new_reqs]
        if new or scheduler_output.finished_req_ids:
            self._log("build_connector_meta", new_reqs=new,
                      cached_req_ids=list(scheduler_output.scheduled_cached_reqs.req_ids),
                      finished_req_ids=sorted(scheduler_output.finished_req_ids))
        return super().build_connector_meta(scheduler_output)

    def on_new_request(self, request):
        self._log("on_new_request", req=request.request_id,
                  kv_transfer_params=request.kv_transfer_params)
        return super().on_new_request(request)

    def request_finished(self, request, block_ids):
        r = super().request_finished(request, block_ids)
        self._log("request_finished", req=request.request_id, status=str(request.status),
                  block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
                  kv_transfer_params=request.kv_transfer_params, result=r)
        return r

    def update_connector_output(self, connector_output):
        if not connector_output.is_empty():
            self._log("update_connector_output", out=repr(connector_output))
        return super().update_connector_output(connector_output)


class FailingLoadConnector(ExampleConnector):
    """ExampleConnector whose every load is reported failed (all loaded blocks in
    get_block_ids_with_load_errors), to see what vLLM does with a failed load."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._failed: set[int] = set()

    def start_load_kv(self, forward_context, **kwargs):
        md = self._get_connector_metadata()
        for r in md.requests:
            if not r.is_store:
                self._failed.update((r.slot_mapping // self._block_size).tolist())
        return super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self):
        out, self._failed = self._failed, set()
        return out
