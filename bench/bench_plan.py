"""Benchmark the pure handshake and plan segments: ``python bench/bench_plan.py [--json OUT.json]``.

Thin wrapper over ``fkv.bench.plan.main`` (also ``fkv bench plan``); see that module. CPU only.
"""

from __future__ import annotations

import sys

from fkv.bench.plan import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
