"""Worker processes whose model builder is written here, not taken from etcslurm's presets.

``python -m tests.custom_workers --builder NAME <etcslurm.runtime.worker args>``:

* ``own``: a Llama-style model of this file's shapes (grouped-query attention with 2
  groups, SwiGLU, RMSNorm, RoPE, untied, 3 layers, hidden 48), returned as plain
  megatron-core objects (model chunks, optimizer, scheduler): the run's spec names no
  model, so its shapes are read from the model, and every resize is planned from the
  live state.
* ``opaque``: etcslurm's GPT, except that one module's ``sharded_state_dict()`` drops its
  ``final_layernorm`` weight (as a user's custom layer without sharded-state support
  would): the session must refuse it at start, naming the tensor, in one line.
"""

from __future__ import annotations

import sys
from typing import Any

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import PRESETS, GPTSpec
from etcslurm.megatron.model import TrainHyper, build_gpt
from etcslurm.runtime.worker import main

OWN = GPTSpec(layers=3, hidden=48, heads=4, query_groups=2, ffn=96, vocab=1024, seq=64,
              tied_embeddings=False, gated=True, activation="silu", norm="RMSNorm",
              position="rope", bias=False)


def build_own(layout: ParallelConfig) -> Any:
    """This file's model, as a user's builder returns it: its own objects."""
    trainee = build_gpt(OWN, layout, optimizer="distributed", seed=1234,
                        hyper=TrainHyper(global_batch=12))
    return trainee.model, trainee.optimizer, trainee.scheduler


def build_opaque(layout: ParallelConfig) -> Any:
    trainee = build_gpt(PRESETS["gpt-tiny"], layout, hyper=TrainHyper(global_batch=12))
    chunk = trainee.model[0]
    inner = chunk.module if hasattr(chunk, "module") else chunk
    original = inner.sharded_state_dict

    def without_final_norm(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state = original(*args, **kwargs)
        for key in [k for k in state if k.startswith("decoder.final_layernorm.weight")]:
            del state[key]
        return state

    inner.sharded_state_dict = without_final_norm
    return trainee.model, trainee.optimizer, trainee.scheduler


BUILDERS = {"own": build_own, "opaque": build_opaque}

if __name__ == "__main__":
    args = sys.argv[1:]
    name = args[args.index("--builder") + 1]
    del args[args.index("--builder"): args.index("--builder") + 2]
    sys.exit(main(args, build=BUILDERS[name]))
