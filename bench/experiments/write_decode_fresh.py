"""Experiment: is a 256-token ``write_kv`` decode (32 calls in a CUDA graph, rotating inputs)
slower than a plain copy of the same bytes into memory the graph has not written before?

The ninth and tenth sessions' floor, ``contiguous`` (the probe's copy of the inputs into one
contiguous buffer), writes the *same* 1 MiB every call: after the first call its lines are in L2
and each store hits. A decode write never does that: every step's tokens land in cache lines no
kernel touched since the last flush. Hypothesis: the 0.4 us between the library kernel (2.45-2.50
us) and that floor (2.07-2.11) is what writing fresh lines costs any kernel, scatter or not, so a
copy into a fresh buffer per call times like the library kernel.

Variants, each timed per call in a 32-call graph, forward and reverse order, under the three L2
states of ``write_decode_flush.py`` (``write``: do_bench's dirty 256 MB flush; ``read``: a clean
one; ``none``):

- ``empty``: a kernel of the same grid doing nothing (the graph node);
- ``contiguous-same``: the probe's floor, one destination for all 32 calls;
- ``contiguous-fresh``: the same kernel, call i writing its own destination (32 buffers);
- ``contiguous-cache``: the same kernel, call i writing a contiguous stretch of the cache
  itself (32 disjoint stretches of the 2 GiB allocation);
- ``fresh-kv-TxW``: a copy into the fresh buffers with K and V of T tokens in one program on W
  warps (T=1, W=4 is the library's fused decode tiling without the scatter); ``-slot``: and
  each store masked by the token's slot, loaded as the library loads it;
- ``default``: the library's ``write_kv``; ``engine-style``: the same-run engine-style kernel.

The process captures two throwaway graphs first (``settle_graphs``: the first graphs a process
captures replay faster for their whole life, tenth session).

    python bench/experiments/write_decode_fresh.py   # GPU; JSON to $OUT
"""

from __future__ import annotations

import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _record  # noqa: E402
import gpu_kernels_sweep as sweep  # noqa: E402
import write_decode_probe as probe  # noqa: E402
from write_decode_flush import FLUSH_BYTES, per_call_us  # noqa: E402

import fkv  # noqa: E402
from fkv.bench._common import settle_graphs  # noqa: E402
from fkv.bench.write import Shape, _inputs, _slot_sets  # noqa: E402


@triton.jit
def _copy_kernel(key_ptr, value_ptr, out_ptr, slot_ptr, num_tokens, TOK: tl.constexpr,
                 HEADS: tl.constexpr, D: tl.constexpr, SLOT: tl.constexpr):
    """TOK tokens' K and V rows per program (the library's fused decode tiling when TOK is 1);
    with SLOT, each token's slot is loaded too and its stores are masked by ``slot >= 0`` (the
    library's dependence of every store on the slot's load, without the scatter)."""
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)[:, None, None]
    off = tl.arange(0, HEADS)[None, :, None] * D + tl.arange(0, D)[None, None, :]
    k = tl.load(key_ptr + t * HEADS * D + off, eviction_policy="evict_first")
    v = tl.load(value_ptr + t * HEADS * D + off, eviction_policy="evict_first")
    if SLOT:
        ok = tl.load(slot_ptr + t) >= 0
    else:
        ok = t >= 0
    tl.store(out_ptr + t * HEADS * D + off, k.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + (num_tokens + t) * HEADS * D + off, v.to(out_ptr.dtype.element_ty),
             mask=ok)


def _copy(spec, k, v, dst, tiling=None, slots=None):
    """The probe's copy (a program per token and half, 2 warps), or ``_copy_kernel`` with
    ``tiling`` = (tokens per program, warps), loading ``slots`` when given."""
    def call():
        if tiling is None:
            probe._contiguous_kernel[(probe.TOKENS, 2)](k, v, dst, probe.TOKENS,
                                                        spec.num_kv_heads, spec.head_size,
                                                        num_warps=2)
        else:
            tok, warps = tiling
            _copy_kernel[(probe.TOKENS // tok,)](k, v, dst, k if slots is None else slots,
                                                 probe.TOKENS, tok, spec.num_kv_heads,
                                                 spec.head_size, slots is not None,
                                                 num_warps=warps)
    return call


def main() -> None:
    settle_graphs()
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    rows = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for layout in ("NHD", "HND"):
            shape = Shape()
            spec = fkv.KVCacheSpec(layout=layout, num_blocks=shape.num_blocks,
                                   block_size=shape.block_size, num_kv_heads=shape.heads,
                                   head_size=shape.head_size, dtype=dtype)
            cache = sweep.fkv_alloc(spec, "cuda")
            n = 2 * probe.TOKENS * spec.num_kv_heads * spec.head_size
            same = torch.empty(n, dtype=cache.dtype, device="cuda")
            fresh = [torch.empty(n, dtype=cache.dtype, device="cuda") for _ in range(probe.SETS)]
            flat = cache.as_strided((cache.untyped_storage().nbytes() // cache.element_size(),),
                                    (1,), 0)  # the allocation, whatever the layout's order
            stride = flat.numel() // probe.SETS  # 32 stretches spread over the allocation
            stretches = [flat[i * stride:i * stride + n] for i in range(probe.SETS)]
            scales = sweep._scales(spec, "cuda")
            kv = _inputs(spec, probe.TOKENS, probe.SETS, "cuda", seed=1)
            slots = _slot_sets("decode", probe.TOKENS, shape, probe.SETS, "cuda", seed=2)
            sets = [(k, v, s) for (k, v), s in zip(kv, slots)]
            # (the empty kernel's never-taken store wants a 16-bit pointer)
            lib = probe._variants(spec, cache, scales,
                                  torch.empty(1, dtype=torch.bfloat16, device="cuda"))
            makers = {
                "empty": lambda i, k, v, s: lib["empty"](k, v, s),
                "contiguous-same": lambda i, k, v, s: _copy(spec, k, v, same),
                "contiguous-fresh": lambda i, k, v, s: _copy(spec, k, v, fresh[i]),
                "contiguous-cache": lambda i, k, v, s: _copy(spec, k, v, stretches[i]),
                **{f"fresh-kv-{t}x{w}": (lambda t, w: lambda i, k, v, s:
                                        _copy(spec, k, v, fresh[i], (t, w)))(t, w)
                   for t, w in ((1, 4), (1, 8), (2, 8), (4, 8))},
                "fresh-kv-1x4-slot": lambda i, k, v, s: _copy(spec, k, v, fresh[i], (1, 4), s),
                "default": lambda i, k, v, s: lib["default"](k, v, s),
                "engine-style": lambda i, k, v, s: lib["engine-style"](k, v, s),
            }
            names = list(makers)
            got = {(m, f): [] for m in names for f in ("write", "read", "none")}
            for order in (names, names[::-1]):
                for name in order:
                    calls = [makers[name](i, *x) for i, x in enumerate(sets)]
                    for flush in ("write", "read", "none"):
                        got[name, flush].append(per_call_us(calls, flush, buf))
            for (name, flush), us in got.items():
                rows.append({"dtype": dtype, "layout": layout, "variant": name, "flush": flush,
                             "us": us})
                print(f"{dtype:14s} {layout} {name:17s} {flush:5s} {min(us):5.2f} "
                      f"({max(us):5.2f})", flush=True)
            del cache, kv, slots, sets, fresh, stretches, flat, lib, makers
            torch.cuda.empty_cache()
    _record.write("write-decode-fresh-exp.json", "write_decode_fresh", rows)


if __name__ == "__main__":
    main()
