"""The ``fkv`` command line (also ``python -m fkv``).

Each subcommand lives in ``fkv.commands.<name>`` with ``add_parser(subparsers)`` and ``run(args)``;
modules are imported here only to build the parser, and keep torch out of their top level.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("show", "plan", "demo", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fkv", description="Paged KV-cache layouts, kernels and prefill->decode hand-off.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"fkv.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"fkv.commands.{name}":
                raise
            continue
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
