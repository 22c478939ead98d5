"""The ``etcslurm bench migrate`` driver: validate, launch the workers, summarise.

The driver itself imports no megatron: it checks the request (one-line errors), starts
``old devices + joiners`` local processes (gloo) running
:func:`etcslurm.bench.migrate_worker.migrate`, and turns their JSON results into the
report fields the issue lists (``p2p_seconds``, ``checkpoint_seconds``, ``speedup``, ...).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.errors import UsageError

#: megatron adapter pads the vocabulary for TP up to 8; the bench pads the spec the same
#: way so every layout (TP 1, 2, 4, 8) has the same global embedding shape
VOCAB_TP_MULTIPLE = 8
#: losses after a TP change differ from a never-migrated run by the reduction order only
REFERENCE_TOLERANCE = 1e-4


@dataclass
class MigrateRequest:
    """What to benchmark (the CLI's arguments, validated)."""

    model: str = "gpt-125m"
    source: str = "tp2pp2dp2"
    target: str = "tp1pp2dp3"
    leave: list[int] = field(default_factory=list)
    join: int = 0
    optimizer: str = "adam"
    repeat: int = 3
    ckpt_dir: str | None = None
    steps_before: int = 2
    steps_after: int = 2
    seq: int | None = None
    global_batch: int | None = None
    staging_mb: int = 256
    reference: bool = False
    verify_global: bool = True
    measure_bandwidth: bool = True
    #: False: P2P only; the comparison model is filled from the pre-migration dump
    checkpoint: bool = True
    #: False: the baseline writes in the calling process (no persistent writer start-up);
    #: for small tests only -- benchmarks keep megatron's fastest (asynchronous) path
    async_checkpoint: bool = True
    timeout: float = 600.0
    seed: int = 1234
    #: slices of at least this many bytes travel as segments of their own (None: the
    #: executor's DIRECT_MIN_BYTES; tests lower it so a tiny model's tensors do too)
    direct_min_bytes: int | None = None
    #: params dtype (``bf16``/``fp32``); None: the model's own
    dtype: str | None = None
    #: also time megatron-core's refit (weights only) and check it against P2P where it
    #: applies (same world size, nobody leaves or joins; bench/refit.py)
    refit: bool = True
    #: plan from live descriptions exchanged between the participants, as the runtime
    #: does for a model etcslurm did not build (else the analytic plan of its own GPT)
    live_plan: bool = False
    #: move the model's weights alone (no optimizer state), as megatron-core's refit does:
    #: timed against refit on the same transition and bytes (one world only)
    weights_only: bool = False

    def spec(self) -> GPTSpec:
        spec = GPTSpec.parse(self.model)
        changes: dict[str, Any] = {"vocab": spec.padded_vocab(VOCAB_TP_MULTIPLE)}
        if self.dtype is not None:
            changes["dtype"] = self.dtype
        if self.seq is not None:
            changes["seq"] = self.seq
        return replace(spec, **changes)

    def validate(self) -> tuple[GPTSpec, ParallelConfig, ParallelConfig]:
        spec = self.spec()
        old, new = ParallelConfig.parse(self.source), ParallelConfig.parse(self.target)
        old.validate(spec)
        new.validate(spec)
        from etcslurm.megatron.model import moe_layout_problem

        for cfg in (old, new):
            if VOCAB_TP_MULTIPLE % cfg.tp:
                raise UsageError(f"{cfg}: tp must divide {VOCAB_TP_MULTIPLE} (1, 2, 4 or 8)")
            problem = moe_layout_problem(spec, cfg)
            if problem:
                raise UsageError(problem)
        if self.optimizer not in ("adam", "distributed"):
            raise UsageError(f"unknown optimizer {self.optimizer!r}; use adam or distributed")
        bad = [r for r in self.leave if not 0 <= r < old.world_size]
        if bad:
            raise UsageError(f"--leave {bad[0]}: old ranks are 0-{old.world_size - 1}")
        if self.join < 0:
            raise UsageError("--join must be 0 or more")
        available = old.world_size - len(set(self.leave)) + self.join
        if new.world_size > available:
            raise UsageError(
                f"{new} needs {new.world_size} devices; {old} has {old.world_size}, "
                f"{len(set(self.leave))} leave and {self.join} join: {available} remain"
            )
        if self.weights_only and (self.leave or self.join or old.world_size != new.world_size):
            raise UsageError("--weights-only is timed against megatron-core's refit, which "
                             "reshards within one world: the same world size, nobody "
                             "leaving or joining")
        if self.repeat < 1 or self.steps_before < 0 or self.steps_after < 0:
            raise UsageError("--repeat must be at least 1 and step counts not negative")
        if self.steps_before < 1:
            raise UsageError("--steps-before must be at least 1: Adam's state (its step "
                             "count, its moments) exists only after a first step, and the "
                             "migration is checked on it")
        if self.staging_mb < 1:
            raise UsageError("--staging-mb must be at least 1")
        for layout in (old, new) if self.global_batch is not None else ():
            problem = layout.batch_problem(self.global_batch)
            if problem is not None:
                raise UsageError(f"--global-batch {self.global_batch}: {layout}: {problem}")
        return spec, old, new

    def case_config(self, work_dir: Path, ckpt_dir: Path) -> dict[str, Any]:
        """One case of a launch (:mod:`etcslurm.bench.migrate_worker`)."""
        spec, old, new = self.validate()
        staging = self.staging_mb << 20
        return {
            "spec": spec.to_json(),
            "from": str(old),
            "to": str(new),
            "leave": sorted(set(self.leave)),
            "join": self.join,
            "optimizer": self.optimizer,
            "seed": self.seed,
            "steps_before": self.steps_before,
            "steps_after": self.steps_after,
            "global_batch": self.global_batch or default_global_batch(old, new),
            # bounds a round's send + receive staging (the planner's message cap is half
            # of it, less alignment and checksum words: core.plan.message_cap)
            "staging_bytes": staging,
            "direct_min_bytes": self.direct_min_bytes,
            "reference": self.reference,
            "verify_global": self.verify_global,
            "measure_bandwidth": self.measure_bandwidth,
            "checkpoint": self.checkpoint,
            "refit": self.refit,
            "live_plan": self.live_plan,
            "weights_only": self.weights_only,
            "timeout": self.timeout,
            "work_dir": str(work_dir),
            "ckpt_dir": str(ckpt_dir),
        }

    @property
    def processes(self) -> int:
        return ParallelConfig.parse(self.source).world_size + self.join


def run(request: MigrateRequest, poll: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Launch the benchmark of one transition and return its summary (:func:`summarise`)."""
    return run_many([request], poll=poll)[0]


def run_many(requests: list[MigrateRequest],
             poll: Callable[[Any], None] | None = None) -> list[dict[str, Any]]:
    """Every request (each ``repeat`` times) in ONE launch of the same processes, one
    after another: a matrix pays the processes' start-up and the checkpoint writer's
    once.  Returns one summary per request, in order."""
    from etcslurm.bench.launch import launch

    if not requests:
        return []
    specs = [r.validate()[0] for r in requests]
    first = requests[0]
    nprocs = max(r.processes for r in requests)
    work = Path(tempfile.mkdtemp(prefix="etcslurm-bench-"))
    ckpt = Path(first.ckpt_dir) / f"bench-{work.name}" if first.ckpt_dir else work / "ckpt"
    owners: list[int] = []
    cases = []
    for i, request in enumerate(requests):
        for _ in range(request.repeat):
            name = f"case{len(cases)}"
            cases.append(request.case_config(work / name, ckpt / name))
            owners.append(i)
    config = {"cases": cases, "async_checkpoint": all(r.async_checkpoint for r in requests),
              "timeout": max(r.timeout for r in requests)}
    budget = sum(r.timeout * 4 * r.repeat for r in requests) + 300
    try:
        results = launch("etcslurm.bench.migrate_worker:migrate", nprocs, config,
                         timeout=budget, poll=poll)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if first.ckpt_dir:
            shutil.rmtree(ckpt, ignore_errors=True)
    by_case = [[proc["cases"][n] for proc in results] for n in range(len(cases))]
    return [summarise(request, spec, [by_case[n] for n, o in enumerate(owners) if o == i])
            for i, (request, spec) in enumerate(zip(requests, specs, strict=True))]


def _med(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarise(request: MigrateRequest, spec: GPTSpec,
              repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The report of one request: timings as medians over its repetitions, checks over
    all of them (``repeats``: per repetition, every process's result)."""
    runs = [[r for r in results if r.get("role") != "unused"] for results in repeats]
    if request.weights_only:
        return _summarise_weights(request, spec, runs)
    results = runs[-1]
    first = results[0]
    new = [r for r in results if r.get("role") == "new"]
    every_new = [r for rs in runs for r in rs if r.get("role") == "new"]
    stats = first["plan_stats"]
    plan_all = [rs[0]["plan_seconds"] for rs in runs]
    exchange_all = [rs[0]["exchange_seconds"] for rs in runs]
    restore_all = [max(r["restore_seconds"] for r in rs if r.get("role") == "new")
                   for rs in runs]
    p2p_all = [a + b + c for a, b, c in zip(plan_all, exchange_all, restore_all, strict=True)]
    save_all = [rs[0].get("checkpoint_save_seconds", 0.0) for rs in runs]
    load_all = [next(r for r in rs if r.get("role") == "new")["checkpoint_load_seconds"]
                for rs in runs]
    p2p, exchange = _med(p2p_all), _med(exchange_all)
    save, load = _med(save_all), _med(load_all)
    ckpt = save + load
    startup = [r["checkpoint_startup_seconds"] for rs in runs for r in rs
               if r.get("checkpoint_startup_seconds") is not None]
    transfers = [r["transfer"] for r in results if r.get("transfer")]
    peak = max(t["peak_staging_bytes"] for t in transfers)
    max_recv = max(t["bytes_received"] for t in transfers)
    paths = sorted({r["plan_path"] for rs in runs for r in rs})
    state_equal = all(r["p2p_equals_checkpoint"] and r.get("p2p_equals_pre_migration", True)
                      for r in every_new)
    signature_equal = all(not r["signature_differences"] for r in every_new)
    after_equal = all(r["after_steps_equal"] and not r["signature_differences_after"]
                      for r in every_new)
    out: dict[str, Any] = {
        "model": request.model,
        "dtype": spec.dtype,
        "params": spec.num_params(1),
        "from": request.source,
        "to": request.target,
        "leave": sorted(set(request.leave)),
        "join": request.join,
        "optimizer": request.optimizer,
        "processes": len(results),
        "roles": {r["device"]: r.get("role") for r in results},
        # the runtime's path for this change: nothing_moves | analytic | live
        "plan_path": paths[0] if len(paths) == 1 else paths,
        "on_world": bool(first.get("on_world")),
        # devices whose model was kept (re-wrapped for the new groups, not built anew)
        "kept": sorted(r["device"] for r in results if r.get("kept")),
        "assignment": {str(r["new_rank"]): r["device"] for r in new},
        "repeat": len(runs),
        "p2p_seconds": p2p,
        "p2p_plan_seconds": _med(plan_all),
        "p2p_exchange_seconds": exchange,
        "p2p_restore_seconds": _med(restore_all),
        "p2p_all": p2p_all,
        "p2p_exchange_all": exchange_all,
        "checkpoint_seconds": ckpt,
        "checkpoint_save_seconds": save,
        "checkpoint_load_seconds": load,
        "checkpoint_save_all": save_all,
        "checkpoint_load_all": load_all,
        # the writer's one-off start-up: paid by the first save of a launch
        "checkpoint_startup_seconds": max(startup) if startup else None,
        # the staging arena's one-off allocation (a long-lived process keeps it)
        "arena_setup_seconds": first.get("arena_setup_seconds"),
        "speedup": ckpt / p2p if p2p > 0 else float("inf"),
        "state_bytes": stats["state_bytes"],
        "moved_bytes": stats["moved_bytes"],
        "local_bytes": stats.get("local_bytes"),
        "lower_bound_moved_bytes": stats.get("lower_bound_moved_bytes"),
        "messages": stats.get("messages"),
        "rounds": stats.get("rounds"),
        "p2p_gbps": stats["moved_bytes"] / exchange / 1e9 if exchange > 0 else 0.0,
        "peak_staging_bytes": peak,
        "staging_cap_bytes": request.staging_mb << 20,
        "max_recv_bytes": max_recv,
        # right after the migration every tensor equals the checkpoint path's and the
        # pre-migration state, and so does everything else that shapes the next update;
        # after the steps, every tensor (gradients included) still equals
        "bit_exact": state_equal and signature_equal and after_equal,
        "state_equal": state_equal,
        "signature_equal": signature_equal,
        "after_steps_equal": after_equal,
        "after_steps": _after_steps(every_new),
        "steps_after": request.steps_after,
        "loss_match": all(r["losses_p2p"] == r["losses_checkpoint"] for r in every_new),
        "losses_p2p": new[0]["losses_p2p"],
        "losses_checkpoint": new[0]["losses_checkpoint"],
        "losses_before": first.get("losses_before", []),
    }
    # where the exchange time went (max over ranks, last repetition)
    out["exchange_breakdown"] = {
        k: max(t[k] for t in transfers)
        for k in ("pack_seconds", "checksum_seconds", "comm_seconds", "unpack_seconds",
                  "local_seconds")
    }
    out["segments"] = {k: sum(t.get(f"segments_{k}", 0) for t in transfers)
                       for k in ("in_place", "staged")}
    transport = [rs[0]["transport_seconds"] for rs in runs if rs[0].get("transport_seconds")]
    if transport:
        floor = statistics.median(transport)
        out["transport_seconds"] = floor
        # nothing on the wire (a DP shrink): only local copies, no transport to compare with
        out["exchange_vs_transport"] = (exchange / floor if floor > 0 and stats["moved_bytes"]
                                        else None)
    bw = first.get("pair_bandwidth")
    if bw:
        bound = max_recv / (bw["bytes"] / bw["seconds"])
        out["pair_gbps"] = bw["gbps"]
        out["bound_seconds"] = bound
        out["exchange_vs_bound"] = exchange / bound if bound > 0 else None
        if transport and bound > 0:
            out["transport_vs_bound"] = out["transport_seconds"] / bound
    if request.reference:
        ref = new[0].get("losses_reference", [])
        diff = max((abs(a - b) for a, b in zip(ref, new[0]["losses_p2p"], strict=False)),
                   default=0.0)
        out["losses_reference"] = ref
        out["reference_max_abs_diff"] = diff
        out["reference_match"] = diff <= REFERENCE_TOLERANCE
    # megatron-core's own weights-only resharding (bench/refit.py): timed on the same
    # case, its weights checked against the P2P model's; None out of its scope
    refit_s = [r.get("refit_seconds") for r in new]
    out["refit_seconds"] = refit_s[0] if refit_s and None not in refit_s else None
    out["refit_warm_seconds"] = new[0].get("refit_warm_seconds") if out["refit_seconds"] else None
    out["refit_equals_p2p"] = (all(r.get("refit_equals_p2p") for r in new)
                               if out["refit_seconds"] is not None else None)
    skipped = sorted({r["refit_skipped"] for r in new if r.get("refit_skipped")})
    if skipped:
        out["refit_skipped"] = "; ".join(skipped)
    refit_bad = [f"{r['device']}: {r['mismatch_refit_vs_p2p']}" for r in new
                 if r.get("mismatch_refit_vs_p2p")]
    if refit_bad:
        out["mismatch_refit_vs_p2p"] = refit_bad
    problems = [
        f"{r['device']}: {detail}" for r in every_new
        for detail in (r.get("mismatch_p2p_vs_checkpoint"),
                       r.get("mismatch_p2p_vs_pre_migration"),
                       r.get("signature_differences"), r.get("signature_differences_after"))
        if detail
    ]
    if problems:
        out["mismatches"] = problems
    return out


def _summarise_weights(request: MigrateRequest, spec: GPTSpec,
                       runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The report of a weights-only request: P2P (plan + exchange + commit) against
    megatron-core's refit (plan + copy, its first call) on the same weights."""
    every_new = [r for rs in runs for r in rs if r.get("role") == "new"]
    p2p_all = [rs[0]["plan_seconds"] + rs[0]["exchange_seconds"]
               + max(r["restore_seconds"] for r in rs if r.get("role") == "new")
               for rs in runs]
    refit_all = [next(r for r in rs if r.get("role") == "new").get("refit_seconds")
                 for rs in runs]
    first = runs[-1][0]
    p2p = _med(p2p_all)
    refit = _med([x for x in refit_all if x is not None]) if None not in refit_all else None
    out = {
        "model": request.model, "dtype": spec.dtype, "from": request.source,
        "to": request.target, "weights_only": True, "repeat": len(runs),
        "plan_path": first["plan_path"], "on_world": bool(first.get("on_world")),
        "p2p_seconds": p2p, "p2p_all": p2p_all,
        "p2p_plan_seconds": _med([rs[0]["plan_seconds"] for rs in runs]),
        "p2p_exchange_seconds": _med([rs[0]["exchange_seconds"] for rs in runs]),
        "refit_seconds": refit, "refit_all": refit_all,
        "refit_warm_seconds": every_new[-1].get("refit_warm_seconds"),
        "p2p_vs_refit": p2p / refit if refit else None,
        "moved_bytes": sum(r.get("moved_here", 0) for r in runs[-1]),
        "weight_bytes": sum(r.get("held_bytes", 0) for r in runs[-1]),
        "bit_exact": all(r.get("p2p_equals_pre_migration", True) for r in every_new),
        "refit_equals_p2p": (all(r.get("refit_equals_p2p") for r in every_new)
                             if refit is not None else None),
    }
    skipped = sorted({r["refit_skipped"] for r in every_new if r.get("refit_skipped")})
    if skipped:
        out["refit_skipped"] = "; ".join(skipped)
    return out


def _after_steps(new: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of tensor, over every new rank: P2P vs checkpoint after the steps."""
    out: dict[str, dict[str, Any]] = {}
    for r in new:
        for kind, row in r["after_steps"].items():
            total = out.setdefault(kind, {})
            for key, value in row.items():
                if key == "max_abs_diff":
                    total[key] = max(total.get(key, 0.0), value)
                else:
                    total[key] = total.get(key, 0) + value
    return out


def default_global_batch(*layouts: ParallelConfig) -> int:
    """The smallest batch every layout splits evenly over its DP ranks, with a multiple
    of ``pp`` micro-batches per DP rank where the pipeline is interleaved (megatron's
    interleaved schedule runs them in groups of pp)."""
    step = batch = math.lcm(*(c.dp for c in layouts))
    while any(c.batch_problem(batch) for c in layouts):
        batch += step
    return batch
