"""Selecting this backend inside SGLang: ``--disaggregation-transfer-backend kvxfer``.

SGLang 0.5.23 picks transfer classes with ``get_kv_class(TransferBackend(name),
class_type)`` (``sglang/srt/disaggregation/utils.py``), a fixed table. :func:`install`
adds ``kvxfer`` to it: a ``TransferBackend.KVXFER`` member, the command line choice,
and a ``get_kv_class`` that answers this backend's classes for it and defers to
SGLang's for every other backend (in every module that imported it by name).

It must run in every process that builds transfer classes: the server's main process
(bootstrap server) and each scheduler process. ``python -m kvxfer.sglang.launch_server``
does that (schedulers are started with ``spawn``, which re-imports the main module).
"""

from __future__ import annotations

import sys
from typing import Any

BACKEND = "kvxfer"
"""The backend's name on SGLang's command line."""


def _add_member(enum_cls: Any, name: str, value: str) -> Any:
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    setattr(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def classes() -> dict[str, type]:
    """This backend's classes by SGLang ``KVClassType`` value."""
    from .bootstrap import KvxferKVBootstrapServer
    from .conn import KvxferKVManager, KvxferKVReceiver, KvxferKVSender

    return {
        "manager": KvxferKVManager,
        "sender": KvxferKVSender,
        "receiver": KvxferKVReceiver,
        "bootstrap_server": KvxferKVBootstrapServer,
    }


def install() -> None:
    """Registers the ``kvxfer`` transfer backend with the imported SGLang (idempotent)."""
    from sglang.srt.disaggregation import utils  # type: ignore[import-not-found]

    patch(utils)
    try:
        from sglang.srt.arg_groups import choices  # type: ignore[import-not-found]

        if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
            choices.add_disagg_transfer_backend_choices([BACKEND])
    except ImportError:  # pragma: no cover - other SGLang layouts
        pass


def patch(utils: Any) -> None:
    """Adds the backend to a module with SGLang's ``TransferBackend``, ``KVClassType``
    and ``get_kv_class``, and to every loaded module that imported that
    ``get_kv_class`` by name."""
    member = _add_member(utils.TransferBackend, BACKEND.upper(), BACKEND)
    original = utils.get_kv_class
    if getattr(original, "_kvxfer_original", None) is not None:
        return
    table = classes()

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend == member and class_type.value in table:
            return table[class_type.value]
        return original(transfer_backend, class_type)

    get_kv_class._kvxfer_original = original  # type: ignore[attr-defined]
    get_kv_class.__doc__ = original.__doc__
    for module in list(sys.modules.values()):
        if getattr(module, "get_kv_class", None) is original:
            setattr(module, "get_kv_class", get_kv_class)
    utils.get_kv_class = get_kv_class
