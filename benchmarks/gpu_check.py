"""What one GPU can show of etcslurm on CUDA; run by ``benchmarks/gpu_check.sh``.

One NCCL rank only (NCCL refuses two ranks on one GPU), so: the executor's pack /
checksum / unpack on the GPU, NCCL worlds of one formed and torn down as every resize
does, megatron-core GPT training in bf16 with the distributed optimizer (etcslurm's
local-spec model, then the Transformer Engine spec where TE is installed), the state
description and the executor's local copies of that state, over an NCCL exchange group.
Prints one line per figure and ends with ``GPU CHECK OK``; a missing piece fails in one
line naming it.  ``--cpu`` runs the same code on the CPU (gloo, the CPU shim): a check
of this script on machines without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta


def fail(what: str) -> None:
    print(f"gpu_check: FAIL: {what}", file=sys.stderr)
    sys.exit(1)


def preflight(cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    if cpu:
        return
    if torch.version.cuda is None:
        fail(f"torch {torch.__version__} is a CPU build: sbin/setup-venv --cuda")
    if not torch.cuda.is_available():
        fail(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: nvidia-smi, driver")
    if not dist.is_nccl_available():
        fail("this torch has no NCCL")
    from etcslurm.runtime.worker import gpu_problem

    problem = gpu_problem()
    if problem:
        fail(f"the worker would refuse: {problem}")
    import megatron.core

    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__} CUDA "
          f"{torch.version.cuda} NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
          f"megatron-core {megatron.core.__version__}; Transformer Engine {te_version() or 'not installed'}")


def te_version() -> str | None:
    try:
        import transformer_engine
    except ImportError:
        return None
    return str(getattr(transformer_engine, "__version__", "?"))


def sync(cpu: bool) -> None:
    import torch

    if not cpu:
        torch.cuda.synchronize()


def pack_throughput(dev: object, cpu: bool) -> None:
    """The executor's packing of row and column slices of a 256 MiB tensor."""
    import torch

    from etcslurm.core.state import Piece
    from etcslurm.transfer.wire import checksum, message_layout, typed_view

    n = 2048 if cpu else 8192
    src = torch.randn(n, n, device=dev)
    rows = [Piece("w", ((r, r + n // 16), (0, n)), "float32") for r in range(0, n, n // 16)]
    cols = [Piece("w", ((0, n), (c, c + n // 8)), "float32") for c in range(0, n, n // 8)]
    for name, slices in (("row slices", rows), ("column slices (strided)", cols)):
        layout = message_layout(slices, direct_min=1 << 62)  # all packed into one buffer
        buf = torch.empty(layout.size, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        for _ in range(2):  # the second pass is measured
            sync(cpu)
            t0 = time.perf_counter()
            for i, off in zip(layout.packed, layout.offsets, strict=True):
                box = tuple(slice(lo, hi) for lo, hi in slices[i].box)
                typed_view(buf, off, slices[i]).copy_(src[box])
            sync(cpu)
            t1 = time.perf_counter()
            int(checksum(buf[: layout.payload]))
            sync(cpu)
            t2 = time.perf_counter()
            for i, off in zip(layout.packed, layout.offsets, strict=True):
                box = tuple(slice(lo, hi) for lo, hi in slices[i].box)
                dst[box].copy_(typed_view(buf, off, slices[i]))
            sync(cpu)
            t3 = time.perf_counter()
        if not torch.equal(dst, src):
            fail(f"{name}: unpacked data differs from the source")
        gb = layout.payload / 1e9
        print(f"pack {name}: pack {gb / (t1 - t0):.1f} GB/s, checksum {gb / (t2 - t1):.1f} GB/s, "
              f"unpack {gb / (t3 - t2):.1f} GB/s")


def train(trainee: object, steps: int, what: str, cpu: bool) -> None:
    import torch

    from etcslurm.megatron.train import train_step

    train_step(trainee)  # first step: kernels, allocator
    sync(cpu)
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [train_step(trainee) for _ in range(steps)]
    sync(cpu)
    took = time.perf_counter() - t0
    hyper, spec = trainee.hyper, trainee.spec  # type: ignore[attr-defined]
    tokens = steps * hyper.global_batch * spec.seq
    peak = 0 if cpu else torch.cuda.max_memory_allocated() / 2**30
    if not all(loss == loss for loss in losses) or losses[-1] >= losses[0] + 1.0:
        fail(f"{what}: losses {losses}")
    print(f"{what}: {steps} steps in {took:.2f} s, {tokens / took:,.0f} tokens/s, peak "
          f"{peak:.1f} GiB, losses {losses[0]:.4f} → {losses[-1]:.4f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks this script)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    preflight(args.cpu)
    import torch
    import torch.distributed as dist

    from etcslurm.core.layout import ParallelConfig
    from etcslurm.core.models import GPTSpec
    from etcslurm.groups import lifecycle as groups
    from etcslurm.megatron import parallel
    from etcslurm.megatron.model import (
        TrainHyper,
        build_gpt,
        padded_vocab,
        transformer_config,
        wrap_gpt,
    )
    from etcslurm.megatron.sharded_meta import local_state
    from etcslurm.transfer.executor import execute

    cpu = args.cpu
    backend = "gloo" if cpu else "nccl"
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    pack_throughput(dev, cpu)

    # NCCL worlds of one, formed and torn down as each resize does
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    groups.register_teardown_hook(parallel.teardown)
    cfg = ParallelConfig(1, 1, 1)
    took = [parallel.init_parallel(cfg, 0, 1, store, f"g{k}", backend=backend, timeout_s=120)
            for k in range(4)]
    print(f"{backend} world of one with megatron's groups: first {took[0]:.2f} s, "
          f"rebuilt in {min(took[1:]) * 1e3:.0f}-{max(took[1:]) * 1e3:.0f} ms")

    # etcslurm's model: local spec, bf16, the distributed optimizer
    spec = GPTSpec.parse("layers=2,hidden=256,heads=4,vocab=4096,seq=128" if cpu else
                         "layers=8,hidden=2048,heads=16,vocab=32768,seq=2048")
    hyper = TrainHyper(global_batch=8, micro_batch=2 if cpu else 4)
    trainee = build_gpt(spec, cfg, "distributed", dtype="bf16", hyper=hyper)
    train(trainee, args.steps, "megatron-core GPT, local spec, bf16, distributed optimizer", cpu)
    state = local_state(trainee)
    dst = [(piece, torch.empty_like(view)) for piece, view in state.items()]
    xg = groups.exchange_group(store, "gpu-check", 0, 1, backend, timeout=120)
    stats = execute([], list(state.pieces), "0", {"0": 0}, state.items(), dst, timeout=60, group=xg)
    groups.close_exchange_group(xg, now=True)
    if not all(torch.equal(a, b) for (_, a), (_, b) in zip(state.items(), dst, strict=True)):
        fail("the executor's local copies differ from the state")
    print(f"state described: {len(state)} pieces, {state.nbytes / 1e9:.2f} GB; the executor's "
          f"local copies over a {backend} exchange group: {stats.bytes_local / 1e9 / max(stats.local_seconds, 1e-9):.1f} GB/s")
    del trainee, state, dst

    # the Transformer Engine spec, where installed
    if not cpu and te_version():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.models.gpt.gpt_model import GPTModel

        parallel.init_parallel(cfg, 0, 1, store, "te", backend=backend, timeout_s=120)
        tcfg = transformer_config(spec, cfg, torch.bfloat16)
        tcfg.use_cpu_initialization = False
        gpt = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                       vocab_size=padded_vocab(spec, 1), max_sequence_length=spec.seq,
                       share_embeddings_and_output_weights=spec.tied_embeddings)
        gpt = gpt.to(torch.bfloat16).to(dev)
        te = wrap_gpt(gpt, tcfg, spec, cfg, "distributed", 1234, torch.bfloat16, hyper)
        train(te, args.steps, "megatron-core GPT, Transformer Engine spec, bf16, distributed optimizer", cpu)
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sharded = [v for v in gpt.sharded_state_dict().values() if isinstance(v, ShardedTensor)]
        print(f"Transformer Engine model: {len(sharded)} ShardedTensors in sharded_state_dict()")
        del te, gpt
    elif not cpu:
        print("Transformer Engine spec: skipped (transformer_engine not installed)")
    groups.teardown()
    print("GPU CHECK OK" if not cpu else "GPU CHECK OK (on the CPU: --cpu)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
