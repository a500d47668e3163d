"""Benchmark prefill -> decode transfers: ``python bench/bench_transfer.py [--json OUT] [--quick]``.

Thin wrapper over ``fkv.bench.transfer.main`` (also ``fkv bench transfer``); see that module.
"""

from __future__ import annotations

import sys

from fkv.bench.transfer import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
