"""Experiment: one layer's staging move on CPU split between threads.

A staging read on CPU (DRAM) spends most of its time in the moves out of the staging buffer: at
32 layers and 2048 blocks on the 16-core host, 21 ms of move against 9 ms of copy per layer
(bench/NOTES.md, twenty-second session). The move is the numpy reference (``_run_numpy``),
single-threaded on purpose (torch's own pool would oversubscribe the cores a prefill shares). Do
numpy's slice copies release the GIL, so that a few plain threads, each moving a run of the
blocks, finish one layer's move in a fraction of the time?

NHD, 8 KV heads of 128, bf16, block size 16, TP 1 -> 2 (heads 0-3 of the whole pages): one layer
of ``n`` blocks from a staging mini-cache into random blocks of the cache, 1 thread and
``threads`` threads (each a ``reference.move`` of its run of blocks), bytes checked equal.
Medians of 15 calls; cold: each call takes the next of 8 layers.

    python bench/experiments/cpu_move_threads.py    # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os

import numpy as np
import torch

import _record  # bench/experiments/_record.py
from cpu_moves import _median_ms as _median_of  # bench/experiments/cpu_moves.py

_median_ms = functools.partial(_median_of, reps=15)


def main() -> None:
    import fkv
    from fkv.connector.handshake import EngineDesc, handshake
    from fkv.ops import reference
    from fkv.tensors import wrap

    rows = []
    layers = 8
    ps = fkv.KVCacheSpec(layout="NHD", num_blocks=4096, block_size=16, num_kv_heads=8,
                         head_size=128, dtype="bfloat16", num_layers=layers)
    ds = ps.evolve(num_kv_heads=4)
    pe = EngineDesc(engine_id="P", tp_size=1, tp_rank=0, total_num_kv_heads=8, model="m")
    de = EngineDesc(engine_id="D", tp_size=2, tp_rank=0, total_num_kv_heads=8, model="m")
    plan = handshake((de, ds), (pe, ps)).plan
    assert plan.strategy == "staging", plan.strategy
    views = fkv.allocate(ds, "cpu")
    rng = np.random.default_rng(0)
    pool = cf.ThreadPoolExecutor(8)
    for n in (256, 1024):
        local, remote = rng.permutation(4096)[:n], rng.permutation(4096)[:n]
        staging = torch.randint(0, 255, (plan.staging_bytes(n),), dtype=torch.uint8)
        steps = plan.staging_steps(local, remote, num_tokens=n * 16)
        mini = wrap(staging, steps[0].stage_spec, steps[0].stage_offset)
        src_ids, dst_ids = torch.arange(n), torch.as_tensor(local)

        def move(step, threads: int) -> None:
            def run(a: int, b: int) -> None:
                reference.move(mini[step.layer], step.stage_spec, src_ids[a:b], views[step.layer],
                               ds, dst_ids[a:b], src_heads=step.src_heads,
                               dst_heads=step.dst_heads, num_tokens=(b - a) * 16)

            if threads == 1:
                run(0, n)
                return
            edges = np.linspace(0, n, threads + 1).astype(int).tolist()
            for f in [pool.submit(run, a, b) for a, b in zip(edges, edges[1:])]:
                f.result()

        for v in views:
            v.zero_()
        for s in steps:
            move(s, 1)
        want = [v.clone() for v in views]
        for threads in (1, 2, 4, 8):
            for v in views:
                v.zero_()
            for s in steps:
                move(s, threads)
            same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                       for a, b in zip(views, want))
            it = iter(range(1 << 30))
            rows.append({"blocks": n, "threads": threads, "mib_per_layer": n * 32 / 1024,
                         "warm_ms": _median_ms(lambda: move(steps[0], threads)),
                         "next_layer_ms": _median_ms(
                             lambda: move(steps[next(it) % layers], threads)),
                         "bytes_equal": same})
            print(rows[-1], flush=True)
    pool.shutdown()
    _record.write("cpu-move-threads-exp.json",
                  f"one layer's staging move split between threads ({os.cpu_count()} cpus)", rows)


if __name__ == "__main__":
    main()
