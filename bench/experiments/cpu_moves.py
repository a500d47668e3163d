"""Experiment: the staging path's moves on CPU (DRAM), per layer, by way of copying.

A decode rank on the staging path (a layout change, or NHD heads split across decode ranks) moves
each layer of a request from its staging buffer into its cache with the reference ``move`` when
the caches live in DRAM. This times one layer's move of 16 and 256 blocks (block size 16, 8 KV
heads of 128, bf16) for two pairings, by way of copying:

- ``torch index``: torch advanced indexing (``index`` / ``index_put_``), as the reference did
  before; a parallel region of torch's intra-op pool per call (``threads`` says how many);
- ``numpy tokens``: numpy fancy indexing token by token, a head's channels (NHD: the head
  range) as one opaque element, in chunks of 256 tokens;
- ``numpy blocks``: the default: equal block sizes, so each block moves as one slice;

and the staging path's loop over the 8 layers with the staging buffer's layer views built once
per read (now) or once per layer (before). Every variant's bytes are checked against the torch
path's. Medians of 20 calls, cache-warm (the same layer again) and over all 8 layers in turn.

    python bench/experiments/cpu_moves.py      # JSON to $OUT (or /tmp) as cpu-moves-exp.json
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

import _record  # bench/experiments/_record.py


def _median_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    import fkv
    from fkv.connector.handshake import EngineDesc, handshake
    from fkv.ops.reference import _convert as RC
    from fkv.ops.relayout import _check_move
    from fkv.tensors import wrap

    rows = []
    pairs = {"HND -> NHD, TP 1 -> 1": ("HND", "NHD", 1), "NHD, TP 1 -> 2": ("NHD", "NHD", 2)}
    for name, (pl, dl, dtp) in pairs.items():
        ps = fkv.KVCacheSpec(layout=pl, num_blocks=1024, block_size=16, num_kv_heads=8,
                             head_size=128, dtype="bfloat16", num_layers=8)
        ds = ps.evolve(layout=dl, num_kv_heads=8 // dtp)
        pe = EngineDesc(engine_id="P", tp_size=1, tp_rank=0, total_num_kv_heads=8, model="m")
        de = EngineDesc(engine_id="D", tp_size=dtp, tp_rank=0, total_num_kv_heads=8, model="m")
        plan = handshake((de, ds), (pe, ps)).plan
        assert plan.strategy == "staging", plan.strategy
        views = fkv.allocate(ds, "cpu")
        for v in views:
            v.normal_()
        rng = np.random.default_rng(0)
        for n in (16, 256):
            local, remote = rng.permutation(1024)[:n], rng.permutation(1024)[:n]
            staging = torch.randint(0, 255, (plan.staging_bytes(n),), dtype=torch.uint8)
            steps = plan.staging_steps(local, remote, num_tokens=n * 16)
            src_ids, dst_ids = torch.arange(remote.size), torch.as_tensor(local)
            mini = wrap(staging, steps[0].stage_spec, steps[0].stage_offset)
            moves = [_check_move(mini[s.layer], s.stage_spec, src_ids, views[s.layer], ds, dst_ids,
                                 src_heads=s.src_heads, dst_heads=s.dst_heads,
                                 num_tokens=s.num_tokens) for s in steps]
            base = [v.clone() for v in views]
            for m in moves:
                RC._run_torch(m)
            want = [v.clone() for v in views]

            def tokens(m):
                old = RC._BLOCK_BYTES
                RC._BLOCK_BYTES = 1 << 62
                try:
                    RC._run_numpy(m)
                finally:
                    RC._BLOCK_BYTES = old

            for how, run in (("torch index", RC._run_torch), ("numpy tokens", tokens),
                             ("numpy blocks", RC._run_numpy)):
                for v, b in zip(views, base):
                    v.copy_(b)
                for m in moves:
                    run(m)
                same = all(torch.equal(RC._as_int(a), RC._as_int(b)) for a, b in zip(views, want))
                it = iter(range(1 << 30))
                rows.append({"pair": name, "blocks": n, "how": how,
                             "threads": torch.get_num_threads() if how == "torch index" else 1,
                             "warm_ms": _median_ms(lambda: run(moves[0])),
                             "all_layers_ms": _median_ms(lambda: run(moves[next(it) % 8])),
                             "bytes_equal": same})
                print(rows[-1], flush=True)

            def loop(per_layer: bool) -> None:
                built = {}
                for s in steps:
                    key = (s.stage_spec, s.stage_offset)
                    if per_layer or key not in built:
                        built[key] = wrap(staging, s.stage_spec, s.stage_offset)
                    RC.move(built[key][s.layer], s.stage_spec, src_ids, views[s.layer], ds,
                            dst_ids, src_heads=s.src_heads, dst_heads=s.dst_heads,
                            num_tokens=s.num_tokens)

            for per_layer in (True, False):
                rows.append({"pair": name, "blocks": n,
                             "how": "8-layer loop, views " + ("per layer" if per_layer else
                                                              "once per read"),
                             "loop_ms": _median_ms(lambda: loop(per_layer), reps=10)})
                print(rows[-1], flush=True)
    _record.write("cpu-moves-exp.json", f"staging moves on CPU ({os.cpu_count()} cpus)", rows)


if __name__ == "__main__":
    main()
