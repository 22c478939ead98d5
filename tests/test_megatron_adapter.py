"""The megatron-core adapter on real megatron-core + gloo, in separate processes.

Every multi-process check runs ``python -m etcslurm.testing.megatron_selftest`` once per rank
(the CPU shim patches torch globally, so it never runs inside the pytest process) and
asserts on the JSON the ranks write.  Model: layers=4 hidden=64 heads=4 vocab=1024
seq=32, global batch 4.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from etcslurm.testing.megatron_selftest import launch

TIMEOUT_S = 420


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (the CPU shim patches torch process-wide);
    fails the test with its stderr unless it exits 0."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_cpu_shim_maps_cuda_to_cpu_only_without_gpu() -> None:
    code = (
        "import torch\n"
        "from etcslurm.megatron import cpu_shim\n"
        "assert not torch.cuda.is_available()\n"
        "assert cpu_shim.install_if_needed() is True\n"
        "assert cpu_shim.install_if_needed() is True  # idempotent\n"
        "t = torch.empty(3, device='cuda')\n"
        "assert t.device.type == 'cpu', t.device\n"
        "assert torch.zeros(2).cuda().device.type == 'cpu'\n"
        "assert torch.zeros(2).to('cuda:0').device.type == 'cpu'\n"
        "assert torch.zeros(2).type() == 'torch.cuda.FloatTensor'\n"
        "assert torch.cuda.current_device() == 0\n"
        "s = torch.cuda.get_rng_state(); torch.cuda.set_rng_state(s)\n"
        "print('ok', len(cpu_shim.PATCHED))\n"
    )
    out = _python(code)
    assert out.stdout.startswith("ok")


@pytest.mark.slow
def test_live_views_alias_storage_and_restore_bit_exact(tmp_path) -> None:
    """The P2P contract: pieces copied view-to-view into a fresh distributed-optimizer
    trainee (+ scalars through JSON) give the same state and the same losses, bit for bit."""
    r = launch(
        "selfcopy",
        2,
        ["--from", "tp1pp1dp2", "--optimizer", "distributed", "--steps-after", "2"],
        tmp_path,
        TIMEOUT_S,
    )
    for rank in r:
        assert rank["same_pieces"] and rank["separate_storage"]
        assert rank["state_equal"]
        assert rank["piece_kinds"] == ["exp_avg", "exp_avg_sq", "param"]
        assert rank["scalars_iteration"] == 2
        assert rank["losses_after"] == rank["losses_continued"]
    # DP ranks hold different optimizer shards
    assert r[0]["losses_after"] == r[1]["losses_after"]


@pytest.mark.slow
def test_parallel_state_rebuild_does_not_leak(tmp_path) -> None:
    """10 rebuilds over all layouts of 4 ranks in the same processes: the same layout
    costs the same threads, groups and (±4) fds each time; teardown returns to the start."""
    results = launch("rebuild", 4, ["--rebuilds", "10"], tmp_path, TIMEOUT_S)
    for rank in results:
        rows = rank["rows"]
        assert len(rows) == 10
        by_layout: dict[str, list[dict]] = {}
        for row in rows:
            by_layout.setdefault(row["layout"], []).append(row)
        for layout, seen in by_layout.items():
            # a leaked rebuild keeps ~17 groups: dozens of threads and sockets each time;
            # a socket or two may still be closing asynchronously
            first, last = seen[0], seen[-1]
            assert (last["threads"], last["groups"]) == (first["threads"], first["groups"]), layout
            assert last["fds"] <= first["fds"] + 4, layout
        assert rank["after_teardown"]["threads"] == rank["before"]["threads"]
        assert rank["after_teardown"]["fds"] <= rank["before"]["fds"] + 4
        assert all(r["probe"] > 0 for r in rows)


def test_moe_models_given_up_in_a_row_leak_no_process_groups(tmp_path) -> None:
    """Six worlds in a row (EP 2, PP 2 and DP 2 in turn), each training a step of an MoE
    model (megatron's all-gather dispatcher) that is then given up: after each teardown
    no more threads are alive than after the second.  megatron's dispatchers keep the last forward's
    tensors, whose graph holds the DDP wrapper through C++ (invisible to Python's garbage
    collector); unless etcslurm cuts it, every such model keeps its gloo groups (~3 OS
    threads each) for good."""
    results = launch("rebuild", 2, ["--rebuilds", "6", "--train", "--spec",
                                    "layers=2,hidden=64,heads=4,vocab=1024,seq=32,experts=4,topk=2,bias=0",
                                    "--to", "tp1pp1dp2ep2", "tp1pp2dp1", "tp1pp1dp2"],
                     tmp_path, TIMEOUT_S)
    for rank in results:
        torn_down = [row["torn_down"]["threads"] for row in rank["rows"]]
        # the second world's count (lazy first-use threads started by then) holds after
        assert max(torn_down[1:]) <= torn_down[1], torn_down
        assert all(row["loss"] > 0 for row in rank["rows"])


def test_a_model_built_to_be_filled_skips_the_random_init_and_only_inside() -> None:
    """``weights_filled_later`` builds without drawing megatron's init (the runtime's
    migration targets) but with every mark megatron's initialisers set (tensor-parallel
    dim and stride: the gradient norm reads them); outside it the same seed gives the
    same weights again, and megatron's initialisers are megatron's own."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from megatron.core.tensor_parallel import layers\n"
        "from etcslurm.bench.signature import update_signature\n"
        "from etcslurm.core.layout import ParallelConfig\n"
        "from etcslurm.core.models import PRESETS\n"
        "from etcslurm.megatron import parallel\n"
        "from etcslurm.megatron.model import build_gpt, weights_filled_later\n"
        "layout = ParallelConfig(1, 1, 1)\n"
        "parallel.init_parallel(layout, 0, 1, dist.HashStore(), 'filled')\n"
        "init = layers._initialize_affine_weight_cpu\n"
        "for name in ('gpt-tiny', 'llama-tiny', 'moe-tiny'):\n"
        "    spec = PRESETS[name]\n"
        "    def weights(t):\n"
        "        return [p.detach().clone() for p in t.model[0].parameters()]\n"
        "    built = build_gpt(spec, layout)\n"
        "    first, marks = weights(built), update_signature(built)\n"
        "    with weights_filled_later():\n"
        "        empty = build_gpt(spec, layout)\n"
        "    assert layers._initialize_affine_weight_cpu is init\n"
        "    assert update_signature(empty) == marks, name\n"
        "    assert sum(p.get('tensor_model_parallel', False)\n"
        "               for p in marks['params'].values()) > 0, name\n"
        "    again = weights(build_gpt(spec, layout))\n"
        "    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))\n"
        "    differ = sum(not torch.equal(a, b) for a, b in zip(first, weights(empty),\n"
        "                                                      strict=True))\n"
        "    print('differ', name, differ, 'of', len(first))\n"
        "    assert differ > 0\n"
        "parallel.teardown()\n"
    )
    out = _python(code)
    assert "differ" in out.stdout
