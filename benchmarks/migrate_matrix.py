"""P2P migration vs the dist_checkpointing baseline on ~100M-parameter GPT, 4 processes.

Prints one table: per transition the P2P time (plan + exchange + restore), the checkpoint
time (warm save + resharded load; the writer's one-off start-up reported apart), the
speedup, bytes moved, and the exchange time against its bound: max bytes received by any
rank ÷ measured pairwise bandwidth (rank 0 → 1, one 128 MiB message, best of 3, measured
in the same world right before the exchange), and the exchange against the plan's
transport alone (the same buffers through the same group, no pack/checksum/unpack/local
copies: `transport_only`).

    python benchmarks/migrate_matrix.py [--model gpt-125m] [--seq 64] [--repeat 2]
                                        [--json out.json] [--only N] [--write-results]

Every transition (and repetition) runs in ONE launch of the same processes, one after
another, as the suite's matrix does.

Every transition also checks bit-exactness (P2P result == checkpoint result) and loss
continuity (one step after either path: bit-identical losses).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from etcslurm.bench.driver import MigrateRequest, run_many

#: (from, to, leave, join, optimizer): every run uses 4 processes
TRANSITIONS = [
    ("tp2pp2dp1", "tp1pp2dp2", [], 0, "adam"),         # TP -> DP
    ("tp2pp2dp1", "tp4pp1dp1", [], 0, "adam"),         # PP -> TP
    ("tp1pp4dp1", "tp2pp2dp1", [], 0, "adam"),         # PP -> TP
    ("tp1pp2dp2", "tp2pp1dp2", [], 0, "adam"),         # PP <-> TP, DP kept
    ("tp2pp1dp2", "tp2pp1dp1", [2, 3], 0, "adam"),     # DP shrink: 2 ranks leave
    ("tp2pp1dp1", "tp2pp1dp2", [], 2, "adam"),         # DP grow: 2 ranks join
    ("tp2pp2dp1", "tp1pp2dp2", [], 0, "distributed"),  # TP -> DP, ZeRO-1 optimizer
]


def _ratio(value: float | None) -> str:
    return "–" if not value else f"{value:.2f}"


def _row(r: dict) -> list[str]:
    extra = (f" -{','.join(map(str, r['leave']))}" if r["leave"] else "") + (
        f" +{r['join']}" if r["join"] else "")
    return [
        f"{r['from']}→{r['to']}{extra}", r["optimizer"][:4], str(r["plan_path"]),
        f"{r['state_bytes'] / 2**30:.2f}", f"{r['moved_bytes'] / 2**30:.2f}",
        f"{r['p2p_seconds']:.2f}",
        f"{r['p2p_plan_seconds']:.2f}+{r['p2p_exchange_seconds']:.2f}+"
        f"{r['p2p_restore_seconds']:.2f}",
        f"{r['checkpoint_seconds']:.2f}",
        f"{r['checkpoint_save_seconds']:.2f}+{r['checkpoint_load_seconds']:.2f}",
        f"{r['speedup']:.1f}×", _ratio(r.get("exchange_vs_transport")),
        _ratio(r.get("exchange_vs_bound")),
        "yes" if r["bit_exact"] else "NO", "yes" if r["loss_match"] else "NO",
    ]


COLUMNS = ["transition", "opt", "path", "state GiB", "moved GiB", "P2P s",
           "(plan+exch+commit)", "ckpt s", "(save+load)", "speedup", "exch/transport",
           "exch/bound", "exact", "loss="]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2,
                    help="each transition this many times (medians), in the same processes")
    ap.add_argument("--staging-mb", type=int, default=512)
    ap.add_argument("--only", type=int, nargs="*", help="indices of TRANSITIONS to run")
    ap.add_argument("--json", default=None, help="also write all reports to this file")
    ap.add_argument("--write-results", action="store_true",
                    help="write docs/results/migrate_matrix.md")
    args = ap.parse_args(argv)
    console = Console()
    chosen = args.only if args.only else list(range(len(TRANSITIONS)))
    requests = []
    for i in chosen:
        src, dst, leave, join, opt = TRANSITIONS[i]
        requests.append(MigrateRequest(
            model=args.model, source=src, target=dst, leave=leave, join=join, optimizer=opt,
            repeat=args.repeat, seq=args.seq, steps_before=1, steps_after=1,
            staging_mb=args.staging_mb, verify_global=False, refit=False, timeout=900))
    t0 = time.perf_counter()
    console.print(f"{len(requests)} transitions x {args.repeat} in one launch of the same "
                  "processes ...")
    reports = run_many(requests)
    wall = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(reports, fh, indent=1)
    table = Table(title=f"{args.model} (seq {args.seq}), gloo on CPU, median of {args.repeat}")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("transition", "opt", "path") else "right")
    rows = [_row(r) for r in reports]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    speedups = [r["speedup"] for r in reports]
    summary = (f"speedup min {min(speedups):.1f}×, median {statistics.median(speedups):.1f}×; "
               f"the checkpoint writer's one-off start-up "
               f"{max(r['checkpoint_startup_seconds'] or 0 for r in reports):.1f} s apart; "
               f"wall {wall:.0f} s")
    console.print(summary)
    if args.write_results:
        from etcslurm.bench.results import markdown_table, write_results

        path = write_results(
            "migrate_matrix", markdown_table(COLUMNS, rows), reports,
            title=f"P2P migration vs megatron-core checkpoint resharding ({args.model})",
            notes=summary + "\n\nP2P = plan + exchange + commit (the scalars and the new "
                  "world's barrier), the new model built beforehand as the checkpoint path "
                  "builds its own before loading; checkpoint = warm save + resharded load.")
        console.print(f"wrote {path}")
    ok = all(r["bit_exact"] and r["loss_match"] for r in reports)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
