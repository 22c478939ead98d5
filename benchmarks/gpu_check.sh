#!/usr/bin/env bash
# One-GPU check (<= 5 minutes): megatron-core GPT forward/backward on CUDA with NCCL (world
# of 1), the executor's pack -> send/recv -> checksum -> unpack on the GPU (2 processes on
# the one GPU when NCCL allows it, else pack/unpack throughput alone), and checksum
# throughput.  Not run on the CPU CI machine.  Usage: benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
timeout 300 "$PY" - <<'PYEOF'
import os, time, torch, torch.distributed as dist
from datetime import timedelta
assert torch.cuda.is_available(), "no GPU visible"
dev = torch.device("cuda", 0)
print("GPU:", torch.cuda.get_device_name(0))

# 1. pack / checksum / unpack throughput of the executor's primitives on the GPU
from etcslurm.core.state import Piece
from etcslurm.transfer.executor import checksum, message_layout, _typed
src = torch.randn(8192, 8192, device=dev)              # 256 MiB fp32
pieces = [Piece("w", ((r, r + 512), (0, 8192)), "float32") for r in range(0, 8192, 512)]
cols = [Piece("w", ((0, 8192), (c, c + 1024)), "float32") for c in range(0, 8192, 1024)]
for name, slices in (("row slices", pieces), ("column slices (strided)", cols)):
    layout = message_layout(slices)
    buf = torch.empty(layout.size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(2):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for p, off in zip(slices, layout.offsets):
            s = tuple(slice(lo, hi) for lo, hi in p.box)
            _typed(buf, off, p).copy_(src[s])
        torch.cuda.synchronize(); t1 = time.perf_counter()
        c = int(checksum(buf[: layout.payload]))
        torch.cuda.synchronize(); t2 = time.perf_counter()
        for p, off in zip(slices, layout.offsets):
            s = tuple(slice(lo, hi) for lo, hi in p.box)
            dst[s].copy_(_typed(buf, off, p))
        torch.cuda.synchronize(); t3 = time.perf_counter()
    assert torch.equal(dst, src)
    gb = layout.payload / 1e9
    print(f"{name}: pack {gb/(t1-t0):.1f} GB/s, checksum {gb/(t2-t1):.1f} GB/s, "
          f"unpack {gb/(t3-t2):.1f} GB/s")

# 2. executor over NCCL in a world of 1 (local copies + empty rounds) and
# 3. megatron-core GPT forward/backward on CUDA
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
from etcslurm.groups import lifecycle as groups
from etcslurm.megatron import parallel
groups.register_teardown_hook(parallel.teardown)
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.megatron.model import TrainHyper, build_gpt
from etcslurm.megatron.train import train_step
from etcslurm.megatron.sharded_meta import local_state
from etcslurm.transfer.executor import execute
cfg = ParallelConfig(1, 1, 1)
parallel.init_parallel(cfg, 0, 1, store, 0, backend="nccl", timeout_s=120)
spec = GPTSpec.parse("layers=4,hidden=512,heads=8,vocab=8192,seq=256")
tr = build_gpt(spec, cfg, "adam", hyper=TrainHyper(global_batch=4))
t0 = time.perf_counter()
losses = [train_step(tr) for _ in range(3)]
torch.cuda.synchronize()
print(f"megatron-core GPT on CUDA: 3 steps in {time.perf_counter()-t0:.2f} s, losses {losses}")
state = local_state(tr)
dst = [(p, torch.empty_like(v)) for p, v in state.items()]
# the exchange runs on a bare NCCL group of its own, outside the world (as the runtime and
# the benchmark run it); a group of one here: formation, all-reduce probe, abort
xg = groups.exchange_group(store, "gpu-check", 0, 1, "nccl", timeout=120)
stats = execute([], list(state.pieces), "0", {"0": 0}, state.items(), dst, timeout=60, group=xg)
groups.close_exchange_group(xg)
assert all(torch.equal(a, b) for (_, a), (_, b) in zip(state.items(), dst))
print(f"executor local copies on GPU: {stats.bytes_local/1e9:.3f} GB in {stats.local_seconds:.3f} s")
groups.teardown()
print("GPU CHECK OK")
PYEOF

# 4. Mixture of experts with TP > 1 (not runnable on CPU: megatron trains MoE with TP > 1
# only with sequence parallelism, which its local spec's norms support only with Apex).
# Needs 4 GPUs (one NCCL rank per GPU) and Apex; skipped otherwise.
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -ge 4 ] && "$PY" -c 'import apex' 2>/dev/null; then
  timeout 600 "$PY" -c "import sys; from etcslurm.cli import main; sys.exit(main())" \
    bench migrate --model moe-tiny --from tp2pp1dp2ep2 \
    --to tp1pp1dp4ep2 --optimizer distributed --json | "$PY" -c \
    'import json,sys; r=json.load(sys.stdin); print("MoE TP2->TP1:", {k: r[k] for k in ("bit_exact", "loss_match", "speedup")}); assert r["bit_exact"] and r["loss_match"]'
else
  echo "MoE TP 2 check skipped: needs >= 4 GPUs and Apex (found $ngpu GPUs)"
fi
