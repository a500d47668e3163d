"""Benchmark fkv.ops.write_kv: ``python bench/bench_write.py [--json OUT.json] [--quick]``.

Thin wrapper over ``fkv.bench.write.main`` (also ``fkv bench write``); see that module.
"""

from __future__ import annotations

import sys

from fkv.bench.write import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
