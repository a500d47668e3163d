"""Experiment: one layer's staging move in DRAM (the reference ``move``), warm and cold.

The CPU streaming bench (nhd-staging, P TP=1 -> D TP=2, NHD) profiled ``_run_staging`` at
about 1.2 ms per streamed layer of 16 blocks, where ``cpu_moves.py`` had timed the same size of
move at about 0.2 ms in one process, cache-warm. This times the decode rank's step alone: the
staging buffer of 16 or 256 whole NHD pages (8 heads of 128, bf16) moved into heads 0-3 of a
1024-block, 8-layer decode cache at random local blocks, split into the checks
(``_check_move``) and the copy (``_run``); ``warm``: the same layer again; ``cold``: 512 MiB of
another buffer written before each call; ``fresh layer``: each call the next layer of the cache
(as a streamed read does), caches otherwise warm. Median of 25 calls, one torch thread.

    python bench/experiments/staging_move.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import _record  # bench/experiments/_record.py
import fkv
from fkv.ops.reference import _convert as moves

REPS = 25


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    scratch = np.ones(512 << 20, dtype=np.uint8)
    rs = fkv.KVCacheSpec(layout="NHD", num_blocks=1024, block_size=16, num_kv_heads=8,
                         head_size=128, num_layers=8)
    ls = rs.evolve(num_kv_heads=4)
    caches = fkv.allocate(ls)
    for c in caches:
        c.view(torch.int16).random_()
    rng = np.random.default_rng(0)
    for nb in (16, 256):
        stage = rs.evolve(num_blocks=nb)
        staging = fkv.allocate(stage)
        for t in staging:
            t.view(torch.int16).random_()
        src_ids = torch.arange(nb)
        dst_ids = torch.as_tensor(rng.choice(1024, nb, replace=False))
        for state in ("warm", "cold", "fresh layer"):
            checks, copies = [], []
            for i in range(REPS + 3):
                layer = i % 8 if state == "fresh layer" else 3
                if state == "cold":
                    scratch += 1
                t0 = time.perf_counter()
                m = moves._check_move(staging[layer], stage, src_ids, caches[layer], ls,
                                      dst_ids, src_heads=(4, 8), dst_heads=(0, 4),
                                      num_tokens=nb * 16)
                t1 = time.perf_counter()
                moves._run(m)
                t2 = time.perf_counter()
                if i >= 3:
                    checks.append(t1 - t0)
                    copies.append(t2 - t1)
            row = {"blocks": nb, "state": state, "bytes": nb * 16 * 2 * 4 * 128 * 2,
                   "check_ms": 1e3 * statistics.median(checks),
                   "copy_ms": 1e3 * statistics.median(copies)}
            rows.append(row)
            print(row, flush=True)
    _record.write("staging-move-exp.json", "staging_move", rows)


if __name__ == "__main__":
    main()
