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

import json
import os
import pathlib
import sys

import attrs
import torch
import triton


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
                    for entry in K._paged_attention_kernel.device_caches.values():
                        for ck in entry[0].values():
                            row.update(n_regs=ck.n_regs, n_spills=ck.n_spills,
                                       shared=ck.metadata.shared)
            except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            rows.append(row)
            print(row, flush=True)
        if cuda:
            from torch.nn.attention import SDPBackend

            ms = triton.testing.do_bench(lambda: p.sdpa(SDPBackend.CUDNN_ATTENTION), rep=200,
                                         return_mode="median")
            rows.append({"layout": layout, "variant": "sdpa cudnn", "ms": ms})
            print(rows[-1], flush=True)
        del p
    name = "prefill-wide-exp.json" if "--wide" in sys.argv else "prefill-occupancy-exp.json"
    out = pathlib.Path(os.environ.get("OUT", "/tmp")) / name
    out.write_text(json.dumps({"experiment": "prefill: two programs per SM",
                               "device": torch.cuda.get_device_name() if cuda else "cpu",
                               "torch": torch.__version__, "triton": triton.__version__,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
