"""``fkv bench {write,convert,attention,transfer,plan} [...]``: run a benchmark (its result file
goes to bench/results/ unless ``--json PATH``); ``fkv bench report`` renders the README's tables
from those files (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib

BENCHES = ("write", "convert", "attention", "transfer", "plan", "report")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="run a benchmark (GPU for kernels), or render its tables (report)",
                       description="Run one of fkv's benchmarks (results to bench/results/), or "
                                   "'report' to render README tables from them; extra arguments "
                                   "go to it (e.g. fkv bench write --help).")
    p.add_argument("name", choices=BENCHES)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    return p


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"fkv.bench.{args.name}")
    return int(module.main(list(args.rest)) or 0)
