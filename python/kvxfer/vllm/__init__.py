"""A vLLM KV connector over libkvxfer: prefill/decode disaggregation for vLLM 0.32.

Select it on both servers with vLLM's ``--kv-transfer-config``::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {
                               "listen": "10.0.0.5:0",
                               "auth_key_file": "/etc/kvxfer/cluster.key"}}'

(``kv_consumer`` on the decode server, which must run with
``--no-enable-prefix-caching``), and put :mod:`kvxfer.vllm.proxy` (or any router doing
the same) in front of them: each request goes to the prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then to the decode with the
``kv_transfer_params`` of the prefill's answer.

Each request is one libkvxfer room. The prefill's scheduler picks a random 64-bit room
id when the request's prefill finished and returns it, with the prefill engines'
addresses, in ``kv_transfer_params``; its worker sends the request's blocks (one page
per vLLM block and layer, K and V together) and the blocks stay allocated until the
room ended and drained. The decode loads the whole prompt asynchronously into freshly
allocated blocks; a failed room is reported to vLLM as a failed load (the request
fails, or is computed again with ``kv_load_failure_policy: "recompute"``), never served
from its blocks. A request dropped on the decode aborts its room; the prefill then
frees its blocks.

``kv_connector_extra_config`` holds libkvxfer engine keys (``listen``, ``transport``,
``workers``, ``bootstrap_timeout_ms``, ... as in ``kvxfer_config_set``); ``role``
comes from ``kv_role``. An engine that listens beyond loopback needs ``auth_key_file``
(the same key on both servers) or ``auth`` set to ``off`` on both: without either it
refuses to start, naming the keys.

Importing this package starts nothing and imports neither vLLM nor torch:
``KvxferConnector`` is loaded from :mod:`kvxfer.vllm.connector` on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KvxferConnector", "KvxferConnectorMetadata", "KvxferHandshake",
                "KvxferStats"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
