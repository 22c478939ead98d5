"""Megatron checkpoints in and out: Megatron-LM's layout both ways, the distributed
optimizer's ``dp_reshardable`` format loaded into another TP/PP, ``etcslurm checkpoint``.

* pure: the ``dp_reshardable`` decoding (where each param lies in the saved buckets, which
  reads fill the pieces of another layout) against megatron's buffer rule, the refusals,
  model chunks under ``model0..N``, the tracker;
* 4 processes: a ``dp_reshardable`` checkpoint (bf16: fp32 main params too) saved at
  tp2pp2 and loaded at tp1pp2dp2, the global state bit for bit;
* the plain megatron-core loop (``examples/pretrain_llama_plain.py`` under torchrun) and
  the elastic example, one chain: the plain loop at tp2pp2 saves ZeRO-1 ``dp_reshardable``
  checkpoints; an elastic run at tp1pp2dp2 resumes one and continues with the plain loop's
  losses; ``etcslurm checkpoint`` asks it for a checkpoint, which the plain loop loads
  at tp2pp1 (``--load DIR``: ``latest_checkpointed_iteration.txt``) and continues with the
  same losses again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from argparse import Namespace
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from etcslurm.baseline import megatron_lm
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.state import box_numel
from etcslurm.errors import StateLostError, UsageError
from etcslurm.megatron_state import dp_reshardable as fmt
from etcslurm.megatron_state import rank_pieces
from etcslurm.megatron_state.buffers import _buffer_layout_cached
from etcslurm.megatron_state.params import stage_params
from etcslurm.runtime.recovery import REFORMED
from tests.helpers import pids_alive

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "examples" / "pretrain_llama_plain.py"
LLAMA = GPTSpec.parse("llama-tiny")
STEPS, GLOBAL_BATCH = 6, 12
#: |resumed - continued| loss: the same model in another TP/PP (reduction order differs)
TOLERANCE = 1e-5


# ------------------------------------------------------------------ pure: the format
def _tensors(spec: GPTSpec, cfg: ParallelConfig, overlap: bool = False,
             vocab_pad_tp: int | None = 8) -> dict[fmt.BucketTensor, int]:
    """The bucket tensors megatron would save for ``cfg`` (lengths from its buffer rule)."""
    out = {}
    for pp in range(cfg.pp):
        buckets, index, *_ = _buffer_layout_cached(spec, cfg, pp, overlap, vocab_pad_tp)
        for tp in range(cfg.tp):
            for b, (start, _end) in enumerate(buckets):
                last = max(e for _s, e, k in index if k == b)
                tensor = fmt.BucketTensor(fmt.model_parallel_index(cfg, tp, pp), 0,
                                          "(torch.float32, torch.float32)", b)
                out[tensor] = last - start
    return out


@pytest.mark.parametrize(("model", "layout", "overlap"), [
    ("llama-tiny", "tp2pp2dp1", False), ("llama-tiny", "tp1pp1dp4", False),
    ("gpt-tiny", "tp1pp2dp2", True),  # tied embedding: a bucket of its own; several buckets
    ("gpt-tiny", "tp2pp1dp2", True),
])
def test_dp_reshardable_places_params_as_megatrons_buffer(model: str, layout: str,
                                                          overlap: bool) -> None:
    """From the buckets' unpadded lengths alone, every param lands where megatron's
    ``_ParamAndGradBuffer`` put it (whatever the bucket size was)."""
    spec, cfg = GPTSpec.parse(model), ParallelConfig.parse(layout)
    for pp in range(cfg.pp):
        buckets, index, *_ = _buffer_layout_cached(spec, cfg, pp, overlap, 8)
        sizes = [max(e for _s, e, k in index if k == b) - start
                 for b, (start, _end) in enumerate(buckets)]
        placed = fmt.place_in_buckets(stage_params(spec, cfg, 0, pp), sizes)
        assert placed == [(b, s - buckets[b][0], e - buckets[b][0]) for s, e, b in index]


def test_dp_reshardable_reads_fill_every_piece_of_another_layout_once() -> None:
    """Saved at tp2pp2, needed at tp1pp2dp2 (ZeRO-1 shards) and tp2pp1 (plain Adam): the
    reads hold exactly every element of every optimizer piece; a TP that pads the
    vocabulary further gets those rows as a zero fill."""
    saved = ParallelConfig.parse("tp2pp2dp1")
    parts = fmt.saved_parts(LLAMA, saved, _tensors(LLAMA, saved))
    shapes = {k: v for k, v in _global_shapes(parts).items()}
    fmt.check_shapes(parts, shapes)
    for layout, optimizer in (("tp1pp2dp2", "distributed"), ("tp2pp1dp1", "adam")):
        cfg = ParallelConfig.parse(layout)
        for rank in range(cfg.world_size):
            needed = sorted({(p.key.split(".", 3)[3], p.box) for p in
                             rank_pieces(LLAMA, cfg, rank, optimizer)
                             if p.key.startswith("optimizer.state.")})
            plan = fmt.plan_reads(needed, parts)
            for (_key, box), piece in zip(needed, plan, strict=True):
                assert sum(box_numel(r.box) for r in piece.reads) == box_numel(box)
                assert not piece.fill
                for read in piece.reads:  # the range holds the box, row-major in its part
                    assert read.stop - read.start >= box_numel(read.box)
    wide = GPTSpec(layers=2, hidden=48, heads=6, query_groups=3, ffn=48, vocab=1000, seq=16,
                   gated=True, activation="silu", norm="RMSNorm", position="rope",
                   bias=False, tied_embeddings=False)
    one = ParallelConfig.parse("tp1pp1dp1")
    parts = fmt.saved_parts(wide, one, _tensors(wide, one))
    box = ((768, 1152), (0, 48))  # tp3's last vocabulary shard: rows 1024.. are padding
    [piece] = fmt.plan_reads([("output_layer.weight", box)], parts)
    assert piece.fill == (((1024, 1152), (0, 48)),)
    assert sum(box_numel(r.box) for r in piece.reads) == 256 * 48


def _global_shapes(parts: list[fmt.SavedPart]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for part in parts:
        hi = [h for _lo, h in part.box]
        out[part.key] = [max(a, b) for a, b in zip(out.get(part.key, hi), hi, strict=True)]
    return out


def test_dp_reshardable_refuses_a_checkpoint_of_another_model_or_layout() -> None:
    saved = ParallelConfig.parse("tp2pp2dp1")
    tensors = _tensors(LLAMA, saved)
    with pytest.raises(fmt.FormatError, match=r"model-parallel ranks \[0, 1, 2, 3\]; "
                                              r"tp1pp2dp2 has \[0, 1\]"):
        fmt.saved_parts(LLAMA, ParallelConfig.parse("tp1pp2dp2"), tensors)
    other = replace(LLAMA, ffn=192)  # another model than the one that saved
    with pytest.raises(fmt.FormatError, match=r"crosses the end of bucket 0"):
        fmt.saved_parts(other, saved, tensors)
    parts = fmt.saved_parts(LLAMA, saved, tensors)
    shapes = _global_shapes(parts)
    shapes["decoder.layers.mlp.linear_fc2.weight"] = [4, 64, 256]
    with pytest.raises(fmt.FormatError, match=r"linear_fc2.weight: \[4, 64, 256\] in the "
                                              r"checkpoint, \[4, 64, 128\] in the model"):
        fmt.check_shapes(parts, shapes)
    key = next(iter(tensors)).key("exp_avg")
    with pytest.raises(fmt.FormatError, match=r"kinds \['exp_avg'\]"):
        fmt.bucket_tensors({key: (10,)})
    assert fmt.vocab_pad_of(LLAMA, saved, 1024) == 8
    with pytest.raises(fmt.FormatError, match="embedding has 999 rows"):
        fmt.vocab_pad_of(LLAMA, saved, 999)


# ------------------------------------------------------------------ pure: the layout
class _Chunk:
    """A model chunk as the checkpoint code sees it (``sharded_state_dict``/load)."""

    def __init__(self, name: str) -> None:
        self.name, self.loaded = name, None

    def sharded_state_dict(self, metadata: Any = None) -> dict[str, str]:
        return {f"decoder.layers.{self.name}": self.name}

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


def test_every_model_chunk_is_saved_and_loaded_under_model0_modelN() -> None:
    """Virtual pipeline stages: Megatron-LM's ``model0``, ``model1`` ... (one chunk:
    ``model``), each loaded from its own key; ``args`` records the chunk count."""
    chunks = [_Chunk("a"), _Chunk("b")]
    state = megatron_lm.model_state(chunks, metadata={})
    assert state == {"model0": {"decoder.layers.a": "a"}, "model1": {"decoder.layers.b": "b"}}
    megatron_lm.load_model_state(chunks, {"model0": "A", "model1": "B", "iteration": 3})
    assert [c.loaded for c in chunks] == ["A", "B"]
    assert list(megatron_lm.model_state(chunks[:1], {})) == ["model"]
    from etcslurm.megatron.model import TrainHyper

    trainee = Namespace(spec=LLAMA, config=ParallelConfig.parse("tp1pp2dp2"), hyper=TrainHyper(),
                        model=chunks, dtype="torch.float32", distributed=True, seed=7,
                        iteration=3, consumed_samples=36)
    args = megatron_lm.args_namespace(trainee)
    assert (args.virtual_pipeline_model_parallel_size, args.consumed_train_samples) == (2, 36)
    assert megatron_lm.saved_layout({"args": args}) == trainee.config
    assert megatron_lm.consumed_samples({"args": args}) == 36


def test_latest_checkpointed_iteration_names_the_checkpoint(tmp_path: Path) -> None:
    save = tmp_path / "save"
    save.mkdir()
    with pytest.raises(UsageError, match=r"no checkpoint in .*save: neither "
                                         r"latest_checkpointed_iteration\.txt"):
        megatron_lm.resolve(save)
    megatron_lm.write_tracker(save, 12)
    assert (save / megatron_lm.TRACKER).read_text() == "12\n"
    with pytest.raises(StateLostError, match=r"names iteration 12, but .*iter_0000012 is not"):
        megatron_lm.resolve(save)
    target = megatron_lm.iteration_dir(save, 12)
    target.mkdir()
    (target / "metadata.json").write_text("{}")
    assert megatron_lm.resolve(save) == (target, 12)
    assert megatron_lm.resolve(target) == (target, 12)
    (save / megatron_lm.TRACKER).write_text("release?")
    with pytest.raises(StateLostError, match="cannot read checkpoint pointer"):
        megatron_lm.read_tracker(save)


# ------------------------------------------------------------------ etcslurm checkpoint
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCSLURM_")}
    return subprocess.run([sys.executable, "-m", "etcslurm", "checkpoint", *args],
                          capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.mark.redis
def test_etcslurm_checkpoint_sets_the_request_the_boundary_takes(redis_url: str,
                                                                 run_id: str) -> None:
    """One line and exit 2 for a run that is not there; else the ``checkpoint`` key holds
    the request (requests before one is taken are one) and ``checkpoint.requested`` says
    so."""
    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator
    from etcslurm.runtime.config import RunSettings

    proc = _cli("--run", "no-such-run-x", "--redis", redis_url)
    assert proc.returncode == 2 and "no run 'no-such-run-x'" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    client = connect(redis_url)
    coord = Coordinator(client, run_id)
    coord.ensure_spec(RunSettings(model=LLAMA).to_json())
    try:
        for reason in ("first", "second"):
            proc = _cli("--run", run_id, "--redis", redis_url, "--reason", reason, "--json")
            assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["request"]["reason"] == "second"
        request = coord.checkpoint_request()
        assert (request.by, request.reason) == ("operator", "second")
        from etcslurm.coord.records import parse_event

        asked = [parse_event(e).data for e in coord.read_events()
                 if e["type"] == "checkpoint.requested"]
        assert [d.reason for d in asked] == ["first", "second"]
        coord.take_checkpoint_request()
        assert coord.checkpoint_request() is None
    finally:
        coord.end_run()
        client.close()


# ------------------------------------------------------------------ 4 processes: bit for bit
@pytest.mark.slow
def test_dp_reshardable_bf16_checkpoint_loads_bit_exact_into_another_tp(tmp_path: Path) -> None:
    """ZeRO-1 at tp2pp2, bf16 (fp32 main params in the buckets' ``param``), saved
    ``dp_reshardable``; rebuilt at tp1pp2dp2 in the same processes and loaded through
    etcslurm's decoding: every global tensor (model, fp32 main params, both moments) equals
    the saved one bit for bit, and training goes on as the never-saved run."""
    from etcslurm.testing.megatron_selftest import launch

    results = launch("migrate", 4, [
        "--from", "tp2pp2dp1", "--to", "tp1pp2dp2", "--optimizer", "distributed",
        "--sharding", "dp_reshardable", "--sync-save", "--reference", "--spec", "llama-tiny",
        "--dtype", "bfloat16", "--steps-after", "1"], tmp_path, 420)
    ref = results[0]["reference_losses"]
    for rank in results:
        [target] = rank["targets"]
        assert target["mismatched_keys"] == [] and target["iteration"] == 2
        assert target["keys"] >= 30  # params, fp32_param, exp_avg, exp_avg_sq of each
        assert target["losses_after"] == pytest.approx(ref[2:], abs=1e-4)


# ------------------------------------------------------------------ the plain loop and back
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plain(run_dir: Path, data_dir: Path, nproc: int, layout: str, *args: str,
           ok: bool = True) -> tuple[dict[int, float], str]:
    """``examples/pretrain_llama_plain.py`` under torchrun on gloo: step -> loss, and its
    output.  Its process group (megatron's checkpoint processes too) is killed after."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCSLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "-m", "etcslurm.testing.cpu_run", str(PLAIN),
           "--layout", layout,
           "--optimizer", "distributed", "--steps", str(STEPS), "--global-batch",
           str(GLOBAL_BATCH), "--run-dir", str(run_dir), "--data-dir", str(data_dir), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, cwd=run_dir)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert (proc.returncode == 0) == ok, out[-4000:]
    steps = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    return {s["step"]: s["loss"] for s in steps}, out


@pytest.fixture(scope="module")
def chain(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain loop at tp2pp2 (ZeRO-1, saving every 2 steps), then an elastic run of the
    elastic example at tp1pp2dp2 from its step-2 checkpoint, asked for a checkpoint with
    ``etcslurm checkpoint`` once it trained step 3."""
    from etcslurm.local.launcher import DemoOptions, run_demo

    tmp = tmp_path_factory.mktemp("megatron-ckpt")
    data = tmp / "data"
    t0 = time.monotonic()
    plain, _ = _plain(tmp / "plain", data, 4, "tp2pp2dp1", "--save", str(tmp / "plain-ckpt"),
                      "--save-interval", "2")
    t_plain = time.monotonic() - t0
    load = str(tmp / "plain-ckpt" / "iter_0000002")
    run_id, asked = f"t-{uuid.uuid4().hex[:10]}", []

    def ask_for_a_checkpoint(run: Any) -> None:
        if run.step >= 3 and not asked:
            asked.append(subprocess.run(
                [sys.executable, "-m", "etcslurm", "checkpoint", "--run", run_id, "--redis",
                 redis_url, "--reason", "test"], capture_output=True, text=True, timeout=60,
                env={k: v for k, v in os.environ.items() if not k.startswith("ETCSLURM_")}))

    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env_path]))
    try:
        t1 = time.monotonic()
        result = run_demo(DemoOptions(
            workers=4, steps=STEPS, schedule="", redis=redis_url, run_id=run_id,
            run_dir=str(tmp / "elastic"), global_batch=GLOBAL_BATCH, model="",
            gpus_per_node=8, optimizer="distributed", reference=False, keep_keys_s=5,
            min_step_seconds=1.0, first_layout="tp1pp2dp2", load=load,
            worker_module="examples.pretrain_llama",
            worker_args=("--workers", "4", "--steps", str(STEPS), "--global-batch",
                         str(GLOBAL_BATCH), "--optimizer", "distributed", "--layout",
                         "tp1pp2dp2", "--load", load, "--data-dir", str(data))),
            on_tick=ask_for_a_checkpoint)
        t_elastic = time.monotonic() - t1
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_path
    print(f"plain loop {t_plain:.1f} s, elastic run {t_elastic:.1f} s")
    return {"tmp": tmp, "data": data, "plain": plain, "result": result, "load": load,
            "asked": asked}


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_plain_dp_reshardable_tp2pp2_checkpoint_resumed_by_an_elastic_run_at_tp1pp2dp2(
        chain: dict[str, Any]) -> None:
    """The distributed optimizer's default format, which megatron-core reshards only along
    DP, resumed at another TP: the elastic run's losses are the plain loop's continuing."""
    plain, result = chain["plain"], chain["result"]
    assert sorted(plain) == list(range(1, STEPS + 1))
    gens = result.generations
    assert [(g["kind"], g["to"]) for g in gens[:1]] == [("start", "tp1pp2dp2")], gens
    # a collective that a loaded host holds past its timeout forms the same world again
    # (nothing moves, nobody is dead); any other generation is a change the run never asked for
    for g in gens[1:]:
        assert (g["to"] == "tp1pp2dp2" and not g["dead"] and not g["moved_bytes"]
                and g["reason"].startswith(REFORMED)), gens
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    assert pids_alive(result.pids) == [], "no worker process may outlive the run"
    assert sorted(result.losses) == list(range(3, STEPS + 1))  # resumed after step 2
    diffs = {s: abs(result.losses[s] - plain[s]) for s in result.losses}
    assert max(diffs.values()) <= TOLERANCE, (diffs, result.losses, plain)
    # the plain loop itself cannot: its own load refuses the TP/PP change
    _, out = _plain(chain["tmp"] / "refused", chain["data"], 2, "tp2pp1dp1", "--load",
                    chain["load"], ok=False)
    assert "(TP, PP) mismatch: the distributed optimizer's dp_reshardable format" in out


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_elastic_checkpoint_via_latest_checkpointed_iteration_loaded_by_the_plain_loop_at_tp2pp1(
        chain: dict[str, Any]) -> None:
    """``etcslurm checkpoint`` made the elastic run save at its next boundary, in
    Megatron-LM's layout; the plain loop's ``--load DIR`` finds it through
    ``latest_checkpointed_iteration.txt`` and continues at tp2pp1 with the same losses."""
    [asked] = chain["asked"]
    assert asked.returncode == 0 and "checkpoint requested for run" in asked.stdout, asked
    result = chain["result"]
    save = Path(result.run_dir) / "checkpoint" / "periodic"
    step = int((save / megatron_lm.TRACKER).read_text())
    assert 3 <= step < STEPS, step
    target = megatron_lm.iteration_dir(save, step)
    assert megatron_lm.is_checkpoint(target)
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(target))
    meta = dist_checkpointing.load_content_metadata(str(target))
    assert meta["distrib_optim_sharding_type"] == "fully_reshardable"
    assert megatron_lm.saved_layout(common) == ParallelConfig.parse("tp1pp2dp2")
    assert common["iteration"] == step and common["args"].consumed_train_samples == step * 12
    assert {"opt_param_scheduler", "checkpoint_version"} <= set(common)
    back, _ = _plain(chain["tmp"] / "back", chain["data"], 2, "tp2pp1dp1", "--load", str(save))
    assert sorted(back) == list(range(step + 1, STEPS + 1))
    for s in back:
        assert abs(back[s] - result.losses[s]) <= TOLERANCE, (s, back, result.losses)
        assert abs(back[s] - chain["plain"][s]) <= TOLERANCE, (s, back, chain["plain"])
