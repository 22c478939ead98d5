"""Plans for a GPT model moving between layouts, from its analytic state: what
``etcslurm plan``, the benchmarks and the public :func:`plan_migration` compute.

The devices are named as the planner names them everywhere: old devices ``"0".."N-1"``
(their old global rank) on nodes ``n{rank // gpus_per_node}``, joiners ``join:k`` filling
new nodes ``j{k // gpus_per_node}``.
"""

from __future__ import annotations

from collections.abc import Iterable

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.plan import MigrationPlan, PlanInputs, plan
from etcslurm.errors import UsageError
from etcslurm.megatron_state.expand import expand
from etcslurm.megatron_state.params import DEFAULT_VOCAB_PAD_TP

DEFAULT_STAGING_BYTES = 512 * 2**20


def gpt_inputs(
    spec: GPTSpec, old: ParallelConfig, new: ParallelConfig, leaving: Iterable = (),
    joiners: int = 0, gpus_per_node: int = 8, optimizer: str = "adam",
    staging_bytes: int = DEFAULT_STAGING_BYTES, params_dtype: str | None = None,
    vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
) -> PlanInputs:
    """:class:`PlanInputs` for ``spec`` moving from layout ``old`` to ``new`` when the
    old ranks ``leaving`` leave and ``joiners`` devices join."""
    a = expand(spec, old, optimizer, params_dtype, vocab_pad_tp=vocab_pad_tp)
    b = expand(spec, new, optimizer, params_dtype, vocab_pad_tp=vocab_pad_tp)
    n_old = old.world_size
    for d in leaving:
        if not 0 <= int(d) < n_old:
            raise UsageError(f"leaving device {d} is out of range 0-{n_old - 1}")
    nodes = {str(r): f"n{r // gpus_per_node}" for r in range(n_old)}
    join_ids = [f"join:{k}" for k in range(joiners)]
    nodes.update({j: f"j{k // gpus_per_node}" for k, j in enumerate(join_ids)})
    return PlanInputs(
        old_blocks=[list(x) for x in a.blocks],
        old_class_blocks=[list(x) for x in a.class_blocks],
        old_device_class={str(r): a.rank_class[r] for r in range(n_old)},
        new_blocks=[list(x) for x in b.blocks],
        new_class_blocks=[list(x) for x in b.class_blocks],
        new_rank_class=list(b.rank_class),
        nodes=nodes,
        leaving=sorted({str(int(d)) for d in leaving}, key=int),
        joiners=join_ids,
        staging_bytes=staging_bytes,
        tp=new.tp,
    )


def plan_for_gpt(spec: GPTSpec, old: ParallelConfig, new: ParallelConfig,
                 leaving: Iterable = (), joiners: int = 0, gpus_per_node: int = 8,
                 optimizer: str = "adam", staging_bytes: int = DEFAULT_STAGING_BYTES,
                 params_dtype: str | None = None,
                 vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP) -> MigrationPlan:
    """:func:`gpt_inputs` then :func:`~etcslurm.core.plan.plan`."""
    return plan(gpt_inputs(spec, old, new, leaving, joiners, gpus_per_node, optimizer,
                           staging_bytes, params_dtype, vocab_pad_tp=vocab_pad_tp))


def plan_migration(model: GPTSpec | str, old: ParallelConfig | str,
                   new: ParallelConfig | str, *, leaving: Iterable[int | str] = (),
                   joiners: int = 0, optimizer: str = "adam", gpus_per_node: int = 8,
                   staging_bytes: int = DEFAULT_STAGING_BYTES,
                   params_dtype: str | None = None) -> MigrationPlan:
    """The plan that moves ``model``'s training state from layout ``old`` to ``new``:
    which device plays which new rank, and every message, local copy and missing piece.

    Pure (no torch, no cluster): the holdings are the ones megatron-core gives each rank
    of ``old`` (params and ``optimizer`` state: ``"adam"`` or ``"distributed"``), the needs
    those of ``new``.  ``model``: a :class:`~etcslurm.core.models.GPTSpec` or its text
    form (``"gpt-70b"``); layouts as ``ParallelConfig`` or text (``"tp8pp8dp128"``);
    ``leaving``: old global ranks; ``joiners``: how many new devices join.  ``stats`` has
    the bytes moved against the lower bound and a naive assignment, messages and rounds.
    For holdings described from a live model (any model), build the inputs with
    :func:`etcslurm.core.descriptions.inputs_from_descriptions` and call
    :func:`etcslurm.core.plan.plan`.

    >>> p = plan_migration("gpt-tiny", "tp2pp1dp2", "tp2pp1dp1", leaving=[2, 3])
    >>> p.stats["moved_bytes"], p.assignment
    (0, ['0', '1'])
    """
    spec = model if isinstance(model, GPTSpec) else GPTSpec.parse(model)
    old_cfg = old if isinstance(old, ParallelConfig) else ParallelConfig.parse(old)
    new_cfg = new if isinstance(new, ParallelConfig) else ParallelConfig.parse(new)
    old_cfg.validate(spec)
    new_cfg.validate(spec)
    if joiners < 0:
        raise UsageError(f"joiners must be >= 0, got {joiners}")
    return plan_for_gpt(spec, old_cfg, new_cfg, [str(int(d)) for d in leaving], joiners,
                        gpus_per_node, optimizer, staging_bytes, params_dtype)
