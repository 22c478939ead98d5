"""The demo's training step, made atomic with respect to peer failures.

Why not :func:`etcslurm.megatron.train.train_step` as is: the elastic runtime redoes a
step in which a peer died, which is only correct if no rank has applied its optimizer
update when the failure surfaces.  So the global loss is all-reduced *before*
``optimizer.step()``, and nothing communicates after the update (plain Adam: the update
is local; gradient clipping's norm all-reduce happens before it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def atomic_train_step(trainee: Any, data_seed: int | None = None) -> float:
    """One optimizer step on global step ``trainee.iteration``; the global mean loss."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from etcslurm.megatron.train import _forward_step, micro_batches, num_microbatches

    spec, hyper = trainee.spec, trainee.hyper
    n_micro = num_microbatches(trainee)
    for chunk in trainee.model:
        chunk.zero_grad_buffer()
    trainee.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=micro_batches(trainee, trainee.iteration, data_seed),
        model=trainee.model,
        num_microbatches=n_micro,
        seq_length=spec.seq,
        micro_batch_size=hyper.micro_batch,
        decoder_seq_length=spec.seq,
        forward_only=False,
    )
    total = torch.zeros(1, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        total += sum(float(d["lm loss"]) for d in losses)
    dist.all_reduce(total)  # last collective before the update: a failure here is harmless
    ok, _grad_norm, _zeros = trainee.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {trainee.iteration} was skipped (inf/nan grads)")
    if trainee.scheduler is not None:
        trainee.scheduler.step(increment=hyper.global_batch)
    trainee.iteration += 1
    trainee.consumed_samples += hyper.global_batch
    return float(total.item() / (hyper.global_batch // hyper.micro_batch))
