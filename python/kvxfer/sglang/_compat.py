"""SGLang's transfer-backend base classes: SGLang's own when it can be imported, and
otherwise stand-ins with the same names, constructor arguments and methods as in
SGLang 0.5.23 (``python/sglang/srt/disaggregation/base/conn.py``).

Importing SGLang's module needs torch and SGLang's server dependencies; where they are
missing, the stand-ins let this backend be built and tested on its own. The tests read
the installed SGLang's source with ``ast`` and compare every method signature.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from typing import Any, List, Optional

SGLANG_VERSION_TARGETED = "0.5.23"

try:  # pragma: no cover - exercised only where SGLang (and torch) import
    from sglang.srt.disaggregation.base.conn import (  # type: ignore[import-not-found]
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVArgs,
        KVPoll,
        KVTransferDestination,
        KVTransferMetric,
    )

    SGLANG_BASES = True
    """Whether the classes here are SGLang's own (else the stand-ins below)."""
except Exception:  # ImportError, or SGLang installed without torch and friends
    SGLANG_BASES = False

    @dataclasses.dataclass
    class KVTransferMetric:  # type: ignore[no-redef]
        """Per-sender transfer figures (SGLang's ``KVTransferMetric``)."""

        transfer_latency_s: Optional[float] = None
        alloc_latency_s: Optional[float] = None
        transfer_total_bytes: Optional[int] = None

    class KVTransferDestination(str, enum.Enum):  # type: ignore[no-redef]
        """Where decode receives KV (SGLang's ``KVTransferDestination``)."""

        DEVICE = "device"
        HOST = "host"

    class KVArgs:  # type: ignore[no-redef]
        """The buffers and topology a scheduler hands its transfer manager (SGLang's
        ``KVArgs``: a plain attribute holder the scheduler fills in)."""

        engine_rank: int
        kv_data_ptrs: List[int]
        kv_data_lens: List[int]
        kv_item_lens: List[int]
        kv_layer_ids: List[int]
        kv_cache_dtype_str: str
        kv_layout: Optional[str] = None
        aux_data_ptrs: List[int]
        aux_data_lens: List[int]
        aux_item_lens: List[int]
        state_types: List[Any]
        state_data_ptrs: List[List[int]]
        state_data_lens: List[List[int]]
        state_item_lens: List[List[int]]
        state_layer_ids: List[List[int]]
        is_hybrid_mla_backend: bool
        ib_device: str
        gpu_id: int
        kv_head_num: int
        total_kv_head_num: int
        page_size: int
        system_dp_rank: int
        pp_rank: int
        prefill_start_layer: int
        prefill_end_layer: Optional[int]
        num_draft_entries: int = 0

    class KVPoll:  # type: ignore[no-redef]
        """Transfer states, with the values libkvxfer's ``RoomState`` also has."""

        Failed = 0
        Bootstrapping = 1
        WaitingForInput = 2
        Transferring = 3
        Success = 4

    class BaseKVManager(ABC):  # type: ignore[no-redef]
        """Base class for managing transfer states"""

        enable_deferred_decode_kv_release: bool = False
        supports_host_destination: bool = False
        supports_role_switch: bool = False
        supports_deferred_decode_kv_release: bool = False

        def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
            return True

        @abstractmethod
        def __init__(
            self,
            args: KVArgs,
            disaggregation_mode: Any,
            server_args: Any,
            is_mla_backend: Optional[bool] = False,
        ): ...

        @abstractmethod
        def register_to_bootstrap(self):
            """Register prefill server info to the bootstrap server."""
            ...

        def teardown(self) -> None:
            raise NotImplementedError(
                f"{type(self).__name__} does not support PD role switch teardown"
            )

    class BaseKVSender(ABC):  # type: ignore[no-redef]
        @abstractmethod
        def __init__(
            self,
            mgr: BaseKVManager,
            bootstrap_addr: str,
            bootstrap_room: int,
            req_has_disagg_prefill_dp_rank: bool = False,
        ): ...

        @abstractmethod
        def init(self, num_kv_indices: int, aux_index: Optional[int] = None): ...

        @abstractmethod
        def send(
            self,
            kv_indices: Any,
            state_indices: Optional[List] = None,
            num_kv_tokens: Optional[int] = None,
        ): ...

        def mark_prefill_complete(self) -> None:
            raise NotImplementedError

        def pop_decode_prefix_len(self) -> int:
            return 0

        def get_max_transfer_tokens(self) -> Optional[int]:
            return None

        def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
            return num_pages > 0

        @abstractmethod
        def get_transfer_metric(self) -> KVTransferMetric: ...

        @abstractmethod
        def poll(self) -> int: ...

        @abstractmethod
        def failure_exception(self): ...

        def clear(self):
            pass

        def abort(self):
            pass

    class BaseKVReceiver(ABC):  # type: ignore[no-redef]
        @property
        def supports_host_destination(self) -> bool:
            return False

        def is_abort_release_safe(self) -> bool:
            raise NotImplementedError

        @abstractmethod
        def __init__(
            self,
            mgr: BaseKVManager,
            bootstrap_addr: str,
            bootstrap_room: Optional[int] = None,
        ): ...

        @abstractmethod
        def init(
            self,
            prefill_dp_rank: int,
        ): ...

        @abstractmethod
        def send_metadata(
            self,
            kv_indices: Any,
            aux_index: Optional[int] = None,
            state_indices: Optional[List] = None,
            decode_prefix_len: Optional[int] = None,
            destination: KVTransferDestination = KVTransferDestination.DEVICE,
        ): ...

        @abstractmethod
        def poll(self) -> int: ...

        @abstractmethod
        def failure_exception(self): ...

        def clear(self):
            pass

        def abort(self):
            pass

    class BaseKVBootstrapServer(ABC):  # type: ignore[no-redef]
        @abstractmethod
        def __init__(self, host: str, port: int): ...


class KVTransferError(Exception):
    """A transfer failed; raised by ``failure_exception()``. The same attributes as
    SGLang's ``KVTransferError``: ``bootstrap_room``, ``failure_reason`` (libkvxfer's
    recorded reason) and ``is_from_another_rank``."""

    def __init__(self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank

    def __str__(self) -> str:
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"

    def __reduce__(self):
        return (type(self), (self.bootstrap_room, self.failure_reason, self.is_from_another_rank))


__all__ = [
    "SGLANG_BASES",
    "SGLANG_VERSION_TARGETED",
    "BaseKVBootstrapServer",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "KVArgs",
    "KVPoll",
    "KVTransferDestination",
    "KVTransferError",
    "KVTransferMetric",
]
