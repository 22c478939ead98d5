"""``python -m etcslurm.testing.worker --faults JSON [worker options]``: the runtime worker
(:mod:`etcslurm.runtime.worker`, same options) with fault hooks built from ``JSON``
(:func:`etcslurm.testing.faults.hooks_from_json`).

The fault tests start it through the launcher
(``DemoOptions(worker_module="etcslurm.testing.worker", worker_args=("--faults", ...))``);
the product never reads test settings itself.
"""

from __future__ import annotations

import argparse
import json
import sys

from etcslurm.errors import EtcslurmError
from etcslurm.testing.faults import FAULT_KEYS, hooks_from_json, raising_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m etcslurm.testing.worker", add_help=False, allow_abbrev=False,
        description="The elastic worker with fault hooks (the other options are the "
                    "runtime worker's: python -m etcslurm.runtime.worker --help).")
    parser.add_argument("--faults", default="{}",
                        help=f"JSON object with keys from {', '.join(FAULT_KEYS)}")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        spec = json.loads(args.faults)
        hooks = hooks_from_json(spec)
        train_step = raising_step(spec.get("raise") if isinstance(spec, dict) else None)
    except json.JSONDecodeError as exc:
        sys.stderr.write(f"etcslurm test worker: --faults is not JSON: {exc}\n")
        return 2
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm test worker: {exc}\n")
        return exc.exit_code
    from etcslurm.runtime.worker import main as worker_main

    return worker_main(rest, hooks=hooks, train_step=train_step)


if __name__ == "__main__":
    from etcslurm.process_start import exit_without_teardown

    exit_without_teardown(main())
