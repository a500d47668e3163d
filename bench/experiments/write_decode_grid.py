"""Experiment: does a graph node cost less with fewer programs, and can a 256-token decode write
with fewer, larger programs get under issue 14's line in the steady state of torch's graphs?

``graph_state.py`` found that in the state engines' ``torch.cuda.graph`` replays settle in, an
empty kernel node of the write's grid (512 programs of 2 warps) costs 1.28-1.31 us and the
library's bf16 write 2.45-2.51 us per call, against the 2.2 target. Every tiling tried so far for
T=256 had one token per program. This times, in one process (torch's graphs only, 32 calls per
graph, do_bench's dirty 256 MB flush before each replay, median of 100 replays, three rounds):

- an empty kernel on grids of 1 to 512 programs, 1 and 4 warps (what the node itself costs);
- the library write forced to ``block_t`` = 1, 2, 4, 8 tokens per program on 2, 4 and 8 warps,
  K and V in one program (bf16) or a program per half (fp8), and the library default; each
  checked bit-exact against the reference before it is timed.

    python bench/experiments/write_decode_grid.py   # GPU; JSON to $OUT
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import _record  # noqa: E402
import gpu_kernels_sweep as sweep  # noqa: E402
from graph_state import _per_call_us  # noqa: E402

import fkv  # noqa: E402
from fkv.bench._common import capture_graph  # noqa: E402
from fkv.bench.write import Shape, _inputs, _slot_sets  # noqa: E402
from fkv.ops import reference  # noqa: E402
from fkv.ops import write as write_mod  # noqa: E402

TOKENS, SETS = 256, 32


@triton.jit
def _empty(x_ptr, n):
    if tl.program_id(0) >= n:  # never
        tl.store(x_ptr, 0)


def _time(calls, buf) -> list[float]:
    calls[0]()
    torch.cuda.synchronize()
    g = capture_graph(calls)
    return [_per_call_us(g.replay, len(calls), buf) for _ in range(3)]


def main() -> None:
    buf = torch.empty((256 << 20) // 4, dtype=torch.int32, device="cuda")
    out = torch.empty(1 << 20, device="cuda")
    rows = []
    for grid in (1, 8, 32, 66, 132, 264, 512):
        for warps in (1, 4):
            us = _time([lambda g=grid, w=warps: _empty[(g,)](out, 1 << 30, num_warps=w)] * 32,
                       buf)
            rows.append({"variant": "empty", "programs": grid, "warps": warps, "us": us})
            print(f"empty {grid:4d} x {warps} warps {min(us):.2f}/{max(us):.2f}", flush=True)
    shape = Shape()
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for layout in ("NHD", "HND"):
            spec = fkv.KVCacheSpec(layout=layout, num_blocks=shape.num_blocks,
                                   block_size=shape.block_size, num_kv_heads=shape.heads,
                                   head_size=shape.head_size, dtype=dtype)
            cache = sweep.fkv_alloc(spec, "cuda")
            ref = torch.empty_like(cache)
            scales = sweep._scales(spec, "cuda")
            kv = _inputs(spec, TOKENS, SETS, "cuda", seed=1)
            slots = _slot_sets("decode", TOKENS, shape, SETS, "cuda", seed=2)
            fused = not spec.is_fp8
            forced = [None] + [(write_mod.WriteTiling(bt, 8, 128, w), f)
                               for bt in (1, 2, 4, 8) for w in (2, 4, 8)
                               for f in ((True,) if fused else (False, True))
                               if not (spec.is_fp8 and bt == 8)]
            for choice in forced:
                def make(k, v, s, choice=choice):
                    def call():
                        if choice is None:
                            write_mod.write_kv(k, v, cache, s, spec, validate=False, **scales)
                        else:
                            with sweep._Forced(*choice):
                                write_mod.write_kv(k, v, cache, s, spec, validate=False,
                                                   **scales)
                    return call
                calls = [make(k, v, s) for (k, v), s in zip(kv, slots)]
                for c in (cache, ref):
                    c.view(torch.int8).fill_(-3)
                calls[0]()
                (k, v), s = kv[0], slots[0]
                reference.write_kv(k, v, ref, s, spec, validate=False, **scales)
                torch.cuda.synchronize()
                differing = int((cache.view(torch.int8) != ref.view(torch.int8)).sum())
                us = _time(calls, buf)
                name = "default" if choice is None else \
                    f"{tuple(choice[0])[:2] + (choice[0].num_warps,)}{' kv' if choice[1] else ''}"
                programs = None if choice is None else \
                    TOKENS // choice[0].block_t * (1 if choice[1] else 2)
                rows.append({"dtype": dtype, "layout": layout, "variant": name,
                             "programs": programs, "differing_bytes": differing, "us": us})
                print(f"{dtype[:6]} {layout} {name:18s} {min(us):.2f}/{max(us):.2f}"
                      f"{'' if not differing else f'  DIFFERS {differing}'}", flush=True)
            del cache, ref
            torch.cuda.empty_cache()
    _record.write("write-decode-grid-exp.json", "write_decode_grid", rows)


if __name__ == "__main__":
    main()
