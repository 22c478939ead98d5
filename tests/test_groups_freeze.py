"""The first world freezes what was alive before it (imports), so the garbage collection of
every later teardown walks only newer objects -- and models built afterwards are still
collected.

Runs in a subprocess: the CPU shim that ``init_world`` installs patches torch globally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CODE = r"""
import gc, json, weakref
import torch
import torch.distributed as dist
from etcslurm.core.layout import ParallelConfig
from etcslurm.groups import lifecycle
from etcslurm.megatron.parallel import init_model_parallel, init_world

assert not lifecycle.frozen()
store = dist.HashStore()
init_world(0, 1, store, "g0")
init_model_parallel(ParallelConfig(1, 1, 1))
frozen_count = gc.get_freeze_count()

class Model(torch.nn.Module):  # a reference cycle, as DDP hooks and optimizers make
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)
        self.me = self

model = Model()
alive = weakref.ref(model)
del model
init_world(0, 1, store, "g1")  # its teardown collects the old world's garbage
init_model_parallel(ParallelConfig(1, 1, 1))
print(json.dumps({"frozen": frozen_count, "freeze_again": lifecycle.freeze_long_lived(),
                  "walked": len(gc.get_objects()), "model_freed": alive() is None}))
lifecycle.teardown()
"""


def test_first_world_freezes_imports_and_later_models_are_still_collected() -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # torch + megatron-core's model stack: hundreds of thousands of objects, skipped by
    # every later collection, which walks a small fraction of that
    assert got["frozen"] > 100_000, got
    assert got["walked"] < got["frozen"] // 10, got
    assert got["freeze_again"] is False  # once per process
    assert got["model_freed"], "a model made after the first world must stay collectable"
