"""megatron-core's own weight resharding ("refit") as an external oracle and a peer to time.

megatron-core 0.16.1 ships ``megatron.core.resharding.refit.swap_model_weights(src, dst,
backend)``: it copies the *weights* (no optimizer state) of a source model into a target
model of another TP/PP layout, both built inside ONE world, each with its own process
groups (``pg_collection``).  Adding or removing ranks is outside its scope, so it applies
to a benchmark case only when the old and new layouts have the same world size and nobody
leaves or joins (:func:`out_of_scope`).

How the benchmark uses it (:func:`run_refit`, phase 3 of ``bench/migrate_worker.py``, in
the new world, after the P2P model is verified):

1. the **source** is a bare ``GPTModel`` (no DDP, no optimizer) of the OLD layout, built in
   the new world with a ``ProcessGroupCollection`` from a ``HyperCommGrid`` in megatron's
   default rank order ``tp-cp-ep-dp-pp`` (= ``core.layout.ParallelConfig``), as Megatron-LM's
   own ``tests/unit_tests/resharding/test_model_swap.py`` does.  Its weights are then
   overwritten with the exact pre-migration weights (the benchmark's raw dump, located
   through the source's own ``sharded_state_dict()`` metadata), so it holds the bytes the
   old model held;
2. the **target** is a bare ``GPTModel`` of the NEW layout on megatron's global
   ``parallel_state`` (the new world's groups, the same as the P2P model's), every weight
   filled with NaN first, so an element refit does not write cannot pass;
3. ``swap_model_weights(src, target, GlooCopyService)`` runs ``repeat`` times, each timed
   between barriers as the slowest rank's: the first call plans and copies (what a user
   pays per reshard: ``refit_seconds``), later calls reuse the cached plan
   (``refit_warm_seconds``).  The copy service (it creates a gloo group) is set up before.
4. the target's weights are fingerprinted per :class:`etcslurm.core.state.Piece` (the keys
   and boxes of its ``sharded_state_dict()``), so the caller compares them with the P2P
   model's pieces bit for bit.

Known refit limitation checked up front (else its planner raises on global rank 0 only and
the other ranks wait in a broadcast until the timeout): with tied embeddings a PP 1 source
has no ``output_layer.weight`` but a PP > 1 target's last stage needs one.

Mixture of experts: refit maps experts across EP sizes by its Transformer Engine names;
:func:`name_experts_as_grouped` presents the local spec's experts under them (checked:
EP 4 → 2, EP 2 → 1 and EP 1 → 4 give the P2P model's expert weights bit for bit).

CPU: no patch to ``cpu_shim`` is needed; the copy service's CUDA stream calls go to the
shim's null streams.
"""

from __future__ import annotations

import hashlib
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.state import Piece


def fingerprint(t: torch.Tensor) -> str:
    """A BLAKE2b digest of a tensor's bytes (the same as ``migrate_worker._fingerprint``)."""
    return hashlib.blake2b(t.detach().contiguous().view(-1).view(torch.uint8).numpy().data,
                           digest_size=16).hexdigest()


def out_of_scope(spec: GPTSpec, old: ParallelConfig, new: ParallelConfig, leave: list[int],
                 join: int, have_dump: bool = True) -> str | None:
    """Why refit cannot run on this case (one line), or None when it can."""
    if old.world_size != new.world_size:
        return (f"refit reshards inside one world; {old} has {old.world_size} ranks, "
                f"{new} has {new.world_size}")
    if leave or join:
        return "refit reshards inside one world; ranks leave or join here"
    if spec.tied_embeddings and old.pp == 1 and new.pp > 1:
        return ("refit cannot reshard tied embeddings from PP 1 to PP > 1: the source has no "
                "output_layer.weight for the target's last stage")
    if old.etp or new.etp:
        return ("the oracle builds refit's process groups on one grid, whose expert TP is "
                "the dense TP; a layout with etp apart from tp needs megatron's second "
                "(expert) grid, which it does not build")
    if not have_dump:
        return "the exact pre-migration weights (the global dump, verify_global) are needed"
    return None


def rank_enum(shape: list[int], names: list[str], dims: list[str],
              offset: int = 0) -> list[list[int]]:
    """``HyperCommGrid._gen_rank_enum`` by a numpy transpose instead of ``einops``
    (megatron-core's grid needs einops, which megatron-core does not require): the groups
    over ``dims`` (ordered as ``HyperCommGrid._order_dims`` orders them) of a grid whose
    first name varies fastest."""
    order = names[::-1]
    rest = [d for d in order if d not in dims]
    sizes = dict(zip(names, shape, strict=True))
    ranks = np.arange(offset, offset + int(np.prod(shape))).reshape([sizes[d] for d in order])
    ranks = ranks.transpose([order.index(d) for d in rest + list(dims)])
    return ranks.reshape(-1, int(np.prod([sizes[d] for d in dims]))).tolist()


def _pg_collection(layout: ParallelConfig) -> Any:
    """Process groups of ``layout`` over the current default world (megatron's default
    rank order tp-cp-ep-dp-pp), as Megatron-LM's refit test builds them.  Every rank must
    call this in the same order (it creates groups)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    class Grid(HyperCommGrid):
        """HyperCommGrid without einops (not installed here): :func:`rank_enum`."""

        def _gen_rank_enum(self, dims: list[str]) -> list[list[int]]:
            return rank_enum(self.shape, self.dim_names, dims, self.rank_offset)

    # expert parallelism splits the data-parallel ranks: the grid's "dp" is the expert
    # data-parallel size (dp / ep) and the dense DP group is ep x dp, which is megatron's
    # own order (rank = tp + TP * (ep + EP * (edp + EDP * pp))); with ep 1 both are DP
    grid = Grid([layout.tp, 1, layout.ep, layout.edp, layout.pp], ["tp", "cp", "ep", "dp", "pp"])
    pgs: dict[str, Any] = {
        "tp": grid.create_pg("tp"),
        "cp": grid.create_pg("cp"),
        "ep": grid.create_pg("ep"),
        "dp": grid.create_pg(["ep", "dp"]),
        "pp": grid.create_pg("pp"),
        "tp_cp": grid.create_pg(["tp", "cp"]),
        "mp": grid.create_pg(["tp", "cp", "ep", "pp"]),
        "tp_ep": grid.create_pg(["tp", "ep"]),
        "tp_ep_pp": grid.create_pg(["tp", "ep", "pp"]),
        "dp_cp": grid.create_pg(["cp", "ep", "dp"]),
        "tp_dp_cp": grid.create_pg(["tp", "cp", "ep", "dp"]),
        "expt_dp": grid.create_pg("dp"),
    }
    # embedding groups: one per PP group, every rank creating all of them in the same
    # order as torch requires (megatron's test calls dist.new_group with its own PP
    # group's ranks only, so ranks of different PP groups would create different groups)
    pp_enum = grid.get_rank_enum("pp")
    pgs["embd"], _ = dist.new_subgroups_by_enumeration(
        [mpu.default_embedding_ranks(r) for r in pp_enum])
    pgs["pos_embd"], _ = dist.new_subgroups_by_enumeration(
        [mpu.default_position_embedding_ranks(r) for r in pp_enum])
    return ProcessGroupCollection(expt_tp=pgs["tp"], **pgs)


def _build_module(spec: GPTSpec, layout: ParallelConfig, dtype: torch.dtype,
                  pg_collection: Any = None) -> torch.nn.Module:
    """A bare GPTModel (no DDP, no optimizer) of ``layout``, built as
    ``etcslurm.megatron.model.build_gpt`` builds its model.  ``pg_collection`` None:
    megatron's global ``parallel_state`` (which must be ``layout``'s)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.utils import get_pg_rank

    from etcslurm.megatron import cpu_shim
    from etcslurm.megatron.model import layer_spec, padded_vocab, transformer_config

    if pg_collection is None:
        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()
    else:
        stage = get_pg_rank(pg_collection.pp)
        first, last = stage == 0, stage == layout.pp - 1
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    gpt = GPTModel(
        config=transformer_config(spec, layout, dtype),
        transformer_layer_spec=layer_spec(spec),
        vocab_size=padded_vocab(spec, layout.tp),
        max_sequence_length=spec.seq,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope" if spec.position == "rope" else "learned_absolute",
        rotary_base=spec.rope_base,
        **kwargs,
    )
    if dtype != torch.float32:
        gpt = gpt.to(dtype)
    return gpt.to(cpu_shim.device())


#: a ``SequentialMLP`` expert weight's name, ``...experts.local_experts.<K>.linear_fc1.weight``
_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def name_experts_as_grouped(module: torch.nn.Module) -> None:
    """Let refit match a MoE model's experts across EP sizes.

    Why: refit (megatron-core 0.16.1, ``resharding.utils.assign_ep_resolved_name_inplace``)
    turns a rank's LOCAL expert index into the GLOBAL one only for Transformer Engine's
    ``TEGroupedMLP`` names (``...experts.linear_fc1.weight<K>``); the local spec's
    ``SequentialMLP`` (the MoE path without Transformer Engine, so the one on CPU) names
    the same tensors ``...experts.local_experts.<K>.linear_fc1.weight``, which refit then
    matches by local index -- wrong as soon as EP changes.  This presents them under the
    grouped names (``named_parameters`` of this instance only), so refit's own EP mapping
    applies; the tensors, their TP attributes and the module tree are untouched.
    """
    original = module.named_parameters

    def named_parameters(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, param in original(*args, **kwargs):
            yield _LOCAL_EXPERT.sub(r"\2.weight\1", name), param

    module.named_parameters = named_parameters  # type: ignore[method-assign]


def _weight_views(module: torch.nn.Module) -> list[tuple[Piece, torch.Tensor]]:
    """Every weight piece of ``module`` with a view of its live storage (the keys and
    boxes of its ``sharded_state_dict()``, factories applied: ``sharded_meta``'s reading)."""
    from etcslurm.megatron.sharded_meta import _box_view, dtype_name, param_metas

    metas = param_metas(SimpleNamespace(modules=lambda: [module]))  # type: ignore[arg-type]
    seen: dict[Piece, torch.Tensor] = {}
    for meta in metas.values():
        flat = meta.param.data.view(-1)
        for key, box, off in meta.parts:
            piece = Piece(key, box, dtype_name(meta.param.dtype))
            seen.setdefault(piece, _box_view(flat, box, off))
    return sorted(seen.items(), key=lambda pv: pv[0])


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _all_true(flag: bool) -> bool:
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


def run_refit(spec: GPTSpec, old: ParallelConfig, new: ParallelConfig, dump_dir: Path,
              dtype: torch.dtype, repeat: int = 1,
              fp: Callable[[torch.Tensor], str] = fingerprint) -> dict[str, Any]:
    """Reshard the pre-migration weights ``old`` → ``new`` with megatron-core's refit.

    Collective over the current default world, which must be the new layout's (megatron's
    ``parallel_state`` initialised for ``new``) and as large as ``old``.  Returns
    ``refit_seconds`` (first call: plan + copy, slowest rank), ``refit_warm_seconds``
    (median of the later calls, cached plan; None with ``repeat`` 1),
    ``refit_setup_seconds`` (the gloo copy service's group), ``refit_source_seconds``
    (building and loading the source model, untimed in comparisons) and ``refit_prints``
    (Piece → fingerprint of every target weight piece on this rank).
    """
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService
    from megatron.core.resharding.refit import clear_service_cache, swap_model_weights

    from etcslurm.bench.rawdump import GlobalState

    if dist.get_world_size() != old.world_size:
        raise ValueError(f"the world has {dist.get_world_size()} ranks, {old} needs "
                         f"{old.world_size}")
    t0 = time.perf_counter()
    # megatron's model construction draws from the default generator: leave the
    # benchmark's random state as it was
    with torch.random.fork_rng(devices=[]):
        src = _build_module(spec, old, dtype, _pg_collection(old))
        dst = _build_module(spec, new, dtype)
    if spec.moe:
        name_experts_as_grouped(src)
        name_experts_as_grouped(dst)
    reference = GlobalState(dump_dir)
    with torch.no_grad():
        for piece, view in _weight_views(src):
            view.copy_(reference.expected(piece))
        for p in dst.parameters():
            p.data.fill_(float("nan"))
    source_s = _max(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    service = GlooCopyService()
    setup_s = _max(time.perf_counter() - t0)
    calls = []
    try:
        for _ in range(max(1, repeat)):
            dist.barrier()
            t0 = time.perf_counter()
            swap_model_weights([src], [dst], service)
            calls.append(_max(time.perf_counter() - t0))
    finally:
        clear_service_cache()
    prints = {piece: fp(view) for piece, view in _weight_views(dst)}
    return {
        "refit_seconds": calls[0],
        "refit_warm_seconds": statistics.median(calls[1:]) if len(calls) > 1 else None,
        "refit_all": calls,
        "refit_setup_seconds": setup_s,
        "refit_source_seconds": source_s,
        "refit_prints": prints,
    }


def oracle(spec: GPTSpec, old: ParallelConfig, new: ParallelConfig, leave: list[int],
           join: int, dump_dir: Path | None, dtype: torch.dtype, repeat: int,
           p2p_prints: dict[Piece, str],
           fp: Callable[[torch.Tensor], str] = fingerprint) -> dict[str, Any]:
    """The benchmark's report fields: ``refit_seconds`` etc. and ``refit_equals_p2p`` (the
    target's weights equal the P2P model's weights bit for bit on every rank), or both
    None with ``refit_skipped`` saying why (out of refit's scope, or what failed)."""
    have_dump = dump_dir is not None and dump_dir.is_dir()
    reason = out_of_scope(spec, old, new, leave, join, have_dump)
    if reason is not None:
        return {"refit_seconds": None, "refit_equals_p2p": None, "refit_skipped": reason}
    try:
        result = run_refit(spec, old, new, dump_dir, dtype, repeat, fp)  # type: ignore[arg-type]
    except Exception as exc:  # reported, not raised: the oracle must not sink the benchmark
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return {"refit_seconds": None, "refit_equals_p2p": None,
                "refit_skipped": f"{type(exc).__name__}: {exc} "
                                 f"(at {Path(where.filename).name}:{where.lineno} {where.name})"}
    prints = result.pop("refit_prints")
    bad = [p for p, f in prints.items() if p2p_prints.get(p) != f]
    result["refit_equals_p2p"] = _all_true(not bad and bool(prints))
    result["refit_pieces"] = len(prints)
    result["mismatch_refit_vs_p2p"] = [p.to_json() for p in bad[:5]]
    return result
