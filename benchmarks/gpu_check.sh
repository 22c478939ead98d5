#!/usr/bin/env bash
# The prepared check for a machine with one GPU (<= 10 minutes): see benchmarks/gpu_check.py
# (pack/checksum/unpack on the GPU, NCCL worlds of one rebuilt as a resize does,
# megatron-core GPT in bf16 with the distributed optimizer -- local spec, and the
# Transformer Engine spec where installed -- the state description and the executor's
# copies over an NCCL exchange group), then the elastic runtime itself on the GPU (one
# worker of `etcslurm demo`), then MoE with TP 2 where 4 GPUs and Apex are there.  One
# NCCL rank per GPU: NCCL refuses two on one device, so P2P between ranks is not here.
# Each step names what is missing when it fails.  Usage: benchmarks/gpu_check.sh [--cpu]
# (--cpu: the Python part on the CPU, to check this script without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
fail() { echo "gpu_check: FAIL: $*" >&2; exit 1; }
cpu=${1:-}
if [ "$cpu" != --cpu ]; then
  command -v nvidia-smi >/dev/null 2>&1 || fail "no nvidia-smi: not a GPU machine (or no driver)"
  nvidia-smi -L || fail "nvidia-smi lists no GPU"
fi
"$PY" -c 'import etcslurm, megatron.core' 2>/dev/null \
  || fail "etcslurm or megatron-core is not installed for $PY: sbin/setup-venv --cuda"

timeout 600 "$PY" benchmarks/gpu_check.py $cpu || fail "benchmarks/gpu_check.py (above)"
[ "$cpu" = --cpu ] && exit 0

# the elastic runtime on the GPU: one worker, NCCL, bundled Redis, no resizes
out=$(timeout 300 "$PY" -m etcslurm demo --workers 1 --schedule "" --steps 6 --no-reference \
        --no-monitor --json) || fail "etcslurm demo on the GPU: $out"
"$PY" -c 'import json, sys; r = json.loads(sys.argv[1]); loss = r["losses"]
assert r["steps_done"] == 6 and None not in loss, r
print("elastic runtime on the GPU (one worker): 6 steps in %.1f s, loss %.4f -> %.4f"
      % (r["seconds"], loss[0], loss[-1]))' "$out" \
  || fail "the demo's summary: $out"

# Mixture of experts with TP > 1 (not runnable on CPU: megatron trains MoE with TP > 1
# only with sequence parallelism, which its local spec's norms support only with Apex).
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -ge 4 ] && "$PY" -c 'import apex' 2>/dev/null; then
  timeout 600 "$PY" -m etcslurm bench migrate --model moe-tiny --from tp2pp1dp2ep2 \
    --to tp1pp1dp4ep2 --optimizer distributed --json | "$PY" -c \
    'import json,sys; r=json.load(sys.stdin); print("MoE TP2->TP1:", {k: r[k] for k in ("bit_exact", "loss_match", "speedup")}); assert r["bit_exact"] and r["loss_match"]' \
    || fail "MoE TP 2 -> 1 migration"
else
  echo "MoE TP 2 check skipped: needs >= 4 GPUs and Apex (found $ngpu GPUs)"
fi
echo "GPU CHECK OK"
