"""What the scheduler-side connector tells the worker-side connector each step, and the
``kv_transfer_params`` the two vLLM servers exchange through the proxy.

Plain data only: the plan crosses from vLLM's engine core to its workers pickled inside
``SchedulerOutput``, and the params travel as JSON through the client. Nothing here
imports vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

ROOM_KEY = "kvxfer_room"
"""``kv_transfer_params`` key: the room id (an integer in 0..2^64-1)."""

PREFILL_KEY = "kvxfer_prefill"
"""``kv_transfer_params`` key: the libkvxfer engine address of each prefill TP rank."""

NUM_TOKENS_KEY = "kvxfer_num_tokens"
"""``kv_transfer_params`` key: the prompt tokens whose KV the prefill holds."""

NUM_BLOCKS_KEY = "kvxfer_num_blocks"
"""``kv_transfer_params`` key: the blocks the prefill will send."""

_PROCESSED_KEY = "_kvxfer_processed"
"""Set on a decode request's params once the connector acted on them (vLLM may call
``update_state_after_alloc`` twice for one request)."""

_U64_MAX = (1 << 64) - 1


@dataclasses.dataclass
class SendRoom:
    """Prefill: create room ``room`` and send ``blocks`` (the request's blocks, in
    order) as its one and last chunk."""

    req_id: str
    room: int
    blocks: list[int]


@dataclasses.dataclass
class RecvRoom:
    """Decode: create room ``room`` pulling from ``prefill[tp_rank]`` with ``blocks``
    (freshly allocated, in order) as its destination."""

    req_id: str
    room: int
    prefill: list[str]
    blocks: list[int]


@dataclasses.dataclass
class AbortRoom:
    """Decode: abort the room of ``req_id``.

    ``notify_only`` is for a request vLLM dropped before it ever had blocks (aborted
    while queued, or with params this decode cannot load): the worker creates the room
    only to abort it (on TP rank 0, pulling from every prefill rank in ``prefill``), so
    the prefill gives its blocks back now rather than at its bootstrap timeout, and does
    not report the request (vLLM no longer knows it).
    Otherwise the room is the one a :class:`RecvRoom` created and the request is
    reported finished once the room is drained, unless it was reported already."""

    req_id: str
    room: int
    reason: str
    prefill: Optional[list[str]] = None
    notify_only: bool = False


@dataclasses.dataclass
class StepPlan:
    """One step's work for the worker-side connector: applied in this order."""

    send: list[SendRoom] = dataclasses.field(default_factory=list)
    recv: list[RecvRoom] = dataclasses.field(default_factory=list)
    abort: list[AbortRoom] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.send or self.recv or self.abort)


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """The kvxfer part of a decode request's ``kv_transfer_params``, validated."""

    room: int
    prefill: list[str]
    num_tokens: Optional[int]
    num_blocks: Optional[int]


class BadParams(ValueError):
    """``kv_transfer_params`` that name a kvxfer room but cannot be used."""


def _int(params: Mapping[str, Any], key: str, lo: int, hi: int) -> Optional[int]:
    v = params.get(key)
    if v is None:
        return None
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadParams(f"{key}={v!r} is not an integer in {lo}..{hi}")
    return v


def remote_prefill(params: Optional[Mapping[str, Any]]) -> Optional[RemotePrefill]:
    """The room a decode request should pull, or None when its params ask for no
    kvxfer load (no params, another connector's params, or already acted on).

    Raises :class:`BadParams` when they name a room but are malformed."""
    if not params or not params.get("do_remote_prefill") or params.get(_PROCESSED_KEY):
        return None
    if ROOM_KEY not in params:
        return None
    room = _int(params, ROOM_KEY, 0, _U64_MAX)
    prefill = params.get(PREFILL_KEY)
    if (
        not isinstance(prefill, list)
        or not prefill
        or not all(isinstance(a, str) and a for a in prefill)
    ):
        raise BadParams(f"{PREFILL_KEY}={prefill!r} is not a list of engine addresses")
    assert room is not None
    return RemotePrefill(
        room=room,
        prefill=list(prefill),
        num_tokens=_int(params, NUM_TOKENS_KEY, 1, _U64_MAX),
        num_blocks=_int(params, NUM_BLOCKS_KEY, 1, _U64_MAX),
    )


def room_and_prefill(params: Optional[Mapping[str, Any]]) -> Optional[tuple[int, list[str]]]:
    """The room id and prefill addresses of params that may be malformed otherwise,
    when both can be read: enough to tell the prefill to let the room go."""
    if not params:
        return None
    try:
        room = _int(params, ROOM_KEY, 0, _U64_MAX)
    except BadParams:
        return None
    prefill = params.get(PREFILL_KEY)
    if room is None or not isinstance(prefill, list) or not prefill:
        return None
    if not all(isinstance(a, str) and a for a in prefill):
        return None
    return room, list(prefill)


def mark_processed(params: dict[str, Any]) -> None:
    """Records on the request's own params dict that the connector acted on them."""
    params["do_remote_prefill"] = False
    params[_PROCESSED_KEY] = True


def prefill_params(
    room: int, addresses: list[str], num_tokens: int, num_blocks: int
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill returns for the decode. The NIXL keys
    ``do_remote_prefill`` / ``do_remote_decode`` are kept so one proxy serves both."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        ROOM_KEY: room,
        PREFILL_KEY: list(addresses),
        NUM_TOKENS_KEY: num_tokens,
        NUM_BLOCKS_KEY: num_blocks,
    }
