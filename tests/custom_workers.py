"""Worker processes whose model builder is written here, not taken from etcslurm's presets.

``python -m tests.custom_workers --builder NAME <etcslurm.runtime.worker args>``:

* ``own``: a Llama-style model whose shapes are this file's, not the run's ``model``
  (grouped-query attention with 2 groups, SwiGLU, RMSNorm, RoPE, untied, 3 layers,
  hidden 48): the runtime must plan every resize from the live state, since its analytic
  model of the run's spec describes another model.
* ``opaque``: etcslurm's GPT, except that one module's ``sharded_state_dict()`` drops its
  ``final_layernorm`` weight (as a user's custom layer without sharded-state support
  would): the session must refuse it at start, naming the tensor, in one line.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.runtime.config import RunSettings, default_builder
from etcslurm.runtime.worker import main

OWN = GPTSpec(layers=3, hidden=48, heads=4, query_groups=2, ffn=96, vocab=1024, seq=64,
              tied_embeddings=False, gated=True, activation="silu", norm="RMSNorm",
              position="rope", bias=False)


def build_own(model: GPTSpec, layout: ParallelConfig, settings: RunSettings) -> Any:
    """This file's model, whatever the run's spec says."""
    del model
    return default_builder(OWN, layout, replace(settings, model=OWN))


def build_opaque(model: GPTSpec, layout: ParallelConfig, settings: RunSettings) -> Any:
    trainee = default_builder(model, layout, settings)
    chunk = trainee.model[0]
    inner = chunk.module if hasattr(chunk, "module") else chunk
    original = inner.sharded_state_dict

    def without_final_norm(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state = original(*args, **kwargs)
        for key in [k for k in state if k.startswith("decoder.final_layernorm.weight")]:
            del state[key]
        return state

    inner.sharded_state_dict = without_final_norm
    return trainee


BUILDERS = {"own": build_own, "opaque": build_opaque}

if __name__ == "__main__":
    args = sys.argv[1:]
    name = args[args.index("--builder") + 1]
    del args[args.index("--builder"): args.index("--builder") + 2]
    sys.exit(main(args, build=BUILDERS[name]))
