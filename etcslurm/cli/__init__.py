"""The ``etcslurm`` command line.

Each sub-command lives in its own module under ``etcslurm.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int``.
Modules import their heavy dependencies (torch, megatron-core) inside ``func`` so
``etcslurm --help`` stays fast.  User mistakes are :class:`~etcslurm.errors.EtcslurmError`
and become one line on stderr plus the documented exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from etcslurm.errors import EtcslurmError

# Order here is the order in `etcslurm --help`.
COMMAND_MODULES = (
    "demo",
    "plan",
    "layouts",
    "bench",
    "monitor",
    "metrics",
    "submit",
    "grow",
    "autogrow",
    "resize",
    "checkpoint",
    "coordinator",
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        name = self.prog.split(" ", 1)[1] if " " in self.prog else None
        sys.stderr.write(f"etcslurm {name}: {message}\n" if name else f"etcslurm: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="etcslurm",
        description="Checkpoint-free elastic training of Megatron-style LLMs on Slurm.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"etcslurm.cli.{name}")
        except ModuleNotFoundError as exc:  # a command not built yet
            if exc.name == f"etcslurm.cli.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("etcslurm: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
