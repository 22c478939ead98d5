"""Worker entry point for :mod:`etcslurm.bench.launch`: connect to the launcher's store,
run the target function, write its JSON result."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass
class WorkerContext:
    """What a target function gets: its index, the process count, the long-lived store
    (use ``groups.configure`` for per-generation worlds on it) and the JSON config."""

    index: int
    nprocs: int
    store: dist.Store
    config: dict[str, Any]

    def publish(self, key: str, value: Any) -> None:
        """Progress for the launcher (JSON value under ``progress/<key>``)."""
        self.store.set(f"progress/{key}", json.dumps(value))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--nprocs", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    # a worker the launcher terminates (timeout) prints where it was stuck
    faulthandler.register(signal.SIGTERM, chain=True)
    with open(args.config) as fh:
        config = json.load(fh)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), is_master=False,
        timeout=timedelta(seconds=float(config.get("timeout", 120))),
    )
    module, _, name = args.target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        result = fn(WorkerContext(args.index, args.nprocs, store, config))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown (see below)
    with open(args.result + ".tmp", "w") as fh:
        json.dump(result if result is not None else {}, fh)
    os.replace(args.result + ".tmp", args.result)
    # leave without interpreter teardown: megatron's async-checkpoint objects and process
    # group destructors can block in the final garbage collection after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
