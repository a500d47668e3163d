"""Benchmark fkv.ops.paged_attention: ``python bench/bench_attention.py [--json OUT.json] [--quick]``.

Thin wrapper over ``fkv.bench.attention.main`` (also ``fkv bench attention``); see that module.
"""

from __future__ import annotations

import sys

from fkv.bench.attention import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
