"""Deterministic synthetic training, identical in every layout.

Why: loss continuity across a migration can only be checked when any layout can take any
global batch.  Sample ``i`` of the dataset is a pure function of ``(seed, i)``
(:func:`sample`); step ``t`` uses samples ``[t·B, (t+1)·B)`` of a global batch ``B`` that
stays constant across layouts: each DP rank takes ``B / dp`` consecutive samples as
micro-batches (gradient accumulation), so a smaller DP means more micro-batches per rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from etcslurm.errors import LayoutError
from etcslurm.megatron.model import Trainee


def sample(seed: int, index: int, seq: int, vocab: int) -> torch.Tensor:
    """Tokens of sample ``index``: ``seq + 1`` ids below ``vocab`` (pure in seed, index).

    An arithmetic progression modulo ``vocab`` with a random start and a small random
    stride: learnable (the next token follows from the last two), so the loss visibly
    falls within a few dozen steps, as a demo should show.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63 - 1))
    start, stride = torch.randint(0, vocab, (2,), generator=gen, dtype=torch.int64).tolist()
    return (start + (stride % 7 + 1) * torch.arange(seq + 1, dtype=torch.int64)) % vocab


def micro_batches(trainee: Trainee, step: int, data_seed: int | None = None) -> Iterator[dict]:
    """This DP rank's micro-batches of global step ``step``."""
    from megatron.core import parallel_state

    hyper, spec = trainee.hyper, trainee.spec
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = hyper.global_batch // dp
    seed = trainee.seed if data_seed is None else data_seed
    base = step * hyper.global_batch + dp_rank * per_rank
    mask = torch.tril(torch.ones(1, 1, spec.seq, spec.seq)) < 0.5
    positions = torch.arange(spec.seq).unsqueeze(0).expand(hyper.micro_batch, -1)
    for m in range(per_rank // hyper.micro_batch):
        first = base + m * hyper.micro_batch
        tokens = torch.stack(
            [sample(seed, first + j, spec.seq, spec.vocab) for j in range(hyper.micro_batch)]
        )
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": positions,
            "attention_mask": mask,
        }


def num_microbatches(trainee: Trainee) -> int:
    """Micro-batches per DP rank per step that keep the global batch constant."""
    hyper, config = trainee.hyper, trainee.config
    problem = config.batch_problem(hyper.global_batch, hyper.micro_batch)
    if problem is not None:
        raise LayoutError(f"{config}: {problem}")
    return hyper.global_batch // (config.dp * hyper.micro_batch)


def _loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    # clone: megatron divides the returned loss in place by the micro-batch count
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, partial(_loss_func)


def train_step(trainee: Trainee, data_seed: int | None = None) -> float:
    """One optimizer step on global step ``trainee.iteration``; the global mean loss.

    Every rank returns the same value (a float64 sum over the last pipeline stage's
    micro-batch losses, all-reduced over the world, divided by the global batch).

    Atomic with respect to peer failures, which the elastic runtime relies on to redo a
    step in which a peer died: the loss is reduced *before* the optimizer update and
    nothing communicates after it (plain Adam's update is local; gradient clipping's norm
    all-reduce runs before it), so a failure surfaces before any rank changed its state.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec, hyper = trainee.spec, trainee.hyper
    n_micro = num_microbatches(trainee)
    for chunk in trainee.model:
        chunk.zero_grad_buffer()
    trainee.optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=_forward_step,
        # an interleaved pipeline's chunks each read the step's micro-batches in order
        data_iterator=(micro_batches(trainee, trainee.iteration, data_seed)
                       if len(trainee.model) == 1 else
                       [micro_batches(trainee, trainee.iteration, data_seed)
                        for _ in trainee.model]),
        model=trainee.model,
        num_microbatches=n_micro,
        seq_length=spec.seq,
        micro_batch_size=hyper.micro_batch,
        decoder_seq_length=spec.seq,
        forward_only=False,
    )
    total = torch.zeros(1, dtype=torch.float64)
    if (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
    ):
        total += sum(float(d["lm loss"]) for d in losses)
    dist.all_reduce(total)  # the last collective before the update
    ok, _grad_norm, _zeros = trainee.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {trainee.iteration} was skipped (inf/nan grads)")
    if trainee.scheduler is not None:
        trainee.scheduler.step(increment=hyper.global_batch)
    trainee.iteration += 1
    trainee.consumed_samples += hyper.global_batch
    micro_total = hyper.global_batch // hyper.micro_batch
    return float(total.item() / micro_total)
