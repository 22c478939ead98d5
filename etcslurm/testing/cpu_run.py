"""``python -m etcslurm.testing.cpu_run SCRIPT [ARGS]``: run a plain megatron-core script
on a CPU-only machine.

Why: megatron-core hard-codes CUDA in a few places (:mod:`etcslurm.megatron.cpu_shim`); an
elastic worker installs the shim itself, but a user's plain training loop knows nothing
of etcslurm.  The tests run such a loop (``examples/pretrain_llama_plain.py``) unchanged
through this: the shim first, then the script as ``__main__``.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m etcslurm.testing.cpu_run SCRIPT [ARGS]")
    from etcslurm.megatron.cpu_shim import install_if_needed

    install_if_needed()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
