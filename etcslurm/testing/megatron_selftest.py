"""Multi-process checks of the adapter and the checkpoint baseline (one process per rank).

Why a module and not test code: the tests and the benchmarks start real processes
(``python -m etcslurm.testing.megatron_selftest ...``, one per rank, gloo over a ``TCPStore``) and
read the JSON rank 0 writes; the same scenarios measure build and checkpoint times on a
~100M-parameter GPT.

Scenarios:
- ``migrate``: build ``--from``, train, gather the global state, checkpoint-save (the
  distributed optimizer in ``--sharding``'s format); for each ``--to`` layout rebuild the
  world in the same processes, load resharded into a fresh model+optimizer, gather again
  and compare bit for bit, train on; then a never-migrated reference run in ``--from`` for
  the loss comparison.
- ``rebuild``: rebuild ``parallel_state`` N times over alternating layouts and record
  threads, open fds and process groups after each rebuild (leak check).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def _counts() -> dict[str, int]:
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def _compare(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose global tensors differ (bitwise), are missing or are extra."""
    bad = sorted(set(before) ^ set(after))
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key]
        if (
            a.shape != b.shape
            or a.dtype != b.dtype
            or not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        ):
            bad.append(key)
    return bad


def scenario_migrate(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    from etcslurm.baseline.checkpoint import CheckpointMigrator
    from etcslurm.core.layout import ParallelConfig
    from etcslurm.core.models import GPTSpec
    from etcslurm.megatron import adapter

    spec = GPTSpec.parse(args.spec)
    dtype = getattr(torch, args.dtype)
    hyper = adapter.TrainHyper(global_batch=args.global_batch)
    src = ParallelConfig.parse(args.src)
    gen = 0
    result: dict[str, Any] = {"spec": str(spec), "from": str(src), "optimizer": args.optimizer}
    result["init_s"] = adapter.init_parallel(src, args.rank, args.world, store, gen)
    t0 = time.perf_counter()
    trainee = adapter.build_gpt(spec, src, args.optimizer, seed=args.seed, dtype=dtype, hyper=hyper)
    result["build_s"] = time.perf_counter() - t0
    result["build_timings"] = trainee.timings
    result["params_local"] = sum(p.numel() for p in trainee.model[0].parameters())
    result["losses_before"] = [adapter.train_step(trainee) for _ in range(args.steps_before)]
    state = adapter.local_state(trainee)
    result["state_bytes_local"] = state.nbytes
    check = not args.no_check
    before = adapter.gather_global(trainee) if check else {}
    ckpt = CheckpointMigrator(async_writer=not args.sync_save, sharding=args.sharding)
    ckpt_dir = Path(args.ckpt_dir)
    saves = [ckpt.save(trainee, ckpt_dir / "step").to_json() for _ in range(args.saves)]
    result["saves"] = saves
    del trainee, state
    result["targets"] = []
    for text in args.to:
        dst = ParallelConfig.parse(text)
        gen += 1
        entry: dict[str, Any] = {"to": str(dst)}
        entry["rebuild_s"] = adapter.init_parallel(dst, args.rank, args.world, store, gen)
        fresh = adapter.build_empty(
            spec, dst, args.optimizer, seed=args.seed + 1, dtype=dtype, hyper=hyper
        )
        loads = [ckpt.load(fresh, ckpt_dir / "step").to_json() for _ in range(args.loads)]
        entry["loads"] = loads
        if check:
            after = adapter.gather_global(fresh)
            entry["mismatched_keys"] = _compare(before, after)
            entry["keys"] = len(after)
            entry["iteration"] = fresh.iteration
        entry["losses_after"] = [adapter.train_step(fresh) for _ in range(args.steps_after)]
        result["targets"].append(entry)
        del fresh
    if args.reference:
        gen += 1
        adapter.init_parallel(src, args.rank, args.world, store, gen)
        ref = adapter.build_gpt(spec, src, args.optimizer, seed=args.seed, dtype=dtype, hyper=hyper)
        steps = args.steps_before + args.steps_after
        result["reference_losses"] = [adapter.train_step(ref) for _ in range(steps)]
    ckpt.close()
    adapter.teardown()
    return result


def scenario_selfcopy(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    """The P2P contract in one layout: copy every held piece from the live views of a
    trained trainee into the views of a freshly built one, apply the scalars (through
    JSON), train both on: losses and state must be bit-identical."""
    from etcslurm.core.layout import ParallelConfig
    from etcslurm.core.models import GPTSpec
    from etcslurm.megatron import adapter

    spec = GPTSpec.parse(args.spec)
    hyper = adapter.TrainHyper(global_batch=args.global_batch)
    cfg = ParallelConfig.parse(args.src)
    adapter.init_parallel(cfg, args.rank, args.world, store, 0)
    old = adapter.build_gpt(spec, cfg, args.optimizer, seed=args.seed, hyper=hyper)
    before = [adapter.train_step(old) for _ in range(args.steps_before)]
    held = adapter.local_state(old)
    doc = json.loads(json.dumps(adapter.extract_scalars(old)))
    # a new generation in the same processes; the old views stay valid
    adapter.init_parallel(cfg, args.rank, args.world, store, 1)
    fresh = adapter.build_empty(spec, cfg, args.optimizer, seed=args.seed + 7, hyper=hyper)
    new = adapter.local_state(fresh)
    same_pieces = new.pieces == held.pieces
    aliases = all(
        v_new.untyped_storage().data_ptr() != v_old.untyped_storage().data_ptr()
        for v_new, v_old in zip(new.views, held.views, strict=False)
    )
    for piece, view in new.items():
        view.copy_(held.view(piece))
    adapter.finish_restore(fresh, doc)
    state_equal = not _compare(adapter.gather_global(old), adapter.gather_global(fresh))
    after = [adapter.train_step(fresh) for _ in range(args.steps_after)]
    cont = [adapter.train_step(old) for _ in range(args.steps_after)]
    kinds = sorted(
        {p.key.split(".")[2] if p.key.startswith("optimizer.") else "param" for p in new.pieces}
    )
    adapter.teardown()
    return {
        "losses_before": before,
        "losses_after": after,
        "losses_continued": cont,
        "same_pieces": same_pieces,
        "separate_storage": aliases,
        "state_equal": state_equal,
        "pieces": len(new.pieces),
        "piece_kinds": kinds,
        "bytes": new.nbytes,
        "scalars_iteration": doc["iteration"],
    }


def scenario_rebuild(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from etcslurm.core.layout import ParallelConfig, valid_configs
    from etcslurm.core.models import GPTSpec
    from etcslurm.megatron import adapter

    layouts = [ParallelConfig.parse(t) for t in args.to] or valid_configs(args.world)
    # one warm-up cycle: torch starts a few process-wide threads on the first init
    adapter.init_parallel(layouts[0], args.rank, args.world, store, 0)
    adapter.teardown()
    start = _counts()
    rows = []
    for gen in range(1, args.rebuilds + 1):
        cfg = layouts[(gen - 1) % len(layouts)]
        seconds = adapter.init_parallel(cfg, args.rank, args.world, store, gen)
        from megatron.core import parallel_state

        probe = torch.ones(1)
        dist.all_reduce(probe, group=parallel_state.get_tensor_model_parallel_group())
        dist.all_reduce(probe, group=parallel_state.get_data_parallel_group())
        dist.all_reduce(probe)
        row = {"gen": gen, "layout": str(cfg), "rebuild_s": seconds,
               "groups": len(adapter.megatron_groups()), "probe": float(probe), **_counts()}
        if args.train:  # a model of this world trains a step and is given up with it
            trainee = adapter.build_gpt(GPTSpec.parse(args.spec), cfg, args.optimizer,
                                        seed=args.seed)
            row["loss"] = adapter.train_step(trainee)
            del trainee
            adapter.teardown()
            gc.collect()
            row["torn_down"] = _counts()
        rows.append(row)
    teardown_s = adapter.teardown()
    return {"rows": rows, "teardown_s": teardown_s, "before": start, "after_teardown": _counts()}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    scenario: str, world: int, extra: list[str], workdir: str | os.PathLike[str], timeout_s: float
) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` local processes; every rank's JSON result, by rank.

    Every process is waited for with a timeout; on failure or timeout the ones still
    running are killed (by PID) and RuntimeError carries the tail of each rank's log.
    """
    import subprocess

    from etcslurm.process_start import WorkerProcess, start_worker

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    out = workdir / "result.json"
    procs: list[tuple[WorkerProcess, Path]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for rank in range(world):
        log = workdir / f"rank{rank}.log"
        argv = [scenario, "--rank", str(rank), "--world", str(world), "--port", str(port),
                "--out", str(out), *extra]
        # own session: cleanup reaches the rank's children too (megatron's writer)
        proc = start_worker("etcslurm.testing.megatron_selftest", argv, env=env,
                            stdout=log, stderr=log, new_session=True)
        procs.append((proc, log))
    deadline = time.monotonic() + timeout_s
    failed = []
    try:
        for proc, log in procs:
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"{log.name}: still running after {timeout_s:.0f} s")
                break
            if rc != 0:
                failed.append(f"{log.name}: exit {rc}")
                break
    finally:
        import signal

        for proc, _ in procs:
            try:  # the rank's session: the rank and the processes it started
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.kill()  # in case it had not made its session yet
            proc.wait(timeout=30)
    if failed:
        tails = "\n".join(
            f"--- {log.name}\n" + log.read_text(errors="replace")[-3000:] for _, log in procs
        )
        raise RuntimeError(f"selftest {scenario} failed: {'; '.join(failed)}\n{tails}")
    return [json.loads((workdir / f"result.rank{rank}.json").read_text()) for rank in range(world)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m etcslurm.testing.megatron_selftest")
    parser.add_argument("scenario", choices=["migrate", "rebuild", "selfcopy"])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True, help="JSON result file (rank 0 writes it)")
    parser.add_argument("--spec", default="layers=4,hidden=64,heads=4,vocab=1024,seq=32")
    parser.add_argument("--from", dest="src", default="tp2pp2dp1")
    parser.add_argument("--to", nargs="*", default=[])
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--steps-before", type=int, default=2)
    parser.add_argument("--steps-after", type=int, default=2)
    parser.add_argument("--saves", type=int, default=1)
    parser.add_argument("--loads", type=int, default=1)
    parser.add_argument("--rebuilds", type=int, default=10)
    parser.add_argument("--train", action="store_true",
                        help="rebuild: train a step of --spec's model in each world")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--sync-save", action="store_true", help="no persistent writer")
    parser.add_argument("--sharding", default="fully_reshardable",
                        help="the distributed optimizer's checkpoint format")
    parser.add_argument("--no-check", action="store_true", help="skip the global gathers")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--watchdog", type=float, default=0, help="dump stacks and exit after S")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from etcslurm.megatron.cpu_shim import install_if_needed

    install_if_needed()
    if args.ckpt_dir is None:
        args.ckpt_dir = str(Path(args.out).parent / "ckpt")
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world, args.rank == 0, timeout=dt.timedelta(seconds=120)
    )
    fn = {"migrate": scenario_migrate, "rebuild": scenario_rebuild, "selfcopy": scenario_selfcopy}[
        args.scenario
    ]
    result = fn(args, store)
    result["rank"] = args.rank
    out = Path(args.out)
    rank_out = out.with_name(f"{out.stem}.rank{args.rank}.json")
    rank_out.write_text(json.dumps(result, indent=1, default=str))
    if args.rank == 0:
        out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
