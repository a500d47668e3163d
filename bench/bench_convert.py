"""Benchmark fkv.ops.convert / gather / scatter (CUDA): ``python bench/bench_convert.py --json OUT``.

A thin wrapper around ``fkv.bench.convert.main`` (also ``fkv bench convert``); see that module for
the cases, the baselines and the options (``--quick``, ``--sweep``, ``--cpu-smoke``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fkv.bench.convert import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
