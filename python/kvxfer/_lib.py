"""Loads libkvxfer.so and binds every C function with its prototype from ``_abi``.

The wheel carries the library next to this file. ``KVXFER_LIBRARY`` names another
copy (for example a debug build, ``target/debug/libkvxfer.so``); its version must equal
the header's the bindings were generated from, or the import fails.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from . import _abi

LIBRARY_ENV = "KVXFER_LIBRARY"


def _candidates() -> list[Path]:
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    # The installed wheel; then, for a source checkout used in place, cargo's outputs.
    root = here.parents[1]
    return [
        here / "libkvxfer.so",
        root / "target" / "release" / "libkvxfer.so",
        root / "target" / "debug" / "libkvxfer.so",
    ]


def _load() -> tuple[ctypes.CDLL, str]:
    tried = []
    for path in _candidates():
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            _abi.bind(lib)
            version = lib.kvxfer_version().decode()
            if version != _abi.HEADER_VERSION:
                raise ImportError(
                    f"kvxfer: {path} is libkvxfer {version}, but these bindings were "
                    f"generated from the {_abi.HEADER_VERSION} header"
                )
            return lib, str(path)
        tried.append(str(path))
    raise ImportError(
        "kvxfer: libkvxfer.so not found (looked at " + ", ".join(tried) + "); install the "
        f"package with `pip install ./python` from the checkout, or set {LIBRARY_ENV}"
    )


lib, path = _load()
"""The loaded library, with ``argtypes``/``restype`` set on every function."""
