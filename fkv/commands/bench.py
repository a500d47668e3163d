"""``fkv bench {write,convert,attention,transfer,plan} [--json PATH]``: run a benchmark module."""

from __future__ import annotations

import argparse
import importlib

BENCHES = ("write", "convert", "attention", "transfer", "plan")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="run a benchmark (GPU for kernels); JSON with --json",
                       description="Run one of fkv's benchmarks; extra arguments go to it.")
    p.add_argument("name", choices=BENCHES)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    return p


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"fkv.bench.{args.name}")
    return int(module.main(list(args.rest)) or 0)
