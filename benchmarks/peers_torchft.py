"""One torchft replica for ``benchmarks/peers.py``: a plain torch GPT of the same shapes as
etcslurm's megatron-core model, trained under torchft's ``Manager``.

Started as ``python benchmarks/peers_torchft.py --replica N --lighthouse URL --log FILE``.
Each replica group is one process (group world size 1, a TCPStore of its own), as in
torchft's ``train_ddp.py`` example: ``ProcessGroupGloo``, torchft's
``DistributedDataParallel`` and ``OptimizerWrapper``, the two state-dict callbacks, and
the default checkpoint transport (HTTP from a healthy replica) for a joiner's state.

What it writes (one JSON line each, unix seconds in ``t``): ``start`` (first line of the
program), ``imported`` (torch and torchft imported), ``manager`` (the Manager built: its
server heartbeats the lighthouse from here on, the arrival), ``heal`` (a state received
from a peer, with its bytes), ``step`` (every step: committed or not, participants, the
time spent waiting for the quorum and in ``should_commit``) and ``leave``.

SIGUSR2 (what Slurm sends before preemption) makes the replica finish its step, shut its
Manager down and exit 0: the same step-boundary leave etcslurm's workers make.  torchft
has no leave message, so the lighthouse learns of it when the heartbeats stop.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def build_model(layers: int, hidden: int, heads: int, ffn: int, vocab: int, seq: int) -> Any:
    """A GPT-2 style decoder with exactly the tensors of megatron-core's local-spec
    GPTModel for the same shapes (learned positions, LayerNorm, biases, GELU, tied output)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.ln2 = nn.LayerNorm(hidden)
            self.fc1 = nn.Linear(hidden, ffn)
            self.fc2 = nn.Linear(ffn, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class PlainGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(tokens.shape[1])
            x = self.wte(tokens) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.t()  # tied output layer

    return PlainGPT()


def allreduce(manager: Any, params: list[Any]) -> None:
    """Average the gradients over the quorum in one message; a failed all-reduce is
    reported to the Manager (the step is then not committed)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    manager.allreduce(flat).wait()
    for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(avg)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside a (nested) state dict."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--stop-file", required=True,
                    help="holds the step to stop after (written by the bench)")
    ap.add_argument("--shape", required=True, help="layers,hidden,heads,ffn,vocab,seq")
    ap.add_argument("--batch", type=int, default=3, help="sequences per replica and step")
    ap.add_argument("--min-step-seconds", type=float, default=0.0)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--grads", choices=("ddp", "allreduce"), default="ddp",
                    help="torchft's DDP wrapper, or one Manager.allreduce of all gradients "
                         "(flattened) after the backward")
    args = ap.parse_args()
    with Path(args.log).open("a", buffering=1) as out:

        def log(ev: str, **data: Any) -> None:
            out.write(json.dumps({"ev": ev, "t": time.time(), **data}) + "\n")

        return replica(args, log)


def replica(args: argparse.Namespace, log: Any) -> int:
    """Train until the stop file's step (or a leave signal); log every step."""
    log("start", t_start=T_START, pid=os.getpid())
    leaving = {"flag": False}
    signal.signal(signal.SIGUSR2, lambda *_: leaving.update(flag=True))

    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    log("imported")
    torch.manual_seed(args.seed)  # every replica starts from the same weights
    layers, hidden, heads, ffn, vocab, seq = (int(x) for x in args.shape.split(","))
    model = build_model(layers, hidden, heads, ffn, vocab, seq)
    # etcslurm's optimizer: megatron-core's Adam on CPU is torch AdamW with these settings
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.01)
    healed: dict[str, Any] = {}

    def load_state_dict(state: dict[str, Any]) -> None:
        t0 = time.time()
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        healed.update(bytes=tensor_bytes(state), load_s=time.time() - t0)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        replica_id=f"peers_{args.replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    log("manager", params=sum(p.numel() for p in model.parameters()))
    ddp = DistributedDataParallel(manager, model) if args.grads == "ddp" else model
    optimizer = Optimizer(manager, inner)
    gen = torch.Generator().manual_seed(args.seed + 1000 * args.replica)
    stop_file = Path(args.stop_file)
    stop_at: int | None = None
    last_commit = None
    try:
        while True:
            t0 = time.perf_counter()
            tokens = torch.randint(0, vocab, (args.batch, seq + 1), generator=gen)
            optimizer.zero_grad()  # starts the quorum (asynchronously)
            logits = ddp(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                     tokens[:, 1:].reshape(-1))
            # the quorum would be waited for inside the first gradient all-reduce: waiting
            # here instead times it apart from the step's own work
            tq = time.perf_counter()
            manager.wait_quorum()
            wait_q = time.perf_counter() - tq
            loss.backward()
            if args.grads == "allreduce":
                allreduce(manager, list(model.parameters()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            tc = time.perf_counter()
            committed = manager.should_commit()
            commit_s = time.perf_counter() - tc
            if committed:
                inner.step()
            # pace the step's own work (not torchft's waits) as etcslurm paces its steps
            work = time.perf_counter() - t0 - wait_q - commit_s
            if work < args.min_step_seconds:
                time.sleep(args.min_step_seconds - work)
            step = manager.current_step()
            log("step", step=step, committed=committed, loss=float(loss),
                participants=manager.num_participants(), wait_quorum=wait_q,
                should_commit=commit_s, healed=bool(healed))
            if healed:
                log("heal", **healed)
                healed.clear()
            if committed:
                last_commit = step
            if leaving["flag"] and committed:
                log("leave", step=step)
                break
            if stop_at is None and stop_file.exists():
                text = stop_file.read_text().strip()
                stop_at = int(text) if text else None
            if stop_at is not None and last_commit is not None and last_commit >= stop_at:
                break
            if not math.isfinite(float(loss)):
                raise RuntimeError(f"loss is {loss}")
    finally:
        manager.shutdown(wait=False)
        log("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
