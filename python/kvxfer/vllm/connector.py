"""``KvxferConnector``: vLLM's ``KVConnectorBase_V1`` over libkvxfer (vLLM 0.32).

This module imports vLLM and torch; the logic lives in :mod:`kvxfer.vllm.scheduler`
and :mod:`kvxfer.vllm.worker`, which do not. See :mod:`kvxfer.vllm` for how to select
it and what it supports.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.utils import create_metric_per_engine
from vllm.v1.request import RequestStatus

from .plan import StepPlan
from .scheduler import DecodeScheduler, PrefillScheduler
from .worker import (
    ROLES,
    ConnectorWorker,
    LayerBuffer,
    engine_config,
    logger,
    merge_stats,
    reduce_stats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_FINISHED_NORMALLY = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclasses.dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, every step."""

    plan: StepPlan


@dataclasses.dataclass
class KvxferHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once: where this rank's engine listens."""

    address: str


@dataclasses.dataclass
class KvxferStats(KVConnectorStats):
    """Rooms present in each rank's engine, requests the connector holds, and room
    outcomes and bytes since the last report (:func:`kvxfer.vllm.worker.merge_stats`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvxferStats":
        return KvxferStats(data=merge_stats(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return reduce_stats(self.data)

    def is_empty(self) -> bool:
        return not self.data


class KvxferPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvxfer_rooms`` (rooms present in the engines: created, not yet cleared),
    ``vllm:kvxfer_pending_requests`` (requests whose blocks wait for a room to end),
    and the counters ``vllm:kvxfer_rooms_{succeeded,failed,aborted}_total`` and
    ``vllm:kvxfer_bytes_{sent,received}_total``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls, name, doc):
            return create_metric_per_engine(
                cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)

        self.rooms = per_engine(self._gauge_cls, "vllm:kvxfer_rooms",
                                "libkvxfer rooms present (created and not cleared), all TP ranks.")
        self.pending = per_engine(self._gauge_cls, "vllm:kvxfer_pending_requests",
                                  "Requests whose KV blocks wait for their kvxfer room to end.")
        self.counters = {
            k: per_engine(self._counter_cls, f"vllm:kvxfer_{k}", doc)
            for k, doc in (
                ("rooms_succeeded", "kvxfer rooms that ended in SUCCESS."),
                ("rooms_failed", "kvxfer rooms that FAILED (not by this side's abort)."),
                ("rooms_aborted", "kvxfer rooms this side aborted (the request was dropped)."),
                ("bytes_sent", "KV bytes sent by libkvxfer."),
                ("bytes_received", "KV bytes received by libkvxfer."),
            )
        }
        self._ranks: dict[int, dict[str, int]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        if "ranks" in data:
            ranks = self._ranks.setdefault(engine_idx, {})
            ranks.update({r: v["rooms"] for r, v in data["ranks"].items()})
            self.rooms[engine_idx].set(sum(ranks.values()))
        if "pending_requests" in data:
            self.pending[engine_idx].set(data["pending_requests"])
        for k, v in data.get("delta", {}).items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)


@dataclasses.dataclass(frozen=True)
class KvCacheAccess:
    """What :meth:`KvxferConnector.kv_cache_access` declares."""

    reads: bool
    """The producer's threads read the blocks of finished prefills."""
    writes: bool
    """The consumer's threads write the blocks a decode request was given."""
    memory: tuple[str, ...]
    """The device types of KV caches it accepts."""
    in_forward: bool
    """Whether it touches the cache inside the forward pass (on the model's stream)."""


KV_CACHE_ACCESS = KvCacheAccess(reads=True, writes=True, memory=("cpu", "cuda"),
                                in_forward=False)


def _check_supported(vllm_config: "VllmConfig", side: str) -> None:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise NotImplementedError("KvxferConnector: pipeline parallelism is not supported yet")
    if pc.decode_context_parallel_size > 1 or pc.prefill_context_parallel_size > 1:
        raise NotImplementedError("KvxferConnector: context parallelism is not supported yet")
    if side == "decode" and vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(
            "KvxferConnector: prefix caching on a decode server (kv_consumer) is not "
            "supported yet: start it with --no-enable-prefix-caching")


class KvxferConnector(KVConnectorBase_V1):
    """Prefill/decode disaggregation over libkvxfer: ``kv_role`` ``kv_producer`` on the
    prefill server, ``kv_consumer`` on the decode server; ``kv_connector_extra_config``
    holds libkvxfer engine keys (``listen``, ``transport``, timeouts, ...)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: Optional["KVCacheConfig"] = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        kv_role = self._kv_transfer_config.kv_role
        if kv_role not in ROLES:
            raise ValueError(f"KvxferConnector: kv_role {kv_role!r} is not supported: use "
                             "kv_producer (prefill) or kv_consumer (decode)")
        self.side = ROLES[kv_role]
        _check_supported(vllm_config, self.side)
        keys = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler: PrefillScheduler | DecodeScheduler | None = None
        self.worker: ConnectorWorker | None = None
        self._last_pending: Optional[int] = None
        if role == KVConnectorRole.SCHEDULER:
            engine_config(self.side, keys).close()  # a bad key fails here, at start-up
            tp = vllm_config.parallel_config.tensor_parallel_size
            self.scheduler = PrefillScheduler() if self.side == "prefill" else DecodeScheduler(tp)
        else:
            from vllm.distributed.parallel_state import get_tp_group

            groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config else 1
            self.worker = ConnectorWorker(self.side, keys, get_tp_group().rank_in_group,
                                          single_group=groups == 1)

    # ==============================
    # Worker side
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        num_blocks = self._kv_cache_config.num_blocks
        buffers = []
        for name, t in kv_caches.items():
            if t.device.type not in ("cpu", "cuda"):
                raise NotImplementedError(
                    f"KvxferConnector: layer {name}'s KV cache is in {t.device} memory; CPU "
                    "and CUDA memory are supported")
            device = None
            if t.device.type == "cuda":
                device = t.device.index if t.device.index is not None else torch.cuda.current_device()
            if not t.is_contiguous():
                raise NotImplementedError(f"KvxferConnector: layer {name}'s KV cache is not "
                                          f"contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
            nbytes = t.numel() * t.element_size()
            if t.shape[0] % num_blocks or nbytes % num_blocks:
                raise NotImplementedError(
                    f"KvxferConnector: layer {name}'s KV cache {tuple(t.shape)} is not laid out "
                    f"block-major over {num_blocks} blocks (K and V outermost is not supported yet)")
            buffers.append(LayerBuffer(name, extract_layer_index(name), t.data_ptr(), nbytes,
                                       nbytes // num_blocks, device))
        self.worker.register(buffers)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        assert self.worker is not None
        return KvxferHandshake(self.worker.address) if self.worker.engine else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata), type(meta)
        self.worker.apply(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-request loads are asynchronous (layer-wise is not supported yet)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # blocks are sent once the request's prefill finished

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        r = self.worker.results()
        return KVConnectorTransferResults(finished_sending=r.finished_sending,
                                          finished_recving=r.finished_recving,
                                          failed_recving=r.failed_recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # ==============================
    # Scheduler side
    # ==============================

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.scheduler is not None
        by_rank = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, KvxferHandshake):
                raise ValueError(f"KvxferConnector: handshake metadata {type(meta).__name__} "
                                 f"from TP rank {rank}")
            by_rank[int(rank)] = meta.address
        if isinstance(self.scheduler, PrefillScheduler):
            self.scheduler.set_addresses(by_rank)
        logger.info("kvxfer: %s engines at %s", self.side,
                    ", ".join(by_rank[r] for r in sorted(by_rank)))

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not isinstance(self.scheduler, DecodeScheduler):
            return 0, False
        return self.scheduler.num_new_matched_tokens(
            request.kv_transfer_params, request.num_prompt_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if not isinstance(self.scheduler, DecodeScheduler):
            return
        unhashed = blocks.get_unhashed_block_ids_all_groups()
        self.scheduler.after_alloc(request.request_id, request.kv_transfer_params,
                                   request.num_prompt_tokens, unhashed[0] if unhashed else [],
                                   num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return KvxferConnectorMetadata(self.scheduler.build_plan())

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if isinstance(self.scheduler, PrefillScheduler):
            self.scheduler.finished_sending(connector_output.finished_sending)
        elif isinstance(self.scheduler, DecodeScheduler):
            self.scheduler.finished_recving(connector_output.finished_recving)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if isinstance(self.scheduler, PrefillScheduler):
            return self.scheduler.request_finished(
                request.request_id, request.kv_transfer_params, block_ids,
                request.status in _FINISHED_NORMALLY, request.num_computed_tokens)
        assert isinstance(self.scheduler, DecodeScheduler)
        return self.scheduler.request_finished(request.request_id, request.kv_transfer_params)

    # ==============================
    # Both sides: stats
    # ==============================

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self.worker is not None:
            data = self.worker.stats()
            return KvxferStats(data=data) if data else None
        assert self.scheduler is not None
        pending = self.scheduler.pending_requests
        if pending == self._last_pending:
            return None
        self._last_pending = pending
        return KvxferStats(data={"pending_requests": pending})

    # ==============================
    # What the connector asks of vLLM
    # ==============================

    @classmethod
    def kv_cache_access(cls) -> KvCacheAccess:
        """How the connector touches the KV cache: its own threads read (producer) and
        write (consumer) the registered blocks directly, outside the forward pass, in CPU
        or CUDA memory (GPU blocks through pinned host staging); never the model's
        stream."""
        return KV_CACHE_ACCESS

    @classmethod
    def supports_sleep_mode(cls) -> bool:
        """False: sleep mode frees and re-allocates the KV cache, and libkvxfer holds
        the registered addresses until the engine is freed (re-registration is not
        supported), so a sleeping server would leave transfers pointing at freed GPU
        memory."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> KVConnectorStats:
        return KvxferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
