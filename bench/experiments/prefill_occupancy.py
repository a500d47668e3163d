"""Experiment: prefill B=4 x 4096 causal with tiles small enough for two programs per SM.

The default prefill tile is 256 rows on 8 warps, 5 stages (one program per SM: 255 registers a
thread, 161 KiB of shared memory). FlashAttention-3 overlaps one warpgroup's softmax with the
other's MMAs; two co-resident programs of 128 rows on 4 warps would let the SM's warp scheduler
do the same across programs, if registers (2 x 128 threads x <= 255) and shared memory (2 x
(Q + stages x K/V tiles) <= 227 KiB) allow two. This times such configurations, with and without
row halves, records registers, spills and shared memory of each compiled variant, and the same
run's default and cuDNN SDPA.

    python bench/experiments/prefill_occupancy.py   # GPU; CPU runs a tiny shape, no timing
    python bench/experiments/prefill_occupancy.py --wide   # 16 warps, 512 rows, 32-key tiles
The JSON goes to ``$OUT`` (or /tmp) as ``prefill-occupancy-exp.json`` (``prefill-wide-exp.json``).
"""

from __future__ import annotations

import sys

import attrs
import torch
import triton

import _record  # bench/experiments/_record.py (the script's own folder is on sys.path)


def main() -> None:
    import fkv.ops._attention_kernels as K
    from fkv.bench.attention import Problem, Shape
    from fkv.ops.attention import AttentionConfig

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    C = AttentionConfig
    configs = {"default": None}
    grid = ((32, 4, 2, 64), (32, 4, 1, 64), (32, 4, 2, 32), (32, 4, 3, 32), (64, 8, 2, 64),
            (64, 8, 3, 64))
    if "--wide" in sys.argv:  # more warps per tile, smaller key tiles (second GPU round)
        grid = ((64, 16, 5, 64), (64, 16, 3, 64), (128, 16, 3, 64), (64, 8, 5, 32),
                (64, 8, 4, 32))
    for bq, warps, stages, tile in grid:
        base = C(block_q=bq, heads_per_program=4, tile_n=tile, num_warps=warps,
                 num_stages=stages)
        configs[f"bq{bq} w{warps} s{stages} n{tile}"] = base
        configs[f"bq{bq} w{warps} s{stages} n{tile} halves"] = attrs.evolve(base, row_halves=True)
    rows = []
    for layout in ("NHD", "HND"):
        p = (Problem(Shape(), layout, 4, 4096, 4096, dev) if cuda
             else Problem(Shape(), layout, 1, 96, 96, dev))
        ref = p.kernel().clone()
        for name, cfg in configs.items():
            row = {"layout": layout, "variant": name}
            try:
                if cuda:  # only this variant's compiled kernel left to read registers from
                    K._paged_attention_kernel.device_caches.clear()
                out = p.kernel(cfg).clone()
                row["max_diff_vs_default"] = (out.float() - ref.float()).abs().max().item()
                if cuda:
                    row["ms"] = triton.testing.do_bench(lambda: p.kernel(cfg), rep=200,
                                                        return_mode="median")
                    row.update(_record.compiled(K._paged_attention_kernel))
            except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                row["error"] = _record.error(e)
            rows.append(row)
            print(row, flush=True)
        if cuda:
            rows.append(_record.cudnn_row(p, layout, 200))
        del p
    name = "prefill-wide-exp.json" if "--wide" in sys.argv else "prefill-occupancy-exp.json"
    _record.write(name, "prefill: two programs per SM", rows)

if __name__ == "__main__":
    main()
