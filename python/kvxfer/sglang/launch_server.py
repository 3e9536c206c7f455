"""``python -m kvxfer.sglang.launch_server ARGS...``: SGLang's ``sglang.launch_server``
with the ``kvxfer`` transfer backend installed, so ``--disaggregation-transfer-backend
kvxfer`` selects it.

The install runs at import, outside the ``__main__`` guard: SGLang starts its scheduler
processes with ``spawn``, which imports this module again in each of them.
"""

import runpy

from kvxfer.sglang.install import install

install()

if __name__ == "__main__":
    # alter_sys=False keeps this module as __main__, so spawned children import it.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
