"""An SGLang transfer backend on libkvxfer.

The classes have the constructor arguments and methods of SGLang 0.5.23's
``BaseKVManager``, ``BaseKVSender``, ``BaseKVReceiver`` and ``BaseKVBootstrapServer``
(and subclass them when SGLang imports). Select the backend in SGLang with
``python -m kvxfer.sglang.launch_server ... --disaggregation-transfer-backend kvxfer``
or by calling :func:`install` in your own launcher; see the README for what is not
supported yet.
"""

from ._compat import (
    SGLANG_BASES,
    SGLANG_VERSION_TARGETED,
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferError,
    KVTransferMetric,
)
from .bootstrap import KvxferKVBootstrapServer
from .conn import (
    ABORT_REASON,
    KvxferKVManager,
    KvxferKVReceiver,
    KvxferKVSender,
    PrefillServerInfo,
)
from .install import BACKEND, install

__all__ = [
    "ABORT_REASON",
    "BACKEND",
    "BaseKVBootstrapServer",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "KVArgs",
    "KVPoll",
    "KVTransferDestination",
    "KVTransferError",
    "KVTransferMetric",
    "KvxferKVBootstrapServer",
    "KvxferKVManager",
    "KvxferKVReceiver",
    "KvxferKVSender",
    "PrefillServerInfo",
    "SGLANG_BASES",
    "SGLANG_VERSION_TARGETED",
    "install",
]
