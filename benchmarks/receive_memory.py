"""Gloo throughput into resident vs freshly allocated receive memory, 1 and 2 pairs.

    python benchmarks/receive_memory.py [--mbytes 512] [--repeat 3]

Four local processes (gloo over loopback); prints one table. Why it matters: the
migration's exchange receives into memory allocated for it (the new model is only built
after the exchange), and each page of fresh memory faults and is zeroed inside the
socket copy -- see docs/migration.md, "Why the transfer is 5-17x the bound".
"""

from __future__ import annotations

import argparse
import sys

from etcslurm.bench.launch import launch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=int, default=512, help="MiB per message")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many")
    args = ap.parse_args(argv)
    if args.mbytes < 1 or args.repeat < 1:
        ap.error("--mbytes and --repeat must be at least 1")
    result = launch("etcslurm.testing.synthetic:receive_memory", 4,
                    {"mbytes": args.mbytes, "repeat": args.repeat}, timeout=600)[0]
    print(f"| {args.mbytes} MiB per message, best of {args.repeat} | seconds | GB/s (all pairs) |")
    print("|---|---|---|")
    for name, row in result.items():
        print(f"| {name} | {row['seconds']:.3f} | {row['gbps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
