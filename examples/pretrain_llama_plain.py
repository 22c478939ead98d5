"""Pretrain a small Llama-style model with megatron-core; plain, or elastic.

``examples/pretrain_llama_plain.py`` is a plain megatron-core training loop;
``examples/pretrain_llama.py`` is the same loop made elastic (the README, "Adopt it in
your loop", shows the diff).  Its own model (megatron-core
``GPTModel``, local layer spec: grouped-query attention, SwiGLU, RMSNorm, RoPE, untied
output layer), its own optimizer (``get_megatron_optimizer``) and LR scheduler, and
megatron-core's own data pipeline: ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``
on a small indexed dataset this script writes (``IndexedDatasetBuilder``).  Each step
reads the next global batch from the consumed-samples counter, in the order of
Megatron-LM's pretraining sampler, so after a restart or a resize (any data-parallel
size) training continues with the next unseen sample.

    torchrun --nproc-per-node 2 examples/pretrain_llama_plain.py --layout tp1pp1dp2 \
        --save ckpt --save-interval 10      # then --load ckpt, in any layout
    python examples/pretrain_llama.py --run r1 --redis URL --password-file F --workers 2  # x2
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

VOCAB_MULTIPLE = 1024  # pad the vocabulary independently of TP (global shapes never change)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a small Llama with megatron-core.")
    p.add_argument("--run-dir", default=".")
    p.add_argument("--layout", default=None,
                   help="tp<N>pp<N>dp<N>: the layout (plain: N ranks; elastic: the first one)")
    p.add_argument("--load", default=None, metavar="DIR",
                   help="start from this Megatron-LM checkpoint (a --save DIR or an iter_N)")
    p.add_argument("--save", default=None, metavar="DIR", help="plain loop: checkpoint into DIR")
    p.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="checkpoint every N steps (elastic: into its --checkpoint-dir)")
    # the model's shapes (a small Llama: grouped-query attention with 2 groups)
    for name, default in (("layers", 4), ("hidden", 64), ("heads", 4), ("query-groups", 2),
                          ("ffn", 128), ("vocab", 1000), ("seq", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--optimizer", choices=("adam", "distributed"), default="adam")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-dir", default=None, help="where the corpus is written (default: run dir)")
    return p


@dataclass
class Progress:
    """The data position: steps done and samples consumed (the next batch's start)."""

    iteration: int = 0
    consumed_samples: int = 0


# ---------------------------------------------------------------------------- model
def build(args: argparse.Namespace) -> tuple[list[Any], Any, Any]:
    """This rank's Llama (model chunks, optimizer, LR scheduler) for the layout
    ``parallel_state`` is initialised for.  Same seed -> same global weights."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, ffn_hidden_size=args.ffn,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, use_cpu_initialization=True, init_method_std=0.02,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    gpt = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=-(-args.vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        max_sequence_length=args.seq, position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    ).to("cuda" if torch.cuda.is_available() else "cpu")
    distributed = args.optimizer == "distributed"
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                        use_distributed_optimizer=distributed)
    model = [DistributedDataParallel(config=config, ddp_config=ddp, module=gpt)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync
    min_lr, warmup, decay, wd = args.lr / 10, 2, 1000, 0.01
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=min_lr, weight_decay=wd,
                        adam_beta2=0.95, clip_grad=1.0, use_distributed_optimizer=distributed),
        model, use_gloo_process_groups=dist.get_backend() != "gloo")
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=min_lr,
        lr_warmup_steps=warmup * args.global_batch, lr_decay_steps=decay * args.global_batch,
        lr_decay_style="cosine", start_wd=wd, end_wd=wd,
        wd_incr_steps=decay * args.global_batch, wd_incr_style="constant")
    return model, optimizer, scheduler


# ---------------------------------------------------------------------------- data
class Tokenizer:
    """What ``GPTDataset`` asks of a tokenizer (the corpus is already token ids)."""

    def __init__(self, vocab: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab, vocab - 1, -1
        self.unique_identifiers = {"class": "Tokenizer", "vocab_size": vocab}


def build_dataset(args: argparse.Namespace) -> Any:
    """megatron-core's ``GPTDataset`` over a small corpus written here (once: a file lock
    keeps concurrent workers from writing it, or its index cache, twice)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    seed, vocab = args.seed, args.vocab
    prefix = Path(args.data_dir or args.run_dir) / "corpus"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(f"{prefix}.idx").exists():
            gen = torch.Generator().manual_seed(seed)
            builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
            for _ in range(4096):  # documents of 21-200 tokens: learnable progressions
                n, start, stride = torch.randint(20, 200, (3,), generator=gen).tolist()
                doc = (start + (stride % 7 + 1) * torch.arange(n)) % (vocab - 1)
                builder.add_document(torch.cat([doc, torch.tensor([vocab - 1])]), [n + 1])
            builder.finalize(f"{prefix}.idx")
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=args.seq, blend=([str(prefix)], None),
            split="1,0,0", tokenizer=Tokenizer(vocab), reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False,
            path_to_cache=str(prefix.parent / "cache"))
        train, _valid, _test = BlendedMegatronDatasetBuilder(
            GPTDataset, [args.steps * args.global_batch, None, None], lambda: True,
            config).build()
    return train


def micro_batches(dataset: Any, progress: Progress, args: argparse.Namespace, log: Any) -> Any:
    """This DP rank's micro-batches of the next global batch, from the consumed-samples
    counter (Megatron-LM's pretraining sampler order: micro-batch ``m`` of DP rank ``r``
    holds samples ``consumed + (m·dp + r)·mb ...``), so the data position is the counter."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mb = args.micro_batch
    first = [progress.consumed_samples + (m * dp + rank) * mb
             for m in range(args.global_batch // (dp * mb))]
    if log is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage():
        log.write(json.dumps({"step": progress.iteration, "dp": dp, "rank": rank,
                              "samples": [f + j for f in first for j in range(mb)]}) + "\n")
        log.flush()
    for f in first:
        items = [dataset[f + j] for j in range(mb)]
        yield {k: torch.stack([item[k] for item in items]) for k in items[0]}


# ---------------------------------------------------------------------------- one step
def loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_step(model: list[Any], optimizer: Any, scheduler: Any, progress: Progress,
               dataset: Any, args: argparse.Namespace, log: Any = None) -> float:
    """One optimizer step on the next global batch; the global mean loss (on every rank).
    The loss is reduced before the update and nothing communicates after it."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, mb = ps.get_data_parallel_world_size(), args.micro_batch
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=micro_batches(dataset, progress, args, log),
        model=model, num_microbatches=args.global_batch // (dp * mb), seq_length=args.seq,
        micro_batch_size=mb, forward_only=False)
    total = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        total += sum(float(d["lm loss"]) for d in losses)
    dist.all_reduce(total)
    ok, _grad_norm, _zeros = optimizer.step()
    if not ok:
        raise RuntimeError(f"step {progress.iteration} skipped (inf/nan gradients)")
    scheduler.step(increment=args.global_batch)
    progress.iteration += 1
    progress.consumed_samples += args.global_batch
    loss = float(total.item()) * mb / args.global_batch
    report(progress, loss)
    return loss


def report(progress: Progress, loss: float) -> None:
    if dist.get_rank() == 0:
        print(json.dumps({"step": progress.iteration, "loss": loss,
                          "consumed_samples": progress.consumed_samples}), flush=True)


# ---------------------------------------------------------------------------- checkpoints
# Megatron-LM's (megatron/training/checkpointing.py), with megatron-core's dist_checkpointing:
# SAVE/iter_NNNNNNN/ and SAVE/latest_checkpointed_iteration.txt; model (model0..N for virtual
# pipeline chunks), optimizer, opt_param_scheduler, rng_state, iteration, args.
TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_state(model: list[Any], optimizer: Any, metadata: dict, loading: bool,
                     rng: bool = True) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    groups = {**metadata, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    chunks = [chunk.module for chunk in model]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state = {key: chunk.sharded_state_dict(metadata=groups)
             for key, chunk in zip(keys, chunks, strict=True)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=groups)
    if rng:  # one per (pp, tp) rank, restored only into the same TP and PP
        states = None if loading else [{
            "random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
            "rng_tracker_states": get_cuda_rng_tracker().get_states()}]
        state["rng_state"] = ShardedObject(
            "rng_state", states, (ps.get_pipeline_model_parallel_world_size(),
                                  ps.get_tensor_model_parallel_world_size()),
            (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    return state


def save_checkpoint(model: list[Any], optimizer: Any, scheduler: Any, progress: Progress,
                    args: argparse.Namespace) -> None:
    """Every --save-interval steps into --save (the distributed optimizer in Megatron-LM's
    default format, dp_reshardable); the tracker moves once every rank's files are written."""
    from megatron.core import dist_checkpointing

    if not args.save or not args.save_interval or progress.iteration % args.save_interval:
        return
    metadata: dict[str, Any] = {"singleton_local_shards": False,
                                "chained_optim_avoid_prefix": True}
    if args.optimizer == "distributed":
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    path = Path(args.save) / f"iter_{progress.iteration:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = checkpoint_state(model, optimizer, metadata, loading=False)
    saved_args = argparse.Namespace(
        **vars(args), tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(), world_size=dist.get_world_size(),
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        consumed_train_samples=progress.consumed_samples,
        use_distributed_optimizer=args.optimizer == "distributed")
    state.update(iteration=progress.iteration, checkpoint_version=3.0, args=saved_args,
                 opt_param_scheduler=scheduler.state_dict(),
                 num_floating_point_operations_so_far=0)
    dist_checkpointing.save(state, str(path), content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(args.save) / TRACKER).write_text(f"{progress.iteration}\n")


def load_checkpoint(model: list[Any], optimizer: Any, scheduler: Any, progress: Progress,
                    args: argparse.Namespace) -> Progress:
    """--load's checkpoint (its tracker's iteration, or one iter_N) into the model, in any
    TP/PP when its optimizer state is model-space (a plain optimizer, fully_reshardable)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if not args.load:
        return progress
    path = Path(args.load)
    if (path / TRACKER).exists():
        path = path / f"iter_{int((path / TRACKER).read_text()):07d}"
    common = dist_checkpointing.load_common_state_dict(str(path))
    metadata = dist_checkpointing.load_content_metadata(str(path)) or {}
    saved = common["args"]
    same = (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size) == (
        ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    sharding = metadata.get("distrib_optim_sharding_type")
    if args.optimizer == "distributed" and not same and sharding != "fully_reshardable":
        raise SystemExit(f"{path}: (TP, PP) mismatch: the distributed optimizer's {sharding} "
                         "format reshards only along DP")
    request = checkpoint_state(model, optimizer, metadata, loading=True, rng=same)
    loaded = dist_checkpointing.load(request, str(path))
    for key in [k for k in request if k == "model" or k[5:].isdigit()]:
        model[int(key[5:] or 0)].module.load_state_dict(loaded[key])
    with torch.no_grad():  # fp32 params: the main params are views of them
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    progress.iteration, progress.consumed_samples = loaded["iteration"], saved.consumed_train_samples
    if same:
        rng = loaded["rng_state"][0]
        random.setstate(rng["random_rng_state"])
        numpy.random.set_state(rng["np_rng_state"])
        torch.set_rng_state(rng["torch_rng_state"])
        torch.cuda.set_rng_state(rng["cuda_rng_state"])
        get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    return progress


def parse_layout(text: str | None) -> tuple[int, int]:
    """(tp, pp) of ``tp<N>pp<N>dp<N>`` (the data-parallel size is what the ranks leave)."""
    match = re.fullmatch(r"tp(\d+)pp(\d+)dp(\d+)", text or "tp1pp1dp1")
    if match is None:
        raise SystemExit(f"--layout {text!r} is not of the form tp<N>pp<N>dp<N>")
    return int(match[1]), int(match[2])


# ---------------------------------------------------------------------------- the loop
def main() -> None:
    args = parser().parse_args()
    dataset = build_dataset(args)
    log = open(Path(args.run_dir) / f"samples-{os.getpid()}.jsonl", "a")  # noqa: SIM115
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ps.initialize_model_parallel(*parse_layout(args.layout))
    model, optimizer, scheduler = build(args)
    progress = load_checkpoint(model, optimizer, scheduler, Progress(), args)  # --load: resume
    while progress.iteration < args.steps:
        train_step(model, optimizer, scheduler, progress, dataset, args, log)
        save_checkpoint(model, optimizer, scheduler, progress, args)  # every --save-interval


if __name__ == "__main__":
    main()
