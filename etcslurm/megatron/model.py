"""Build a megatron-core GPT model and its optimizer for the current layout.

Why these settings: migration must be exact to the bit and losses must be comparable
across layouts, so the model is deterministic (dropout 0), uses megatron-core's local spec
(no Transformer Engine/Apex needed, runs on CPU), ``use_cpu_initialization=True`` (the
same initial weights for every TP split of one seed), and a vocabulary padded apart from
TP (:func:`padded_vocab`): every global tensor has one shape in every layout whose TP
divides 8.

The architecture is the :class:`GPTSpec`'s, which ``megatron_state`` expands
analytically: GPT-2 style (MHA, GELU, LayerNorm, learned positions, biases) or Llama
style (``num_query_groups``, ``gated_linear_unit=True`` + SiLU, ``normalization=
"RMSNorm"``, ``position_embedding_type="rope"``, untied output layer,
``add_bias_linear=False``).  bf16 (``dtype`` or the spec's ``dtype``): ``params_dtype`` and
``bf16=True``, the whole module cast to bf16 as Megatron-LM's ``Float16Module`` does (the
torch norms are created fp32 otherwise), fp32 main params in the optimizer.

The optimizer is megatron's own (``get_megatron_optimizer``, Adam, plain or distributed)
behind megatron's DDP wrapper, its state initialised at build time (:mod:`.adam_state`):
a freshly built optimizer already has every tensor a migration writes into.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.stages import uneven
from etcslurm.errors import UsageError
from etcslurm.megatron import cpu_shim
from etcslurm.megatron.adam_state import init_optimizer_state
from etcslurm.megatron.stale_graphs import watch

OPTIMIZERS = ("adam", "distributed")
#: TP sizes up to this share one padded vocabulary (megatron pads per TP otherwise,
#: which would change the embedding's global shape across a TP change)
VOCAB_TP_MULTIPLE = 8

#: set inside :func:`weights_filled_later`: models built there skip megatron's random init
_FILLED_LATER: contextvars.ContextVar[bool] = contextvars.ContextVar("filled_later",
                                                                    default=False)


@contextlib.contextmanager
def weights_filled_later() -> Iterator[None]:
    """Inside: :func:`build_gpt` allocates the weights without drawing their random values.

    For the model a migration builds and then overwrites: its random init is work thrown
    away inside every participant's pause (about half of a gpt-tiny build).  Safe because
    the migration refuses a plan that leaves any part of the new model unwritten
    (:func:`etcslurm.transfer.executor.check_fills`, and the own-copy path checks that it
    holds every piece); the bit-exact migration tests build their targets this way.

    Only the values are skipped: megatron's initialisers also mark each weight as
    tensor-parallel (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``),
    and the gradient norm counts a weight that lacks the mark on TP rank 0 only.  So the
    build keeps ``perform_initialization`` on, with init methods that draw nothing and the
    affine initialisers reduced to setting those marks (:func:`_marks_only`).
    """
    token = _FILLED_LATER.set(True)
    try:
        yield
    finally:
        _FILLED_LATER.reset(token)


def _draw_nothing(tensor: torch.Tensor) -> torch.Tensor:
    """An init method that leaves ``tensor`` as allocated."""
    return tensor


@contextlib.contextmanager
def _marks_only() -> Iterator[None]:
    """megatron's affine-weight initialisers, while inside, only set the tensor-parallel
    attributes they always set (same dim and stride as megatron passes), no values.

    Why patch and not set the attributes afterwards: the stride (2 for a SwiGLU
    ``linear_fc1``) and which weights are marked are megatron's decisions, made at the
    call sites, and differ between its versions; every module that imported the
    initialisers by name is patched, and restored on the way out.
    """
    from megatron.core.tensor_parallel import layers

    mark = layers.set_tensor_model_parallel_attributes

    def on_cpu(weight: torch.Tensor, output_size: int, input_size: int,
               per_partition_size: int, partition_dim: int, init_method: Any,
               stride: int = 1, return_master_weight: bool = False, *,
               skip_set_tensor_parallel_attributes: bool = False, **_: Any) -> None:
        if not skip_set_tensor_parallel_attributes:
            mark(weight, True, partition_dim, stride)

    def on_gpu(weight: torch.Tensor, init_method: Any, partition_dim: int, stride: int = 1,
               is_expert: bool = False) -> None:
        mark(weight, True, partition_dim, stride)

    originals = {"_initialize_affine_weight_cpu": (layers._initialize_affine_weight_cpu, on_cpu),
                 "_initialize_affine_weight_gpu": (layers._initialize_affine_weight_gpu, on_gpu)}
    patched: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron.core"):
            continue
        for attr, (original, stand_in) in originals.items():
            if getattr(module, attr, None) is original:
                setattr(module, attr, stand_in)
                patched.append((module, attr, original))
    try:
        yield
    finally:
        for module, attr, original in patched:
            setattr(module, attr, original)


def padded_vocab(spec: GPTSpec, tp: int | None = None) -> int:
    """The embedding's row count: a multiple of 1024 (the same for every TP dividing 8),
    under TP ``tp`` padded on to a multiple of 128·tp (``megatron_state.padded_vocab``)."""
    rows = spec.padded_vocab(VOCAB_TP_MULTIPLE)
    if tp is not None:
        rows = -(-rows // (128 * tp)) * (128 * tp)
    return rows


@dataclass(frozen=True)
class TrainHyper:
    """Optimizer and schedule settings (identical in every layout of a run)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 2
    decay_steps: int = 1000
    global_batch: int = 8
    micro_batch: int = 1

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Trainee:
    """One rank's model chunks, optimizer and scheduler, plus what they were built for.

    Unpacks as ``model, optimizer, scheduler = build_gpt(...)``.
    """

    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    spec: GPTSpec
    config: ParallelConfig
    optimizer_kind: str
    seed: int
    dtype: torch.dtype
    hyper: TrainHyper
    iteration: int = 0
    consumed_samples: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        watch(self.model)  # its last forward's graphs are cut at each group teardown

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer, self.scheduler))

    @property
    def distributed(self) -> bool:
        return self.optimizer_kind == "distributed"

    def modules(self) -> list[torch.nn.Module]:
        """The unwrapped model chunks (GPTModel): their sharded_state_dict keys are
        megatron's canonical keys (the DDP wrapper would prefix ``module.``)."""
        return [getattr(chunk, "module", chunk) for chunk in self.model]

    def inner_optimizers(self) -> list[Any]:
        """The megatron optimizers (a ChainedOptimizer holds one per param kind)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))


#: spec dtype names → torch dtypes
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(spec: GPTSpec, dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The params dtype: ``dtype`` if given (torch dtype or name), else the spec's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype or "", dtype) or spec.dtype
    if name not in TORCH_DTYPES:
        raise UsageError(f"unsupported dtype {name!r}; use float32 or bfloat16")
    return TORCH_DTYPES[name]


def transformer_config(spec: GPTSpec, config: ParallelConfig, dtype: torch.dtype,
                       state_only: bool = False) -> Any:
    """megatron-core's TransformerConfig for ``spec``: GELU/SwiGLU, LayerNorm/RMSNorm,
    MHA/GQA, biases as the spec says; deterministic (dropout 0), CPU initialisation
    (``state_only``: a model never trained, see :func:`build_gpt`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        num_query_groups=spec.groups,
        ffn_hidden_size=spec.ffn,
        normalization=spec.norm,
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        # the local layer spec's attention refuses context parallelism (only Transformer
        # Engine's has it), and no param depends on it: the model is built without, and
        # parallel_state's DP x CP groups still shard DDP and the distributed optimizer
        context_parallel_size=1,
        virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
        # the interleaved schedule as Megatron-LM configures it (overlapped, unbatched
        # P2P): its batched exchange posts two sends and two receives between the same two
        # ranks when pp = 2, which the backends match in posting order, so activations and
        # gradients of the same shape land in each other's buffers (Megatron-LM refuses
        # that combination; megatron-core's defaults allow it)
        overlap_p2p_comm=config.vpp > 1,
        batch_p2p_comm=config.vpp == 1,
        num_layers_in_first_pipeline_stage=uneven(spec, config.pp)[0],
        num_layers_in_last_pipeline_stage=uneven(spec, config.pp)[1],
        use_cpu_initialization=True,
        perform_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gated_linear_unit=spec.gated,
        activation_func=F.silu if spec.activation == "silu" else F.gelu,
        add_bias_linear=spec.bias,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        init_method_std=0.02,
        **_init_methods(),
        # MoE with TP > 1: megatron requires it to train (moe_settings); dense models and
        # a model that only holds state (where the local norms without Apex refuse it) do
        # without: it changes no tensor's shape or place
        sequence_parallel=spec.moe and config.tp > 1 and not state_only,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **moe_settings(spec, config),
    )


def _init_methods() -> dict[str, Any]:
    """Init methods that draw nothing inside :func:`weights_filled_later`, else
    megatron's defaults (from ``init_method_std``)."""
    if not _FILLED_LATER.get():
        return {}
    return dict(init_method=_draw_nothing, output_layer_init_method=_draw_nothing,
                embedding_init_method=_draw_nothing)


def moe_layout_problem(spec: GPTSpec, config: ParallelConfig) -> str | None:
    """Why ``spec`` cannot be trained in ``config`` with this megatron-core install, or
    ``None``.  A MoE model with TP > 1 trains only with sequence parallelism (megatron
    raises otherwise), and the local spec's norms without Apex (``WrappedTorchNorm``)
    refuse sequence parallelism: so on such an install (any CPU machine) MoE layouts must
    keep TP at 1.  Planning (``etcslurm plan``) is not affected."""
    if not spec.moe or config.tp == 1:
        return None
    import warnings

    with warnings.catch_warnings():  # megatron warns at import that Apex is missing
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt import gpt_layer_specs

    if getattr(gpt_layer_specs, "HAVE_APEX", False):
        return None
    return (f"{config}: a mixture-of-experts model with tp={config.tp} needs sequence "
            "parallelism, which megatron-core's local layer spec supports only with Apex "
            "norms (not installed here); use a layout with tp1")


def layer_spec(spec: GPTSpec) -> Any:
    """megatron-core's local (no Transformer Engine) layer spec for ``spec``: the MLP is a
    ``MoELayer`` of ``SequentialMLP`` experts for a MoE model."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        normalization=spec.norm, num_experts=spec.experts or None, moe_grouped_gemm=False
    )


#: the load-balancing loss weight of a MoE model (megatron's ``moe_aux_loss_coeff``)
MOE_AUX_LOSS_COEFF = 1e-2


def moe_settings(spec: GPTSpec, config: ParallelConfig) -> dict[str, Any]:
    """TransformerConfig fields of a mixture-of-experts model (none for a dense one).

    Why these: the all-gather token dispatcher and one ``SequentialMLP`` per layer
    (``moe_grouped_gemm=False``) are the MoE path megatron-core runs without Transformer
    Engine, so on CPU/gloo too; expert tensor parallelism is the layout's ``etp`` (TP unless
    the layout says otherwise);
    with TP > 1 megatron trains MoE layers only with sequence parallelism (it raises
    otherwise), which changes no tensor's shape or place.
    """
    if not spec.moe:
        return {}
    return dict(
        num_moe_experts=spec.experts,
        moe_router_topk=spec.topk,
        moe_ffn_hidden_size=spec.expert_ffn,
        expert_model_parallel_size=config.ep,
        expert_tensor_parallel_size=config.expert_tp,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=MOE_AUX_LOSS_COEFF,
    )


def build_gpt(
    spec: GPTSpec,
    config: ParallelConfig,
    optimizer: str = "adam",
    seed: int = 1234,
    dtype: torch.dtype | str | None = None,
    hyper: TrainHyper | None = None,
    state_only: bool = False,
) -> Trainee:
    """Model chunks (DDP-wrapped), megatron optimizer and LR scheduler for this rank.

    ``state_only``: the model holds and exchanges state but is never trained -- the one
    way to build a context-parallel layout here (the local layer spec's attention has no
    CP; its state is megatron's all the same, see :func:`transformer_config`).

    ``parallel_state`` must already be initialised for ``config``
    (:func:`etcslurm.megatron.parallel.init_parallel`).  Same ``seed`` → same global
    weights in every layout.  ``dtype`` (None: the spec's ``dtype``): the params dtype;
    with bf16 the whole model is cast to bf16 (norms included, as Megatron-LM's
    ``Float16Module`` does) and the optimizer keeps fp32 main params.
    """
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    from etcslurm.megatron_state import check_model

    dtype = torch_dtype(spec, dtype)
    check_model(spec, config)
    cpu_shim.install_if_needed()
    hyper = hyper or TrainHyper()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if (
        parallel_state.get_tensor_model_parallel_world_size() != config.tp
        or parallel_state.get_pipeline_model_parallel_world_size() != config.pp
        or parallel_state.get_expert_model_parallel_world_size() != config.ep
        or parallel_state.get_expert_tensor_parallel_world_size() != config.expert_tp
        or parallel_state.get_context_parallel_world_size() != config.cp
        or (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) != config.vpp
    ):
        raise UsageError(f"parallel_state is not initialised for {config}")
    problem = moe_layout_problem(spec, config)
    if problem and not state_only:  # megatron refuses to train it, not to hold its state
        raise UsageError(problem)
    if config.cp > 1 and not state_only:
        raise UsageError(
            f"{config}: context parallelism trains only with Transformer Engine's attention; "
            "etcslurm's model uses megatron-core's local layer spec, whose attention has none "
            "(a CP layout's state is planned and migrated all the same: etcslurm plan)"
        )
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    tcfg = transformer_config(spec, config, dtype, state_only)
    chunks = []
    # an interleaved pipeline: one GPTModel per virtual stage, in chunk order (as
    # Megatron-LM's get_model builds them); megatron needs vp_stage only when vpp > 1
    for v in range(config.vpp):
        vp = v if config.vpp > 1 else None
        with _marks_only() if _FILLED_LATER.get() else contextlib.nullcontext():
            gpt = GPTModel(
                config=tcfg,
                transformer_layer_spec=layer_spec(spec),
                vocab_size=padded_vocab(spec, config.tp),
                max_sequence_length=spec.seq,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp is None,
                                                                   vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp is None,
                                                                   vp_stage=vp),
                share_embeddings_and_output_weights=spec.tied_embeddings,
                position_embedding_type=("rope" if spec.position == "rope"
                                         else "learned_absolute"),
                rotary_base=spec.rope_base,
                vp_stage=vp,
            )
        if dtype != torch.float32:
            # torch norms are created fp32 whatever params_dtype says; Megatron-LM casts
            # the whole module (Float16Module), so one DDP buffer holds every param
            gpt = gpt.to(dtype)
        chunks.append(gpt.to(cpu_shim.device()))
    t_gpt = time.perf_counter()
    trainee = wrap_gpt(chunks if len(chunks) > 1 else chunks[0], tcfg, spec, config,
                       optimizer, seed, dtype, hyper)
    trainee.timings["build_model_s"] = t_gpt - t0 + trainee.timings.pop("wrap_model_s")
    return trainee


def wrap_gpt(
    gpt: torch.nn.Module | list[torch.nn.Module],
    tcfg: Any,
    spec: GPTSpec,
    config: ParallelConfig,
    optimizer: str,
    seed: int,
    dtype: torch.dtype,
    hyper: TrainHyper,
    init_state: bool = True,
) -> Trainee:
    """DDP wrapper, megatron optimizer (state initialised unless ``init_state`` is false:
    the caller hands it a state) and scheduler around a built ``GPTModel`` (``tcfg``: its
    TransformerConfig), in the current ``parallel_state``.

    Why a function of its own: a data-parallel-only resize keeps the ``GPTModel`` (no
    parameter changes place) and only needs these rebuilt for the new data-parallel
    groups (:mod:`etcslurm.megatron.regroup`); :func:`build_gpt` calls it after building.
    ``gpt``: one model, or an interleaved pipeline's chunks (only the first is bucketed,
    as Megatron-LM's ``get_model`` wraps them).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t0 = time.perf_counter()
    distributed = optimizer == "distributed"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed,
        check_for_nan_in_grad=False,
    )
    chunks = gpt if isinstance(gpt, list) else [gpt]
    model = [DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=v > 0)
             for v, chunk in enumerate(chunks)]
    # as megatron-LM's training loop does: without these the schedule never reduces
    # gradients over DP nor the tied embedding/output weights between first and last stage
    from megatron.core.distributed import finalize_model_grads

    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.no_sync_func = ([m.no_sync for m in model] if len(model) > 1
                         else model[0].no_sync)
    t_model = time.perf_counter()
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=hyper.lr,
        min_lr=hyper.min_lr,
        weight_decay=hyper.weight_decay,
        adam_beta1=hyper.adam_beta1,
        adam_beta2=hyper.adam_beta2,
        adam_eps=hyper.adam_eps,
        clip_grad=hyper.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
    )
    # parallel.init_model_parallel creates megatron's extra gloo groups only on NCCL
    gloo_groups = torch.distributed.get_backend() != "gloo"
    opt = get_megatron_optimizer(ocfg, model, use_gloo_process_groups=gloo_groups)
    scheduler = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=hyper.lr,
        min_lr=hyper.min_lr,
        lr_warmup_steps=hyper.warmup_steps * hyper.global_batch,
        lr_decay_steps=hyper.decay_steps * hyper.global_batch,
        lr_decay_style="cosine",
        start_wd=hyper.weight_decay,
        end_wd=hyper.weight_decay,
        wd_incr_steps=hyper.decay_steps * hyper.global_batch,
        wd_incr_style="constant",
    )
    trainee = Trainee(model, opt, scheduler, spec, config, optimizer, seed, dtype, hyper)
    if init_state:
        init_optimizer_state(trainee)
    t_end = time.perf_counter()
    trainee.timings.update(wrap_model_s=t_model - t0, build_optimizer_s=t_end - t_model)
    return trainee
