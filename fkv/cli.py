"""The ``fkv`` command line (also ``python -m fkv``).

Each subcommand lives in ``fkv.commands.<name>`` with ``add_parser(subparsers)`` and ``run(args)``;
modules are imported here only to build the parser, and keep torch out of their top level.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

COMMANDS = ("show", "plan", "demo", "bench")


# -- argparse ``type=`` validators shared by the commands and the benchmarks ------------------------
# A bad value is a usage error: argparse prints "argument --FLAG: <message>" and exits 2.

_WHAT = {1: "a positive integer", 0: "a non-negative integer"}
_PLURAL = {1: "positive integers", 0: "non-negative integers"}


def _int(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {_WHAT[least]} (got {text!r})") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {_WHAT[least]} (got {value})")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    return _int(text, 0)


def _float(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        what = "a finite positive number" if positive else "a finite number >= 0"
        raise argparse.ArgumentTypeError(f"must be {what} (got {text!r})")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0."""
    return _float(text, positive=True)


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    return _float(text, positive=False)


def _existing(text: str, folder: bool) -> Path:
    path = Path(text)
    if not (path.is_dir() if folder else path.is_file()):
        kind, other = ("folder", "file") if folder else ("file", "folder")
        what = f"a {other}" if path.exists() else f"no such {kind}"
        raise argparse.ArgumentTypeError(f"must be an existing {kind} (got {text!r}: {what})")
    return path


def existing_folder(text: str) -> Path:
    """A folder that exists (something to read)."""
    return _existing(text, folder=True)


def existing_file(text: str) -> Path:
    """A file that exists (something to read)."""
    return _existing(text, folder=False)


def _writable(folder: Path, text: str, what: str, named: str) -> None:
    """Refuse ``text`` (must be ``what``) when this user cannot create files in ``folder``."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"must be {what} this user can write (got {text!r}: "
                                         f"{named}{str(folder)!r} is not writable)")


def output_file(text: str) -> str:
    """A file to write, in a folder that exists (checked before any work, so a run never ends
    in a write that cannot happen). The text is returned unchanged."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a file to write, not a folder (got {text!r})")
    parent = path.parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"must be a file in an existing folder (got {text!r}: "
                                         f"{str(parent)!r} {what})")
    _writable(parent, text, "a file in a folder", "folder ")
    return text


def output_folder(text: str) -> str:
    """A folder to write into, created (with its parents) when missing: it must be a folder or
    not exist, below a writable folder. The text is returned unchanged."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("must be a folder (got '')")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a folder (got {text!r}: a file)")
    base = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"must be a folder fkv can create (got {text!r}: "
                                         f"{str(base)!r} is a file)")
    _writable(base, text, "a folder", "")
    return text


def int_list(least: int = 1) -> Callable[[str], list[int]]:
    """A comma list of ints, each >= ``least`` (1 or 0)."""
    def parse(text: str) -> list[int]:
        try:
            return [_int(t.strip(), least) for t in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be a comma list of {_PLURAL[least]} "
                                             f"(got {text!r})") from None
    return parse


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
    from fkv.errors import FkvError

    try:
        return int(args._run(args) or 0)
    except FkvError as e:  # bad input a command did not catch itself: a usage error, not a crash
        print(f"fkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # a benchmark's own parser (2 on usage errors, 0 on --help)
        if isinstance(e.code, str):  # what the interpreter does with SystemExit("message")
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
