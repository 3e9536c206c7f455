"""The SGLang transfer backend: manager, sender and receiver over libkvxfer.

Each SGLang request is one libkvxfer room, with the request's ``bootstrap_room`` as its
id. The scheduler's calls map onto the room's calls:

==========================  =====================================================
prefill (sender)            libkvxfer
==========================  =====================================================
``KvxferKVSender(...)``     ``room_create(room, decode_engines=1)``
``init(n_pages, aux)``      kept: the number of pages decides which chunk is last
``send(pages)``             ``enqueue_chunk(room, pages, is_last, aux)``
``poll()``                  ``room_poll``; a terminal state only once
                            ``room_drained`` (the pages may then be freed)
``abort()``                 ``room_abort(room, "Aborted by AbortReq.")``
``failure_exception()``     raises :class:`KVTransferError` with ``room_failure``
                            (a live or undrained room: ``room_abort``, then waits
                            for ``room_drained``, then ``room_clear``)
``clear()``                 ``room_clear`` (a live or undrained room: the same
                            abort and wait first)
==========================  =====================================================

and on decode ``init(prefill_dp_rank)`` finds the prefill engines' addresses through
the bootstrap server and creates the room, ``send_metadata(pages, aux)`` is
``room_set_destination``. The manager registers the scheduler's KV and aux buffers
once (``kv_data_ptrs``: integer addresses, as SGLang holds them) and, on prefill,
registers the engine's address with the bootstrap server.

A terminal room is released from the engine as soon as the scheduler has seen its
state (its outcome and reason are kept on the sender or receiver), so rooms never pile
up in the engine whatever paths the scheduler takes; a sender or receiver dropped
while its room is live has the room aborted and released by the manager's reaper.

The pages are never given back while a transfer can touch them. SGLang frees a
request's pages as soon as ``failure_exception()`` returns, and with tensor
parallelism it calls it on every rank once the MIN of the ranks' polls is Failed,
also on ranks whose own room is still transferring. So ``failure_exception()`` and
``clear()`` of a room that is live, or ended but not drained, abort it and return only
once ``room_drained`` is true: over TCP within about one receive tick of the engine
(10 ms), over RDMA after the prefill engine's AbortAck or, at the latest,
``drain_timeout_ms`` (then the engine cuts that peer off). If the wait outlasts that
bound (``drain_timeout_ms`` plus :data:`DRAIN_MARGIN_S`) an error naming the room and
its reason is logged and the wait goes on: the pages are never reported safe early.
The same holds on prefill for the source pages (no worker still reads them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Any, Dict, List, Optional

import kvxfer
from kvxfer import Engine, KvxferError, NotFoundError, RoomState, WrongStateError

from ._compat import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferError,
    KVTransferMetric,
)
from .bootstrap import format_address, http_json, split_address

logger = logging.getLogger("kvxfer.sglang")

ABORT_REASON = "Aborted by AbortReq."
"""The reason recorded when the scheduler aborts a request (SGLang's own wording)."""

CONFIG_ENV = "KVXFER_CONFIG"
"""Extra engine configuration, ``key=value`` pairs separated by commas (for example
``transport=tcp,workers=8``), applied after the backend's own keys."""

LISTEN_HOST_ENV = "KVXFER_LISTEN_HOST"
KV_MEMORY_ENV = "KVXFER_KV_MEMORY"
"""Where SGLang's ``kv_data_ptrs`` point: ``cuda`` (GPU memory of the scheduler's
device), ``host``, or ``auto`` (the default: ``cuda`` when the scheduler process has
PyTorch loaded with CUDA available, as an SGLang GPU server does, else ``host``)."""
"""The host the engine listens on (default: the server's ``--host``, or every address
when that is a wildcard). An address that is not loopback needs a cluster key
(``KVXFER_CONFIG=auth_key_file=PATH``, the same key on every server) or, to run
without authentication, ``KVXFER_CONFIG=auth=off`` on every server."""

DRAIN_TIMEOUT_MS_DEFAULT = 5000
"""The engine's ``drain_timeout_ms`` when ``KVXFER_CONFIG`` does not set it."""

DRAIN_MARGIN_S = 2.0
"""How much longer than ``drain_timeout_ms`` an ended room may take to drain before
the wait for it logs an error (the engine's watchdog, which cuts a peer that holds a
room past ``drain_timeout_ms``, scans every 100 ms at most)."""

_TERMINAL = (RoomState.SUCCESS, RoomState.FAILED)


def _mode_name(mode: Any) -> str:
    value = getattr(mode, "value", mode)
    name = str(value).lower()
    if name not in ("prefill", "decode"):
        raise ValueError(f"kvxfer: disaggregation mode must be prefill or decode, not {mode!r}")
    return name


def _pages(indices: Any) -> Any:
    """SGLang's page indices (numpy int32/int64, a list, a CPU tensor) as a uint32
    buffer, without a copy when they are already 4-byte and non-negative."""
    if hasattr(indices, "numpy") and not hasattr(indices, "__array_interface__"):
        indices = indices.numpy()  # a CPU torch tensor
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - SGLang always has numpy
        return list(indices)
    arr = np.ascontiguousarray(indices)
    if arr.size and arr.min() < 0:
        raise ValueError(f"negative page index {int(arr.min())}")
    if arr.dtype in (np.uint32, np.int32):
        return arr.view(np.uint32)
    if arr.size and arr.max() > 0xFFFFFFFF:
        raise ValueError(f"page index {int(arr.max())} does not fit 32 bits")
    return arr.astype(np.uint32)


def _kv_device(args: Any) -> Optional[int]:
    """The CUDA device of SGLang's KV pool (its ``kv_data_ptrs`` are device pointers
    there), or None for host memory; see :data:`KV_MEMORY_ENV`. The aux buffers
    (request metadata) are host memory either way. Never imports torch itself."""
    mode = os.environ.get(KV_MEMORY_ENV, "auto").strip().lower()
    if mode not in ("auto", "cuda", "host"):
        raise ValueError(f"kvxfer backend: {KV_MEMORY_ENV}={mode!r}: use auto, cuda or host")
    if mode == "host":
        return None
    import sys

    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available()
    if mode == "auto" and not cuda:
        return None
    if cuda:
        # The scheduler set its device before building the pool (SGLang's gpu_id is
        # the torch device index of this rank).
        return int(torch.cuda.current_device())
    gpu = getattr(args, "gpu_id", None)
    if gpu is None:
        raise ValueError(f"kvxfer backend: {KV_MEMORY_ENV}=cuda, but KVArgs has no gpu_id "
                         "and torch.cuda is not available in this process")
    return int(gpu)


@dataclasses.dataclass
class PrefillServerInfo:
    """A prefill server's topology, as its bootstrap server reports it (the fields
    SGLang's decode scheduler reads: ``dp_size``, ``follow_bootstrap_room``)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool = True
    kv_layout: Optional[str] = None
    decode_allocation_policy: str = "early"
    transfer_backend: str = "kvxfer"
    unsupported: Optional[str] = None
    """Why this decode server cannot pull from that prefill server, if it cannot."""


class KvxferKVManager(BaseKVManager):
    """One libkvxfer engine per scheduler rank, with the rank's KV and aux buffers
    registered.

    Constructed by SGLang's scheduler as ``(kv_args, disaggregation_mode,
    server_args, is_mla_backend)``. From ``server_args`` it reads ``host``,
    ``disaggregation_bootstrap_port``, ``dist_init_addr``, ``tp_size``, ``dp_size``,
    ``pp_size``, ``enable_dp_attention`` and ``disaggregation_ib_device`` (each
    optional). The engine's own keys can be added with ``KVXFER_CONFIG``.
    """

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
    ):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.mode = _mode_name(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self._check_supported(args, server_args)

        sa = server_args
        self.tp_size = int(getattr(sa, "tp_size", 1) or 1)
        self.dp_size = int(getattr(sa, "dp_size", 1) or 1)
        self.enable_dp_attention = bool(getattr(sa, "enable_dp_attention", False))
        self.attn_tp_size = self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size
        self.attn_dp_size = self.dp_size if self.enable_dp_attention else 1
        self.system_dp_size = 1 if self.enable_dp_attention else self.dp_size
        engine_rank = int(args.engine_rank)
        self.attn_tp_rank = engine_rank % self.attn_tp_size
        self.attn_dp_rank = engine_rank // self.attn_tp_size if self.enable_dp_attention else 0
        self.system_dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.pp_size = int(getattr(sa, "pp_size", 1) or 1)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.page_size = int(args.page_size)
        self.kv_cache_dtype_str = getattr(args, "kv_cache_dtype_str", None)
        self.kv_item_lens_sum = sum(int(x) for x in args.kv_item_lens)
        self.bootstrap_host = str(getattr(sa, "host", "127.0.0.1") or "127.0.0.1")
        self.bootstrap_port = getattr(sa, "disaggregation_bootstrap_port", 8998)
        self.dist_init_addr = getattr(sa, "dist_init_addr", None)

        cfg = kvxfer.Config(role=self.mode, listen=format_address(self._listen_host(), 0))
        ib_device = getattr(sa, "disaggregation_ib_device", None) or getattr(args, "ib_device", None)
        if ib_device:
            cfg.set("rdma_devices", ib_device)
        drain_ms = DRAIN_TIMEOUT_MS_DEFAULT
        for item in filter(None, os.environ.get(CONFIG_ENV, "").split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{CONFIG_ENV}: {item!r} is not key=value")
            cfg.set(key.strip(), value.strip())  # the library checks the value
            if key.strip() == "drain_timeout_ms":
                drain_ms = int(value.strip())
        self.drain_bound_s = drain_ms / 1000 + DRAIN_MARGIN_S
        """How long an ended room may take to drain before the wait logs an error."""
        with cfg:
            self.engine = self._start(cfg)
        try:
            self._register_buffers(args)
        except BaseException:
            self.engine.close()
            raise
        self.address = self.engine.address

        # Decode side: prefill topologies and engine addresses by bootstrap address.
        self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
        self.connection_pool: Dict[tuple[str, int], List[str]] = {}
        self._table_lock = threading.Lock()

        # Room ownership, so a dropped sender or receiver's room can be released.
        self._owners: Dict[int, object] = {}
        self._owners_lock = threading.Lock()
        self._abandoned: List[tuple[int, object, float]] = []
        self._reap_cond = threading.Condition()
        self._closed = False
        self._reaper = threading.Thread(target=self._reap_loop, name="kvxfer-reaper", daemon=True)
        self._reaper.start()

        if self.mode == "prefill":
            self.register_to_bootstrap()

    # -- setup -------------------------------------------------------------------------

    @staticmethod
    def _check_supported(args: KVArgs, server_args: Any) -> None:
        state = [p for group in (getattr(args, "state_data_ptrs", None) or []) for p in group]
        if state:
            raise NotImplementedError(
                "kvxfer backend: state buffers (hybrid models: Mamba, SWA, DSA and other "
                "per-request state) are not supported yet"
            )
        if int(getattr(server_args, "attn_cp_size", 1) or 1) > 1:
            raise NotImplementedError("kvxfer backend: context parallelism is not supported yet")

    def _start(self, cfg: kvxfer.Config) -> Engine:
        """Starts the engine; a refusal to listen beyond this host without a key names
        what to set here."""
        try:
            return Engine(cfg)
        except kvxfer.BadValueError as e:
            if "'listen'" not in e.message or "'auth'" not in e.message:
                raise
            raise kvxfer.BadValueError(
                e.status,
                f"{e.message}. kvxfer backend: the engine listens on {self._listen_host()!r} "
                f"(the server's --host, or {LISTEN_HOST_ENV}); set "
                f"{CONFIG_ENV}=auth_key_file=PATH with the same key on every server, or "
                f"{CONFIG_ENV}=auth=off on every server to run without authentication",
                e.function,
            ) from e

    def _listen_host(self) -> str:
        host = os.environ.get(LISTEN_HOST_ENV)
        if host:
            return host
        if self.bootstrap_host in ("0.0.0.0", "::", ""):
            return self.bootstrap_host or "0.0.0.0"
        return self.bootstrap_host

    def _register_buffers(self, args: KVArgs) -> None:
        ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
        if not (len(ptrs) == len(lens) == len(items)):
            raise ValueError("kvxfer backend: kv_data_ptrs, kv_data_lens and kv_item_lens differ in length")
        device = _kv_device(args)
        bufs = [
            kvxfer.Buffer(int(p), int(n), int(i)) if device is None
            else kvxfer.Buffer(int(p), int(n), int(i), None, kvxfer.MemoryKind.CUDA, device)
            for p, n, i in zip(ptrs, lens, items)
        ]
        layer_ids = list(getattr(args, "kv_layer_ids", None) or [])
        if layer_ids and len(layer_ids) == len(bufs):
            # Pipeline stages register only their layers; buffers pair by layer id.
            self.engine.register_kv_layers(bufs, [int(x) for x in layer_ids])
        else:
            self.engine.register_kv(bufs)
        aux = [
            (int(p), int(n), int(i))
            for p, n, i in zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        ]
        if aux:
            self.engine.register_aux(aux)

    def _bootstrap_url(self) -> str:
        if self.dist_init_addr:
            host = split_address(str(self.dist_init_addr))[0]
        else:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host, self.bootstrap_host)
        return f"http://{format_address(host, int(self.bootstrap_port))}"

    def register_to_bootstrap(self) -> None:
        """Registers this prefill rank (its topology and engine address) with the
        bootstrap server, retrying for a few seconds while the server starts."""
        host, port = split_address(self.address)
        payload = {
            "attn_tp_size": self.attn_tp_size,
            "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": 1,
            "attn_cp_rank": 0,
            "attn_dp_size": self.attn_dp_size,
            "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size,
            "system_dp_rank": self.system_dp_rank,
            "rank_ip": host,
            "rank_port": port,
            "kvxfer_address": self.address,
            "page_size": self.page_size,
            "kv_cache_dtype": self.kv_cache_dtype_str,
            "kv_layout": getattr(self.kv_args, "kv_layout", None),
            "load_balance_method": getattr(self.server_args, "load_balance_method", "follow_bootstrap_room"),
            "transfer_backend": "kvxfer",
        }
        url = self._bootstrap_url() + "/route"
        delay, last = 0.2, None
        for _ in range(8):
            status, body = http_json("PUT", url, payload)
            if status == 200:
                return
            last = f"{status} {body}"
            if 400 <= status < 500:
                break
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise RuntimeError(f"kvxfer backend: registering with the bootstrap server {url} failed: {last}")

    # -- decode: finding the prefill engines ------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One attempt to fetch and cache the prefill server's topology; True when it
        is known (cached or fetched). A topology this backend cannot serve (another
        page size or TP size) is cached with the reason, which its requests fail with."""
        with self._table_lock:
            if bootstrap_addr in self.prefill_info_table:
                return True
        status, body = http_json(
            "GET",
            f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
            "&target_tp_rank=-1&target_pp_rank=-1",
        )
        if status != 200 or not isinstance(body, dict):
            logger.warning("kvxfer: prefill info from %s not available: %s %s", bootstrap_addr, status, body)
            return False
        fields = {f.name for f in dataclasses.fields(PrefillServerInfo)}
        try:
            info = PrefillServerInfo(**{k: v for k, v in body.items() if k in fields})
        except TypeError as e:
            logger.warning("kvxfer: bad prefill info from %s: %s", bootstrap_addr, e)
            return False
        if info.transfer_backend != "kvxfer":
            info.unsupported = (
                f"the prefill server at {bootstrap_addr} uses transfer backend {info.transfer_backend!r}"
            )
        elif info.page_size is not None and int(info.page_size) != self.page_size:
            info.unsupported = (
                f"page size mismatch: prefill {info.page_size}, decode {self.page_size}"
            )
        elif int(info.attn_tp_size) != self.attn_tp_size:
            info.unsupported = (
                f"different attention TP sizes (prefill {info.attn_tp_size}, decode "
                f"{self.attn_tp_size}) are not supported yet"
            )
        elif int(info.attn_cp_size) != 1:
            info.unsupported = "prefill context parallelism is not supported yet"
        elif info.decode_allocation_policy != "early":
            info.unsupported = f"decode allocation policy {info.decode_allocation_policy!r} is not supported"
        with self._table_lock:
            self.prefill_info_table.setdefault(bootstrap_addr, info)
        return True

    def prefill_addresses(self, bootstrap_addr: str, prefill_dp_rank: int) -> List[str]:
        """The engine addresses of the prefill ranks a decode rank pulls from: the same
        TP rank, every pipeline stage. Raises ``RuntimeError`` with the reason when
        they cannot be found."""
        key = (bootstrap_addr, int(prefill_dp_rank))
        with self._table_lock:
            cached = self.connection_pool.get(key)
            info = self.prefill_info_table.get(bootstrap_addr)
        if cached is not None:
            return cached
        if info is None:
            raise RuntimeError(f"no prefill server info from bootstrap server {bootstrap_addr}")
        if info.unsupported:
            raise RuntimeError(info.unsupported)
        addresses = []
        for pp in range(int(info.pp_size)):
            status, body = http_json(
                "GET",
                f"http://{bootstrap_addr}/route?prefill_dp_rank={prefill_dp_rank}"
                f"&prefill_cp_rank=0&target_tp_rank={self.attn_tp_rank}&target_pp_rank={pp}",
            )
            if status != 200 or not isinstance(body, dict):
                raise RuntimeError(
                    f"could not fetch bootstrap info for prefill_dp_rank {prefill_dp_rank}, "
                    f"tp_rank {self.attn_tp_rank}, pp_rank {pp} from {bootstrap_addr}: {status} {body}"
                )
            addresses.append(body.get("kvxfer_address") or format_address(body["rank_ip"], int(body["rank_port"])))
        with self._table_lock:
            self.connection_pool[key] = addresses
        return addresses

    def forget_prefill_addresses(self, bootstrap_addr: str, prefill_dp_rank: int) -> None:
        """Drops the cached engine addresses of ``(bootstrap_addr, prefill_dp_rank)`` (and
        the server's topology), so the next request fetches them again."""
        with self._table_lock:
            self.connection_pool.pop((bootstrap_addr, int(prefill_dp_rank)), None)
            self.prefill_info_table.pop(bootstrap_addr, None)

    # -- room ownership ----------------------------------------------------------------

    def _own(self, room: int, token: object) -> None:
        with self._owners_lock:
            self._owners[room] = token

    def _release(self, room: int, token: object) -> None:
        """Clears ``room`` from the engine if ``token`` still owns it."""
        with self._owners_lock:
            if self._owners.get(room) is not token:
                return
        try:
            self.engine.room_clear(room)
        except (NotFoundError, ValueError):  # already cleared, or the engine is closed
            pass
        with self._owners_lock:
            if self._owners.get(room) is token:
                del self._owners[room]

    def _abandon(self, room: int, token: object) -> None:
        """A sender or receiver was dropped: abort its room if live and clear it once
        drained (in the reaper thread, so the scheduler never waits for it)."""
        with self._owners_lock:
            if self._owners.get(room) is not token:
                return
        with self._reap_cond:
            self._abandoned.append((room, token, time.monotonic()))
            self._reap_cond.notify()

    def _reap_loop(self) -> None:
        while True:
            with self._reap_cond:
                while not self._abandoned and not self._closed:
                    self._reap_cond.wait()
                if self._closed:
                    return
                work, self._abandoned = self._abandoned, []
            keep = []
            for room, token, since in work:
                try:
                    if self._reap_one(room, token, since):
                        continue
                except ValueError:  # the engine closed under us
                    return
                except Exception:
                    logger.exception("kvxfer: releasing room %d failed", room)
                    continue
                keep.append((room, token, since))
            if keep:
                with self._reap_cond:
                    self._abandoned.extend(keep)
                    self._reap_cond.wait(0.02)

    def _reap_one(self, room: int, token: object, since: float) -> bool:
        with self._owners_lock:
            if self._owners.get(room) is not token:
                return True
        try:
            state = self.engine.room_poll(room)
            if state not in _TERMINAL:
                self.engine.room_abort(room, "request dropped by the scheduler while live")
                return False
            if not self.engine.room_drained(room):
                if time.monotonic() - since < 60:
                    return False
                # The scheduler dropped the request (and its pages) long ago; clearing
                # only releases the engine's record, which keeps draining the room.
                logger.warning("kvxfer: dropped room %d has not drained after 60 s; "
                               "released, still draining in the engine", room)
        except NotFoundError:
            pass
        self._release(room, token)
        return True

    def close(self) -> None:
        """Stops the reaper and the engine (live rooms fail with "engine shut down")."""
        with self._reap_cond:
            self._closed = True
            self._reap_cond.notify_all()
        self._reaper.join(timeout=5)
        self.engine.close()

    def teardown(self) -> None:
        """Releases the transfer resources (SGLang's PD role switch); the same as
        :meth:`close`."""
        self.close()


class _RoomEnd:
    """What a sender and a receiver share: one room of the manager's engine, polled
    into SGLang's ``KVPoll`` values, released once the scheduler saw it end."""

    kv_mgr: KvxferKVManager
    bootstrap_room: int

    def _setup(self, mgr: KvxferKVManager, room: Optional[int]) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(room) if room is not None else 0
        self.conclude_state: Optional[int] = None
        self.failure_reason: Optional[str] = None
        self.failure_cause: Optional[Any] = None
        self.failure_from_peer = False
        self._token = object()
        self._created = False
        self._drained = False  # the engine reported the room drained (or it is gone)
        self._last = KVPoll.Bootstrapping
        self._start: Optional[float] = None
        self._finish: Optional[float] = None
        weakref.finalize(self, mgr._abandon, self.bootstrap_room, self._token).atexit = False

    def _create(self, peers: Optional[List[str]]) -> None:
        engine = self.kv_mgr.engine
        try:
            if peers is None:
                engine.room_create(self.bootstrap_room, decode_engines=1)
            else:
                engine.room_create(self.bootstrap_room, peers)
        except KvxferError as e:
            self._conclude_failed(f"kvxfer: {e.message}")
            return
        self.kv_mgr._own(self.bootstrap_room, self._token)
        self._created = True

    def _conclude_failed(self, reason: str) -> None:
        """Fails the request without (or after) its room: the reason is kept here."""
        if self.conclude_state is None:
            self.conclude_state = KVPoll.Failed
            self.failure_reason = reason
            self._finish = time.perf_counter()
        if self._created:
            self.kv_mgr._release(self.bootstrap_room, self._token)

    def _abort(self, reason: str) -> None:
        if self.conclude_state is not None:
            return
        if not self._created:
            self._conclude_failed(reason)
            return
        try:
            self.kv_mgr.engine.room_abort(self.bootstrap_room, reason)
        except NotFoundError:
            self._conclude_failed(reason)

    def poll(self) -> int:
        """The request's ``KVPoll`` state. A room that ended is reported Success or
        Failed only once no transfer can still touch its pages (``room_drained``), so
        the scheduler may free them as soon as it sees the state; until then the last
        live state is repeated."""
        if self.conclude_state is not None:
            return self.conclude_state
        if not self._created:
            return self._last
        engine = self.kv_mgr.engine
        room = self.bootstrap_room
        try:
            state = engine.room_poll(room)
            if state not in _TERMINAL:
                self._last = int(state)
                return self._last
            if not engine.room_drained(room):
                return self._last
            self._drained = True
            if state == RoomState.FAILED:
                self.failure_reason = engine.room_failure(room)
                self.failure_cause, self.failure_from_peer = engine.room_failure_cause(room)
                if self.failure_cause == kvxfer.FailureCause.PEER_LOST:
                    self._peer_lost()
        except NotFoundError:
            self._conclude_failed("kvxfer: the room is no longer in the engine")
            return KVPoll.Failed
        self.conclude_state = int(state)
        self._finish = time.perf_counter()
        self.kv_mgr._release(room, self._token)
        return self.conclude_state

    def _peer_lost(self) -> None:
        """A peer engine of this room was lost (it may restart at another address)."""

    def _end_now(self, reason: str) -> None:
        """Ends a room that is live, or ended but not drained: aborts it with
        ``reason`` (no effect if it already ended), waits until no transfer can touch
        its pages (:meth:`_wait_drained`), keeps its outcome and reason, and clears it.
        Returns only once the pages may be reused (``room_clear`` itself never waits)."""
        engine = self.kv_mgr.engine
        room = self.bootstrap_room
        state = RoomState.FAILED
        try:
            engine.room_abort(room, reason)
            self._wait_drained(engine, room)
            state = engine.room_poll(room)
            if state == RoomState.FAILED:
                self.failure_reason = engine.room_failure(room)
                self.failure_cause, self.failure_from_peer = engine.room_failure_cause(room)
            engine.room_clear(room)
        except NotFoundError:
            # Not in the engine: only this end clears its room, and only once drained.
            pass
        except ValueError:
            # The engine was closed: kvxfer_engine_free joined every engine thread and
            # dropped the transports (over RDMA the queue pairs and memory
            # registrations), so nothing can touch the pages any more.
            pass
        self._drained = True
        if state == RoomState.FAILED and self.failure_reason is None:
            self.failure_reason = reason
        self.conclude_state = int(state) if state in _TERMINAL else KVPoll.Failed
        self._finish = time.perf_counter()
        self.kv_mgr._release(room, self._token)

    def _wait_drained(self, engine: Engine, room: int) -> None:
        """Sleeps (1 ms, growing to 10 ms) until ``room_drained`` is true for an ended
        room. Past the bound (``drain_timeout_ms`` plus :data:`DRAIN_MARGIN_S`) it
        logs an error naming the room and its reason, again each further bound, and
        keeps waiting: the pages are never reported safe before the drain."""
        start = time.monotonic()
        bound = self.kv_mgr.drain_bound_s
        next_log = start + bound
        delay = 0.001
        while not engine.room_drained(room):
            now = time.monotonic()
            if now >= next_log:
                try:
                    why = engine.room_failure(room)
                except KvxferError:
                    why = kvxfer.room_state_name(engine.room_poll(room))
                logger.error(
                    "kvxfer: room %d has not drained %.1f s after it was aborted (bound "
                    "%.1f s: drain_timeout_ms plus %.1f s); its pages stay held until it "
                    "does. Reason: %s",
                    room, now - start, bound, DRAIN_MARGIN_S, why,
                )
                next_log = now + bound
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def failure_exception(self):
        """Raises :class:`KVTransferError` with the room's recorded reason and releases
        the room. A room that is live, or ended but not yet drained, is aborted first
        and waited for until no transfer can touch its pages (see the module's
        docstring for the bound), so the scheduler may free them as soon as this
        returns, as SGLang does."""
        if self.poll() not in (KVPoll.Success, KVPoll.Failed):
            if self._created:
                self._end_now("failure_exception() called on a live transfer")
            else:
                self._conclude_failed("failure_exception() called before the transfer started")
        if self.conclude_state != KVPoll.Failed:
            reason = "failure_exception() called on a transfer that succeeded"
        else:
            reason = self.failure_reason or "kvxfer: no failure reason recorded"
        raise KVTransferError(self.bootstrap_room, reason)

    def clear(self) -> None:
        """Releases the request's room. One that is live, or ended but not yet drained,
        is aborted first ("cleared while live") and waited for until no transfer can
        touch its pages, as in :meth:`failure_exception`."""
        if self.conclude_state is not None:
            return
        if self._created:
            self._end_now("cleared while live")
        else:
            self._conclude_failed("cleared while live")

    def abort(self) -> None:
        """Fails the request ("Aborted by AbortReq.") and tells the peer; its pages are
        safe to reuse once :meth:`poll` reports Failed."""
        self._abort(ABORT_REASON)


class KvxferKVSender(_RoomEnd, BaseKVSender):
    """The prefill side of one request."""

    def __init__(
        self,
        mgr: KvxferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        self._setup(mgr, bootstrap_room)
        self.bootstrap_server_url = bootstrap_addr
        self.num_kv_indices: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.curr_idx = 0
        self._pages_sent = 0
        if mgr.system_dp_size > 1 or mgr.attn_dp_size > 1:
            self._register_dp_rank(req_has_disagg_prefill_dp_rank)
        self._create(None)

    def _register_dp_rank(self, req_has_disagg_prefill_dp_rank: bool) -> None:
        if req_has_disagg_prefill_dp_rank:
            return
        dp_rank = self.kv_mgr.attn_dp_rank if self.kv_mgr.attn_dp_size > 1 else self.kv_mgr.system_dp_rank
        status, body = http_json(
            "POST",
            f"http://{self.bootstrap_server_url}/register_dp_rank",
            {"bootstrap_room": self.bootstrap_room, "dp_rank": dp_rank},
        )
        if status != 200:
            logger.error("kvxfer: registering the prefill dp_rank failed: %s %s", status, body)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        """Records how many pages the request sends (the chunk that reaches this count
        is the last) and its aux slot (sent with the last chunk)."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Whether to call :meth:`send` for a chunk: any chunk with pages, and the last
        one even when empty (it closes the room)."""
        return num_pages > 0 or last_chunk

    def send(
        self,
        kv_indices: Any,
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        indices_event: Optional[object] = None,
    ):
        """Queues the next chunk's source pages; the chunk that brings the count to
        ``init``'s ``num_kv_indices`` is the last, and carries the aux slot. Never
        blocks on the network. A chunk the room cannot take fails the room with the
        reason."""
        if self.conclude_state is not None:
            return
        if self.num_kv_indices is None:
            self._abort("kvxfer: send() before init()")
            return
        try:
            pages = _pages(kv_indices)
        except (ValueError, TypeError) as e:
            self._abort(f"kvxfer: bad page indices: {e}")
            return
        n = len(pages)
        self.curr_idx += n
        if self.curr_idx > self.num_kv_indices:
            self._abort(
                f"kvxfer: {self.curr_idx} pages sent, more than the {self.num_kv_indices} init() announced"
            )
            return
        is_last = self.curr_idx == self.num_kv_indices
        if is_last and state_indices and any(s is not None for s in state_indices):
            self._abort("kvxfer: state buffers (hybrid models) are not supported yet")
            return
        if self._start is None:
            self._start = time.perf_counter()
        try:
            self.kv_mgr.engine.enqueue_chunk(
                self.bootstrap_room, pages, is_last, self.aux_index if is_last else None
            )
        except WrongStateError:
            return  # the room already ended; poll() reports how
        except NotFoundError:
            self._conclude_failed("kvxfer: the room is no longer in the engine")
            return
        except KvxferError as e:
            self._abort(f"kvxfer: {e.message}")
            return
        self._pages_sent += n

    def get_transfer_metric(self) -> KVTransferMetric:
        """Bytes queued (pages times the bytes of one page in every KV buffer) and, once
        the transfer succeeded, its latency from the first chunk."""
        latency = None
        if self.conclude_state == KVPoll.Success and self._start is not None and self._finish is not None:
            latency = self._finish - self._start
        return KVTransferMetric(
            transfer_latency_s=latency,
            transfer_total_bytes=self._pages_sent * self.kv_mgr.kv_item_lens_sum,
        )

    def mark_prefill_complete(self) -> None:
        """Nothing to do: the backend allocates on decode early (the only policy it
        supports)."""

    def pop_decode_prefix_len(self) -> int:
        """0: decode prefix reuse is not supported yet, so every page is sent."""
        return 0


class KvxferKVReceiver(_RoomEnd, BaseKVReceiver):
    """The decode side of one request."""

    require_staging = False

    def __init__(
        self,
        mgr: KvxferKVManager,
        bootstrap_addr: str,
        bootstrap_room: Optional[int] = None,
    ):
        self._setup(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_infos: Optional[List[Dict[str, Any]]] = None
        self.abort_notified = False
        self.prefill_dp_rank: Optional[int] = None

    def init(self, prefill_dp_rank: int):
        """Finds the prefill engines of ``prefill_dp_rank`` (this rank's TP rank, every
        pipeline stage) through the bootstrap server and creates the room pulling from
        them; on failure the request fails with the reason."""
        if self.conclude_state is not None or self._created:
            return
        mgr = self.kv_mgr
        self.prefill_dp_rank = int(prefill_dp_rank)
        if self.bootstrap_addr not in mgr.prefill_info_table and not mgr.try_ensure_parallel_info(
            self.bootstrap_addr
        ):
            self._conclude_failed(f"kvxfer: prefill server info from {self.bootstrap_addr} not available")
            return
        try:
            peers = mgr.prefill_addresses(self.bootstrap_addr, self.prefill_dp_rank)
        except RuntimeError as e:
            self._conclude_failed(f"kvxfer: {e}")
            return
        self.bootstrap_infos = [{"kvxfer_address": p, "is_dummy": False} for p in peers]
        self._create(peers)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ):
        """Sends the destination pages and aux slot to the prefill engines."""
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("kvxfer backend: host KV destinations are not supported")
        if self.conclude_state is not None:
            return
        if not self._created:
            self._abort("kvxfer: send_metadata() before init()")
            return
        if decode_prefix_len:
            self._abort("kvxfer: decode prefix reuse (decode_prefix_len > 0) is not supported yet")
            return
        if state_indices and any(s is not None for s in state_indices):
            self._abort("kvxfer: state buffers (hybrid models) are not supported yet")
            return
        try:
            pages = _pages(kv_indices)
        except (ValueError, TypeError) as e:
            self._abort(f"kvxfer: bad page indices: {e}")
            return
        self._start = time.perf_counter()
        try:
            self.kv_mgr.engine.room_set_destination(self.bootstrap_room, pages, aux_index)
        except WrongStateError:
            return  # the room already ended; poll() reports how
        except NotFoundError:
            self._conclude_failed("kvxfer: the room is no longer in the engine")
        except KvxferError as e:
            self._abort(f"kvxfer: {e.message}")

    def abort(self) -> None:
        """Fails the request ("Aborted by AbortReq.") and tells the prefill engines; the
        destination pages are safe to reuse once :meth:`poll` reports Failed."""
        self._abort(ABORT_REASON)
        self.abort_notified = True

    def _peer_lost(self) -> None:
        # Look the prefill engines up again for the next request: a restarted prefill
        # registers its new address with the bootstrap server.
        if self.prefill_dp_rank is not None:
            self.kv_mgr.forget_prefill_addresses(self.bootstrap_addr, self.prefill_dp_rank)

    def is_abort_release_safe(self) -> bool:
        """Whether no write into this request's pages can still land: the engine's
        ``room_drained``, asked until this backend has seen the room drain (never
        concluded from the request's outcome alone). A request that never had a room
        has nothing in flight."""
        if self._drained or not self._created:
            return True
        try:
            drained = self.kv_mgr.engine.room_drained(self.bootstrap_room)
        except NotFoundError:
            return True  # only this end clears its room, and only once it drained
        except ValueError:
            return True  # the engine was closed: its threads and transports are gone
        if drained:
            self._drained = True
        return drained
