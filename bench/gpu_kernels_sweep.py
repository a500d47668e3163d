"""One H200 run for issue 14: write_kv tilings and paged_attention configurations, checked, timed
against same-run baselines, written as a result file (and raw JSON).

    PYTHONPATH=. python3 bench/gpu_kernels_sweep.py --out DIR   # the run (~4 min on an H200):
                          # bench/results/kernels-sweep-<UTC>.json (--json PATH, --results-dir,
                          # --no-save as every bench) and DIR/sweep.json (raw rows)
    PYTHONPATH=. python3 bench/gpu_kernels_sweep.py --only attention --out DIR --results-dir DIR
                          # issue 14 round 4: paged_attention only (~2-3 min on an H200)
    PYTHONPATH=. python3 bench/gpu_kernels_sweep.py --out DIR --cpu-smoke
                          # tiny shapes under TRITON_INTERPRET=1: the flow only (a result file
                          # only with --json or --results-dir)

Reading the attention part of the table: one line per case and layout (default vs the fastest
candidate, ratio to same-run SDPA: decode GB/s ratio, >= 0.92 wanted; prefill time ratio, <= 1.2
wanted), then "picks": per case the five fastest configs by the mean of their NHD and HND times
(``*`` marks the default; a label is the whole config: q<block_q>h<heads> n<tile_n> w<warps>
s<stages> x<splits>, " fm" fused merge, " r<n>" range stages, " lazy" lazy rescale), then
"knobs": per case the best ratio with a knob against the best without it. A default is a config
that is fastest (or within noise) in its case without losing another case; the raw rows
(DIR/sweep.json, "attention") keep every timing (``ms_passes``, ``ms_graph``) to check noise.

What it does, in order (every candidate is checked before it is timed):

1. Compiles every variant it will time in ``--jobs`` processes (tiny problems with the same
   specializations fill Triton's disk cache), warms the GPU up (``WARMUP_S`` of matmuls), then
   measures the copy and read ceilings.
2. ``write_kv`` (32768 blocks of 16 tokens, 8 heads x 128, one layer; bf16 and fp8 e4m3 fed bf16,
   NHD and HND): each candidate tiling (forced with ``fkv.ops.write._set_tiling_override``) is
   checked byte for byte against ``fkv.ops.reference.write_kv`` on poisoned caches, then timed:
   decode T = 256 (and 1, 16) per call inside one CUDA graph of 64 calls rotating inputs (random
   slots, ~8 % padding; 64 distinct input sets prepared before capture, so nothing but the 64
   kernels is replayed: per call = replay time / 64, replay timed by do_bench), and for the default
   and the baseline also with one input set in all 64 calls (L2-warm inputs, what a bench that
   replays one decode step measures); K and V in one program can be a candidate ("kv", none
   now); prefill T = 8192 and 65536 (runs of consecutive slots) in GB/s with
   do_bench. Same-run baseline: an engine-style kernel (one program per token, K and V of all heads
   in it, 16 warps: a re-implementation of the leading engine's Triton reshape-and-cache, not its
   code).
3. ``paged_attention`` (round 4, ``ROUND``) decode B=64 x 8192, 256 x 2048, 8 x 32768, 16 x 4096
   (Hq 32, Hkv 8, D 128, bf16, block 16, random block permutations with ONE padding column of
   garbage), both layouts: the default config (the fastest of four timings; also with no padding
   column, to show it costs nothing; and replayed from a CUDA graph) and the candidates of
   ``_decode_candidates`` (split counts, single- and double-buffered key tiles, the in-kernel split
   merge ``fused_merge``, GQA head chunks for small grids), forced with ``config=``; prefill B=4 x
   4096 causal the same way with ``PREFILL_CONFIGS`` (128-row tiles, 64/128-key tiles, stages,
   ``range_stages``, ``lazy_rescale``). Every candidate is checked against the default's output
   (the default against ``fkv.ops.reference`` and SDPA); fused merges also run 40 times and must
   give the same bits every time with all ticket counters back at 0. Candidates are then timed in
   two passes (forward, then reverse order; the default timed again between the passes) and the
   faster pass kept; decode candidates of small grids (B=8, B=16) also from a CUDA graph.
   Baseline: dense torch SDPA on the same values, the fastest backend that runs (flash,
   efficient, cudnn, default dispatch), timed before and after the candidates (the faster kept).
   GB/s = K+V bytes read once.
4. Prints a compact table, writes the ``kernels-sweep`` result file (``fkv.bench.results``: one
   case per timed row) and ``DIR/sweep.json`` (every raw number, per candidate).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

# -- shapes and candidates ------------------------------------------------------------------------
GPU = dict(num_blocks=32768, block_size=16, heads=8, head_size=128,
           decode=(256, 1, 16), prefill=(8192, 65536),
           attn=dict(hq=32, hkv=8, d=128, n=16,
                     decode=((64, 8192), (256, 2048), (8, 32768), (16, 4096)), prefill=(4, 4096)))
SMOKE = dict(num_blocks=64, block_size=16, heads=2, head_size=32,
             decode=(40, 1, 16), prefill=(200, 48),
             attn=dict(hq=4, hkv=2, d=32, n=16, decode=((2, 100), (1, 600)), prefill=(2, 40)))

# write_kv tilings to try at decode: (tokens per program, heads per program, warps[, "kv"]); "kv":
# K and V in one program (write._FUSE_KV_TOKENS). Defaults on 8 x 128 now (the 2026-12-02 probe,
# bench/experiments/write_decode_probe.py): bf16 (1, 8, 4, "kv") up to 256 tokens; fp8 (1, 8, 4).
# Before (the kernel then waited for the slot before loading its inputs): round 2 (us per call in a graph, NHD / HND): bf16 T=256
# 2 warps 2.45 / 2.79, 4 warps 2.76 / 2.75; T=16 4 warps 2.20 / 2.20 vs 2.28 / 2.27; fp8 8 warps
# won every T (T=256 2.87 / 2.85 vs 2.93 / 2.91 on 4); 2-token tiles and "kv" lost everywhere
# (0.1-0.9 us), dropped.
DECODE_TILINGS = [(1, 8, 2), (1, 8, 4), (1, 8, 8), (2, 8, 4), (2, 8, 8), (1, 8, 4, "kv"),
                  (1, 8, 8, "kv"), (1, 8, 16, "kv"), (2, 8, 8, "kv")]
SMALL_T_TILINGS = [(1, 8, 2), (1, 8, 4), (1, 8, 8), (1, 8, 4, "kv"), (1, 8, 8, "kv")]  # T = 1, 16
# prefill (None: the default; bf16 (16, 8, 8), fp8 (4, 8, 4)), per cache dtype. Round 2 GB/s NHD /
# HND: bf16 8192 tokens (16, 8, 8) 3017 / 2778, (8, 8, 8) 3035 / 2933, (4, 8, 2) 2960 / 2996;
# 65536 all within 1 % (3578-3662). fp8 (4, 8, 4) 2537 / 2525 and 3323 / 3309 vs the old (8, 8, 4)
# 2146 / 2140 and 3025 / 2970, (8, 8, 8) 2394 / 2401 and 3150 / 3136; (16, 8, 8) lost 15-25 %.
# (2, 8, 4) for fp8 is new (smaller tiles kept winning).
PREFILL_TILINGS = {"bfloat16": [None, (8, 8, 8), (4, 8, 2), (8, 8, 4)],
                   "float8_e4m3fn": [None, (8, 8, 4), (8, 8, 8), (2, 8, 4)]}

# paged_attention candidates (round 4). Decode: tiles (tile_n, num_warps, num_stages). Defaults
# now: grids of >= 132 programs before splitting (64, 2, 3), unsplit here; smaller grids
# (128, 4, 2), split to ~2 programs per SM (B=8 x 32768: 4, B=16 x 4096: 2). Round 2: (64, 2,
# 2/3/4) within 0.5 % of each other; (128, 4, 3), (128, 8, 2) and (64, 4, 2) never ahead; the old
# default (64, 4, 3) stays as a reference. Round 3 (ms NHD / HND): B=16 x 4096 default 0.0821 /
# 0.0820 (0.916 / 0.918 of SDPA; in a CUDA graph 0.0692 vs SDPA 0.0628), splits 3 0.084, 4 0.093,
# 1 0.095, (64, 2, 3) x 4 0.082 / 0.083: no tile or split count crossed 0.92.
# Why (compiled for sm_90a, Triton 3.9, on the CPU machine; TTGIR read): the block-table id load
# takes one pipeline stage of the key loop, so K/V get num_stages - 2 shared-memory buffers
# (at least 1): every decode tile above is single-buffered, each program waits a full memory
# latency per tile and only the programs resident on an SM overlap each other, which a small grid
# cannot supply. DEEP_DECODE_TILES are double-buffered ((64, 2, 5): 70 KB, 187 registers;
# (64, 4, 5): 141 registers; (128, 4, 5): 137 KB, one program per SM; (32, 2, 6): 37 KB).
# Round 4 also adds (_decode_candidates): the in-kernel split merge (``fused_merge``: no second
# kernel and launch gap), and for small grids (fewer than 2 programs per SM before splitting) GQA
# head chunks (``heads_per_program`` 2 or 1: more programs with fewer or no splits; the chunks of
# one KV head read the same pages at the same time, so the second read is an L2 hit).
DECODE_TILES = [(64, 4, 3), (64, 2, 3), (64, 2, 2), (128, 4, 2)]
DEEP_DECODE_TILES = [(64, 2, 5), (64, 4, 5), (128, 4, 5), (32, 2, 6)]
ALT_DECODE_TILE = {(64, 2, 3): (128, 4, 2), (128, 4, 2): (64, 2, 3)}
SMALL_GRID_HEADS = (2, 1)
# Prefill B=4 x 4096 causal (AttentionConfig fields; rows = block_q x heads_per_program). Default
# now 64 queries x 4 heads = 256 rows, 64 keys, 8 warps, 4 stages (round 3: 1.491 / 1.488 ms,
# 1.48 / 1.45x SDPA; 5 stages 1.435 / 1.433, the best; 3 stages 1.481; 128 rows = 32 x 4 on 4
# warps 1.513-1.529). Compiled for sm_90a (Triton 3.9, see above): the default has 2 K/V buffers
# and 255 registers (the cap), 5 stages 3 buffers (160 KB); 128 rows x 64 keys on 8 warps: 3
# buffers at 5 stages, 180 registers, 129 KB; 128 x 128 keys: 2 buffers at most (161 KB, 240
# registers); 128 rows on 4 warps: 255 registers. Never timed before round 4: 128-row tiles on 8
# warps (one head x 128 queries, 2 x 64, 4 x 32) with 64- and 128-key tiles, tl.range stages for
# the unmasked loop only (``range_stages``: "s3 r5" = masked loops 3, unmasked 5), and lazy
# rescaling (``lazy_rescale``, FlashAttention-4's conditional rescaling: the accumulator multiply
# skipped while no row max grew by > 8 in base 2; still pipelined, one block-wide max more per
# tile). Scores-ahead (the next tile's QK before this tile's softmax) was tried and dropped: Triton
# waits for that wgmma right after issuing it (only accumulator-chain dots stay asynchronous), so
# it cannot overlap the softmax.
PREFILL_CONFIGS = [
    dict(block_q=64, heads_per_program=4, tile_n=64, num_warps=8, num_stages=5),
    dict(block_q=64, heads_per_program=4, tile_n=64, num_warps=8, num_stages=5, lazy_rescale=True),
    dict(block_q=64, heads_per_program=4, tile_n=64, num_warps=8, num_stages=4, lazy_rescale=True),
    dict(block_q=64, heads_per_program=4, tile_n=64, num_warps=8, num_stages=3, range_stages=5),
    dict(block_q=128, heads_per_program=1, tile_n=64, num_warps=8, num_stages=5),
    dict(block_q=128, heads_per_program=1, tile_n=64, num_warps=8, num_stages=5, lazy_rescale=True),
    dict(block_q=128, heads_per_program=1, tile_n=64, num_warps=8, num_stages=4),
    dict(block_q=128, heads_per_program=1, tile_n=128, num_warps=8, num_stages=3),
    dict(block_q=128, heads_per_program=1, tile_n=128, num_warps=8, num_stages=3,
         lazy_rescale=True),
    dict(block_q=128, heads_per_program=1, tile_n=128, num_warps=8, num_stages=2),
    dict(block_q=128, heads_per_program=1, tile_n=64, num_warps=4, num_stages=3),
    dict(block_q=64, heads_per_program=2, tile_n=64, num_warps=8, num_stages=5),
    dict(block_q=64, heads_per_program=2, tile_n=128, num_warps=8, num_stages=3),
    dict(block_q=32, heads_per_program=4, tile_n=64, num_warps=8, num_stages=5),
    dict(block_q=32, heads_per_program=4, tile_n=64, num_warps=8, num_stages=5, lazy_rescale=True),
    dict(block_q=32, heads_per_program=4, tile_n=128, num_warps=8, num_stages=3),
]
#: sweep round (recorded in the raw rows and the result file)
ROUND = 4
#: GPU warm-up before the first timing (round 2's first timed case read 2.2x its repeat)
WARMUP_S = 0.4


def _log(msg: str) -> None:
    print(msg, flush=True)


# -- write_kv -------------------------------------------------------------------------------------
def _write_spec(shape: dict, layout: str, dtype: str) -> Any:
    import fkv

    return fkv.KVCacheSpec(layout=layout, num_blocks=shape["num_blocks"],
                           block_size=shape["block_size"], num_kv_heads=shape["heads"],
                           head_size=shape["head_size"], dtype=dtype)


def _tiling(spec: Any, cand: tuple | None) -> Any:
    """A candidate (tokens, heads, warps[, "kv"]) as a WriteTiling of ``spec`` (heads capped)."""
    from fkv.ops.write import WriteTiling

    if cand is None:
        return None
    import triton

    h_pad = triton.next_power_of_2(spec.num_kv_heads)
    return WriteTiling(cand[0], min(cand[1], h_pad), triton.next_power_of_2(spec.head_size), cand[2])


def _fused(cand: tuple | None) -> bool:
    return bool(cand) and len(cand) > 3 and cand[3] == "kv"


class _Forced:
    """Force a write tiling (None: the default) and whether K and V share a program, then undo."""

    def __init__(self, tiling: Any, fused: bool = False) -> None:
        self.tiling, self.fused = tiling, fused

    def __enter__(self) -> None:
        from fkv.ops import write as write_mod

        self.saved = write_mod._FUSE_KV_TOKENS, write_mod._FUSE_KV_TOKENS_FP8
        write_mod._FUSE_KV_TOKENS = write_mod._FUSE_KV_TOKENS_FP8 = 1 << 30 if self.fused else 0
        write_mod._set_tiling_override(self.tiling)

    def __exit__(self, *exc: Any) -> None:
        from fkv.ops import write as write_mod

        write_mod._FUSE_KV_TOKENS, write_mod._FUSE_KV_TOKENS_FP8 = self.saved
        write_mod._set_tiling_override(None)


def _slots(spec: Any, tokens: int, kind: str, count: int, device: str, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    n, nb = spec.block_size, spec.num_blocks
    out = []
    for _ in range(count):
        if kind == "prefill":
            start = int(torch.randint(0, n, (1,), generator=g))
            blocks = torch.randperm(nb, generator=g)[: (start + tokens + n - 1) // n]
            s = (blocks[:, None] * n + torch.arange(n)).flatten()[start:start + tokens]
        else:
            s = torch.randperm(nb * n, generator=g)[:tokens]
            s[torch.rand(tokens, generator=g) < 0.08] = -1  # CUDA-graph padding
        out.append(s.to(device))
    return out


def _kv_inputs(spec: Any, tokens: int, count: int, device: str, seed: int) -> list:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    shape = (tokens, spec.num_kv_heads, spec.head_size)
    return [(torch.randn(shape, generator=g, device=device).bfloat16() * 3,
             torch.randn(shape, generator=g, device=device).bfloat16() * 3) for _ in range(count)]


def _scales(spec: Any, device: str) -> dict:
    import torch

    if not spec.is_fp8:
        return {}
    return {"k_scale": torch.tensor([0.05], device=device),
            "v_scale": torch.tensor([0.04], device=device)}


class _Caches:
    """Two caches of one spec, poisoned with the same random bits before each check."""

    def __init__(self, spec: Any, device: str) -> None:
        import torch

        import fkv

        (self.a,), (self.b,) = fkv.allocate(spec, device=device), fkv.allocate(spec, device=device)
        self.ints = {1: torch.uint8, 2: torch.int16}[self.a.element_size()]

    def poison(self) -> None:
        self.a.view(self.ints).random_()
        self.b.view(self.ints).copy_(self.a.view(self.ints))

    def differing(self) -> int:
        return int((self.a.view(self.ints) != self.b.view(self.ints)).sum())


def _engine_call(spec: Any, cache: Any, key: Any, value: Any, slots: Any, scales: dict):
    """The same-run engine-style baseline (``fkv.bench._engine_style``)."""
    from fkv.bench._engine_style import engine_style_call

    return engine_style_call(spec, cache, key, value, slots, scales)


def _time_graph_us(calls: list, device: str, rep: int) -> float:
    if device == "cuda":
        from fkv.bench._common import graph_us

        return graph_us(calls, rep)
    from fkv.bench._common import time_ms

    i = [0]

    def one() -> None:
        calls[i[0] % len(calls)]()
        i[0] += 1
    return time_ms(one, rep, device) * 1e3


def _write_section(shape: dict, device: str, rep: int, quick: bool) -> list[dict]:
    import torch

    from fkv.bench._common import Cycle, time_ms
    from fkv.ops import reference
    from fkv.ops import write as write_mod

    rows: list[dict] = []
    decode_t = shape["decode"]
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for layout in ("NHD", "HND"):
            spec = _write_spec(shape, layout, dtype)
            scales = _scales(spec, device)
            caches = _Caches(spec, device)
            per_token = 2 * spec.num_kv_heads * spec.head_size

            def check(tokens: int, kind: str, tiling: Any, label: str, fused: bool = False) -> int:
                (k, v), = _kv_inputs(spec, tokens, 1, device, seed=7)
                (s,) = _slots(spec, tokens, kind, 1, device, seed=7)
                caches.poison()
                with _Forced(tiling, fused):
                    write_mod.write_kv(k, v, caches.a, s, spec, validate=False, **scales)
                reference.write_kv(k, v, caches.b, s, spec, validate=False, **scales)
                bad = caches.differing()
                if bad:
                    _log(f"MISMATCH write {label}: {bad} elements differ from the reference")
                return bad

            # -- decode: per call inside one CUDA graph of many calls ---------------------------
            for tokens in decode_t:
                cands = DECODE_TILINGS if tokens == decode_t[0] else SMALL_T_TILINGS
                if quick:
                    cands = cands[:3]
                count = 64 if device == "cuda" else 2
                sets = list(zip(_kv_inputs(spec, tokens, count, device, seed=1),
                                _slots(spec, tokens, "decode", count, device, seed=2)))
                default = write_mod.write_tiling(spec, tokens)
                seen = set()
                for cand in [None, *cands]:
                    tiling, fused = _tiling(spec, cand), _fused(cand)
                    key = (tuple(tiling or default), fused)
                    if key in seen:
                        continue
                    seen.add(key)
                    name = f"{tuple(tiling or default)}{' kv' if fused else ''}"
                    label = f"decode T={tokens} {layout} {dtype} {name}"
                    bad = check(tokens, "decode", tiling, label, fused)
                    with _Forced(tiling, fused):
                        calls = [(lambda k=k, v=v, s=s: write_mod.write_kv(
                            k, v, caches.a, s, spec, validate=False, **scales)) for (k, v), s in sets]
                        us = _time_graph_us(calls, device, rep)
                        # the same input set in every call: L2-warm inputs and cache lines (what
                        # a bench replaying one decode step measures)
                        warm = _time_graph_us(calls[:1] * len(calls), device, rep) \
                            if tiling is None else None
                    rows.append({"op": "write", "kind": "decode", "tokens": tokens, "layout": layout,
                                 "dtype": dtype, "variant": "default" if tiling is None else "candidate",
                                 "tiling": list(tiling or default), "fused_kv": fused,
                                 "graph_us_per_call": us, "warm_graph_us_per_call": warm,
                                 "mismatches": bad})
                    _log(f"  {label}{' (default)' if tiling is None else ''}: {us:.2f} us/call in a graph"
                         + (f" ({warm:.2f} with one input set)" if warm is not None else ""))
                # same-run engine-style baseline
                calls = [_engine_call(spec, caches.a, k, v, s, scales) for (k, v), s in sets]
                caches.poison()
                (k, v), s = sets[0]
                _engine_call(spec, caches.a, k, v, s, scales)()
                reference.write_kv(k, v, caches.b, s, spec, validate=False, **scales)
                bad = caches.differing()
                us = _time_graph_us(calls, device, rep)
                warm = _time_graph_us(calls[:1] * len(calls), device, rep)
                rows.append({"op": "write", "kind": "decode", "tokens": tokens, "layout": layout,
                             "dtype": dtype, "variant": "engine_style_baseline",
                             "graph_us_per_call": us, "warm_graph_us_per_call": warm,
                             "mismatches": bad})
                _log(f"  decode T={tokens} {layout} {dtype} engine-style baseline: {us:.2f} us/call "
                     f"({warm:.2f} with one input set)"
                     f"{f' ({bad} bytes differ: approximate fp8 division)' if bad else ''}")
                del sets, calls
            # -- prefill: GB/s with do_bench, inputs rotated beyond L2 ------------------------------
            for tokens in shape["prefill"]:
                nbytes = tokens * per_token * (2 + spec.itemsize)
                count = max(2, min(16, -(-(512 << 20) // nbytes))) if device == "cuda" else 2
                sets = list(zip(_kv_inputs(spec, tokens, count, device, seed=3),
                                _slots(spec, tokens, "prefill", count, device, seed=4)))
                default = write_mod.write_tiling(spec, tokens)
                prefill_cands = PREFILL_TILINGS[dtype]
                for cand in (prefill_cands[:2] if quick else prefill_cands):
                    tiling = _tiling(spec, cand)
                    if tiling is not None and tiling == default:
                        continue
                    label = f"prefill T={tokens} {layout} {dtype} {tuple(tiling or default)}"
                    bad = check(tokens, "prefill", tiling, label)
                    write_mod._set_tiling_override(tiling)
                    try:
                        cyc = Cycle(sets)

                        def call() -> None:
                            (k, v), s = cyc.next()
                            write_mod.write_kv(k, v, caches.a, s, spec, validate=False, **scales)
                        ms = time_ms(call, rep, device)
                    finally:
                        write_mod._set_tiling_override(None)
                    gbps = nbytes / ms / 1e6
                    rows.append({"op": "write", "kind": "prefill", "tokens": tokens,
                                 "layout": layout, "dtype": dtype,
                                 "variant": "default" if tiling is None else "candidate",
                                 "tiling": list(tiling or default), "ms": ms, "gbps": gbps,
                                 "bytes": nbytes, "mismatches": bad})
                    _log(f"  {label}{' (default)' if tiling is None else ''}: {gbps:.0f} GB/s")
                del sets
            del caches
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


# -- paged_attention ------------------------------------------------------------------------------
class _AttnProblem:
    """A filled paged cache, a random block table with ``pad`` garbage columns, queries, and the
    dense K/V of the same values (for SDPA and the cross-check)."""

    def __init__(self, a: dict, layout: str, batch: int, ctx: int, q_len: int, device: str,
                 pad: int = 1, dense: bool = True, seed: int = 0) -> None:
        import torch

        import fkv

        n = a["n"]
        need = -(-ctx // n)
        self.spec = fkv.KVCacheSpec(layout=layout, num_blocks=batch * need + 1, block_size=n,
                                    num_kv_heads=a["hkv"], head_size=a["d"], dtype="bfloat16")
        (self.cache,) = fkv.allocate(self.spec, device=device)
        torch.manual_seed(seed)
        self.cache.normal_()
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.spec.num_blocks, generator=g)[: batch * need].view(batch, need)
        garbage = torch.randint(-5, 1 << 20, (batch, pad), generator=g)
        self.tables = {p: torch.cat([perm, garbage[:, :p]], 1).to(torch.int32).to(device)
                       for p in sorted({0, pad})}
        self.block_table = self.tables[pad]
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.q = torch.randn(batch * q_len, a["hq"], a["d"], device=device, dtype=torch.bfloat16)
        self.qsl = None
        if q_len > 1:
            self.qsl = (torch.arange(batch + 1, device=device) * q_len).to(torch.int32)
        self.out = torch.empty_like(self.q)
        self.bytes = 2 * batch * ctx * a["hkv"] * a["d"] * 2
        self.batch, self.ctx, self.q_len, self.a = batch, ctx, q_len, a
        if dense:
            from fkv.ops.reference._attention import _keys_values

            keys, values = _keys_values(self.cache, self.spec)
            idx = perm.to(device).long()
            self.k = keys[idx].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            self.v = values[idx].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            self.qd = self.q.view(batch, q_len, a["hq"], a["d"]).transpose(1, 2).contiguous()

    def kernel(self, config: Any = None, table: Any = None, validate: bool = False) -> Any:
        from fkv.ops import paged_attention

        return paged_attention(self.q, self.cache, self.spec,
                               self.block_table if table is None else table, self.seq_lens,
                               query_start_loc=self.qsl, out=self.out, validate=validate,
                               config=config)

    def sdpa(self, backend: Any = None) -> Any:
        import torch.nn.functional as F

        if backend is None:
            return F.scaled_dot_product_attention(self.qd, self.k, self.v, is_causal=self.q_len > 1,
                                                  enable_gqa=True)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(self.qd, self.k, self.v,
                                                  is_causal=self.q_len > 1, enable_gqa=True)

    def sdpa_as_q(self, res: Any) -> Any:
        return res.transpose(1, 2).reshape(self.q.shape)


def _default_config(p: _AttnProblem) -> Any:
    from fkv.ops.attention import _num_sms

    return _shape_default(p.a, "prefill" if p.q_len > 1 else "decode", p.batch, p.ctx,
                          _num_sms(p.q.device), columns=p.block_table.shape[1])


def _shape_default(a: dict, kind: str, batch: int, ctx: int, num_sms: int,
                   columns: int | None = None) -> Any:
    """The launcher's default for a case (a block table of ``need + 1`` columns unless given)."""
    from fkv.ops.attention import attention_config

    if columns is None:
        columns = -(-ctx // a["n"]) + 1
    q_tokens = batch if kind == "decode" else batch * ctx
    return attention_config(num_seqs=batch, num_q_tokens=q_tokens, num_q_heads=a["hq"],
                            num_kv_heads=a["hkv"], head_size=a["d"],
                            max_context=columns * a["n"], itemsize=2, num_sms=num_sms,
                            varlen=kind != "decode")


def _cand_sms(device: str) -> int:
    """The SM count candidates are planned for: the GPU's; 2 under --cpu-smoke (the launcher's CPU
    count is 1), so that the smoke's 1-sequence case is a small grid and runs head chunks."""
    if device == "cuda":
        from fkv.ops.attention import _num_sms
        import torch

        return _num_sms(torch.device("cuda", torch.cuda.current_device()))
    return 2


def _label(cfg: Any) -> str:
    """A compact name of a whole config: q<block_q>h<heads> n<tile_n> w<warps> s<stages>
    x<splits>, then ' fm' (fused split merge), ' r<range_stages>' and ' lazy' (lazy rescale)
    when set."""
    out = (f"q{cfg.block_q}h{cfg.heads_per_program} n{cfg.tile_n} w{cfg.num_warps} "
           f"s{cfg.num_stages} x{cfg.num_splits}")
    if cfg.fused_merge and cfg.num_splits > 1:
        out += " fm"
    if cfg.range_stages:
        out += f" r{cfg.range_stages}"
    if cfg.lazy_rescale:
        out += " lazy"
    return out


def _decode_candidates(a: dict, default: Any, batch: int, ctx: int, num_sms: int,
                       quick: bool) -> list[Any]:
    """Decode configs to time against the default (see DECODE_TILES for the rounds)."""
    import attrs

    group = a["hq"] // a["hkv"]
    n = default.num_splits
    small = batch * a["hkv"] < 2 * num_sms  # fewer than 2 programs per SM before splitting
    seen = {default}
    out: list[Any] = []

    def add(base: Any = default, **kw: Any) -> None:
        cfg = attrs.evolve(base, **kw)
        if cfg.num_splits > 1 and ctx // cfg.num_splits < 256:
            return  # splits of fewer than 256 keys: never competitive, not timed
        if cfg.num_splits == 1 and cfg.fused_merge:
            cfg = attrs.evolve(cfg, fused_merge=False)
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)

    def tile(t: tuple) -> dict:
        return {"tile_n": t[0], "num_warps": t[1], "num_stages": t[2]}

    alt = ALT_DECODE_TILE.get((default.tile_n, default.num_warps, default.num_stages))
    # 1. split counts around the default's (default tile, second-kernel merge)
    for splits in sorted({1 if n < 4 else 2, max(1, n // 2), max(1, n - 1), n + 1, 2 * n} - {n}):
        add(num_splits=splits)
    # 2. every tile, single- and double-buffered, at the default's split count
    for t in DECODE_TILES + DEEP_DECODE_TILES:
        add(**tile(t))
    # 3. the other decode tile at twice the splits; double-buffered tiles of small grids at
    #    fewer and more splits (deeper buffers may need fewer programs per SM)
    if alt:
        add(**tile(alt), num_splits=2 * n)
    if small:
        for t in DEEP_DECODE_TILES:
            for splits in sorted({1 if n < 4 else 2, max(1, n // 2), 2 * n}):
                add(**tile(t), num_splits=splits)
    # 4. in-kernel split merge: every split config so far; unsplit defaults at 2 splits
    for cfg in [default, *out]:
        if cfg.num_splits > 1:
            add(cfg, fused_merge=True)
    if n == 1:
        for t in [None, alt, DEEP_DECODE_TILES[0]]:
            add(**(tile(t) if t else {}), num_splits=2, fused_merge=True)
    # 5. small grids: GQA head chunks (more programs without, or with fewer, splits)
    if small:
        for heads in SMALL_GRID_HEADS:
            if heads >= group:
                continue
            chunks = -(-group // heads)
            for t in [None, alt, DEEP_DECODE_TILES[0]]:
                kw = tile(t) if t else {}
                add(heads_per_program=heads, num_splits=1, **kw)
                add(heads_per_program=heads, num_splits=max(2, n // chunks), fused_merge=True,
                    **kw)
    return out[:8] if quick else out


def _prefill_candidates(default: Any, quick: bool) -> list[Any]:
    import attrs

    out = []
    for fields in PREFILL_CONFIGS[:4] if quick else PREFILL_CONFIGS:
        cfg = attrs.evolve(default, **fields)
        if cfg != default and cfg not in out:
            out.append(cfg)
    return out


def _attn_candidates(a: dict, kind: str, default: Any, batch: int, ctx: int, num_sms: int,
                     quick: bool) -> list[tuple[str, Any]]:
    cands = (_decode_candidates(a, default, batch, ctx, num_sms, quick) if kind == "decode"
             else _prefill_candidates(default, quick))
    return [(_label(c), c) for c in cands]


def _sdpa_times(p: _AttnProblem, want: Any, rep: int, device: str) -> dict[str, float]:
    import warnings

    from torch.nn.attention import SDPBackend

    from fkv.bench._common import time_ms

    times = {"default": time_ms(lambda: p.sdpa(), rep, device)}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = p.sdpa(backend).float()
        except RuntimeError:
            continue
        if (got - want).abs().max().item() <= 3e-2:
            times[name] = time_ms(lambda b=backend: p.sdpa(b), rep, device)
    return times


def _graph_ms(fn: Any, rep: int, device: str) -> float | None:
    """ms per call of ``fn`` replayed from a CUDA graph (run once on the capture stream first, so
    a fused merge's counters exist for that stream before capture)."""
    if device != "cuda":
        return None
    from fkv.bench._common import graph_us

    return graph_us([fn], rep) / 1e3


def _stress(p: _AttnProblem, cfg: Any, runs: int) -> int:
    """Runs ``cfg`` ``runs`` times back to back; the number of outputs that differ bit for bit
    from the first (a fused merge is deterministic: any difference is a race)."""
    import torch

    first = p.kernel(config=cfg).clone()
    outs = [p.kernel(config=cfg).clone() for _ in range(runs)]
    return sum(not torch.equal(o, first) for o in outs)


def _counters_clean() -> bool:
    from fkv.ops.attention import _MERGE_COUNTERS

    return all(int(c.abs().sum()) == 0 for c in _MERGE_COUNTERS.values())


def _attention_section(shape: dict, device: str, rep: int, quick: bool) -> list[dict]:
    import attrs
    import torch

    from fkv.bench._common import time_ms
    from fkv.ops import reference
    a = shape["attn"]
    rows: list[dict] = []
    cases = [("decode", b, ctx) for b, ctx in a["decode"]] + [("prefill", *a["prefill"])]
    stress_runs = 40 if device == "cuda" else 2
    for kind, batch, ctx in cases:
        for layout in ("NHD", "HND"):
            q_len = 1 if kind == "decode" else ctx
            p = _AttnProblem(a, layout, batch, ctx, q_len, device)
            name = f"{kind} B={batch} x {ctx} {layout}"
            default = _default_config(p)
            got = p.kernel(validate=True).float().clone()
            ref = reference.paged_attention(p.q, p.cache, p.spec, p.block_table, p.seq_lens,
                                            query_start_loc=p.qsl).float()
            dense = p.sdpa_as_q(p.sdpa()).float()
            err_ref = (got - ref).abs().max().item()
            err_sdpa = (got - dense).abs().max().item()
            del ref, dense
            if err_ref > 3e-2 or err_sdpa > 3e-2 or not torch.isfinite(got).all():
                _log(f"MISMATCH {name}: |kernel - reference| {err_ref:.3g}, |kernel - SDPA| "
                     f"{err_sdpa:.3g}")
            sdpa = _sdpa_times(p, p.sdpa().float(), rep, device)
            best_sdpa = min(sdpa, key=sdpa.get)
            sdpa_ms = sdpa[best_sdpa]
            # timed twice, the faster kept (round 2: one first timing read 2.2x its repeat)
            ms_first = time_ms(lambda: p.kernel(), rep, device)
            ms_repeat = time_ms(lambda: p.kernel(), rep, device)
            row = {"op": "attention", "round": ROUND, "kind": kind, "batch": batch, "ctx": ctx,
                   "group": a["hq"] // a["hkv"], "layout": layout, "variant": "default",
                   "label": _label(default),
                   "config": attrs.asdict(default),
                   "ms_first": ms_first, "ms_repeat": ms_repeat, "bytes": p.bytes,
                   "sdpa_backend": best_sdpa, "sdpa_ms_by_backend": sdpa,
                   "max_err_vs_reference": err_ref, "max_err_vs_sdpa": err_sdpa}
            if kind == "decode":
                nopad = p.tables[0]
                row["ms_no_padding_column"] = time_ms(lambda: p.kernel(table=nopad), rep, device)
                row["config_no_padding_column"] = attrs.asdict(
                    _default_config_for_table(p, nopad))
            if device == "cuda":
                row["ms_graph"] = _graph_ms(lambda: p.kernel(), rep, device)
                if best_sdpa != "default":
                    from torch.nn.attention import SDPBackend

                    backend = getattr(SDPBackend, best_sdpa)
                    row["sdpa_ms_graph"] = _graph_ms(lambda: p.sdpa(backend), rep, device)
                else:
                    row["sdpa_ms_graph"] = _graph_ms(lambda: p.sdpa(), rep, device)
            _log(f"  {name} default {_cfg(default)}: {min(ms_first, ms_repeat):.4f} ms, SDPA "
                 f"{best_sdpa} {sdpa_ms:.4f} ms"
                 + (f", no padding column {row['ms_no_padding_column']:.4f} ms"
                    if kind == "decode" else ""))
            # small grids (< 2 programs per SM before splitting): candidates also from a CUDA graph
            small_grid = batch * a["hkv"] < 2 * _cand_sms(device)
            # candidates: checked against the default's output, then timed in two passes (forward,
            # then reverse order, the default again in between) and the faster pass kept
            cand_rows = []
            for label, cfg in _attn_candidates(a, kind, default, batch, ctx, _cand_sms(device),
                                               quick):
                cand = {"op": "attention", "round": ROUND, "kind": kind, "batch": batch,
                        "ctx": ctx, "group": a["hq"] // a["hkv"], "layout": layout,
                        "variant": label, "label": label,
                        "config": attrs.asdict(cfg)}
                try:
                    err = (p.kernel(config=cfg).float() - got).abs().max().item()
                    if cfg.fused_merge and cfg.num_splits > 1:
                        cand["stress_runs"] = stress_runs
                        cand["stress_differing"] = _stress(p, cfg, stress_runs)
                        cand["counters_clean"] = _counters_clean()
                except Exception as e:  # a config that does not fit (registers, shared memory)
                    cand["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(cand)
                    _log(f"    {label}: {cand['error']}")
                    continue
                cand["max_err_vs_default"] = err
                if err > 3e-2 or cand.get("stress_differing") or \
                        cand.get("counters_clean") is False:
                    cand["error"] = (f"MISMATCH vs the default's output ({err:.3g})" if err > 3e-2
                                     else "fused merge: runs differ or counters left nonzero")
                    _log(f"    {label}: {cand['error']}")
                cand_rows.append((cand, cfg))
            half = max(1, rep // 2)
            for order in (cand_rows, cand_rows[::-1]):
                for cand, cfg in order:
                    cand.setdefault("ms_passes", []).append(
                        time_ms(lambda c=cfg: p.kernel(config=c), half, device))
                row.setdefault("ms_between_passes", []).append(
                    time_ms(lambda: p.kernel(), half, device))
            # the default: the fastest of its four timings; SDPA timed again after the passes,
            # the faster kept (drift over the candidates' passes cannot favour either side)
            ms = min(ms_first, ms_repeat, *row["ms_between_passes"])
            if device == "cuda":
                from torch.nn.attention import SDPBackend

                backend = getattr(SDPBackend, best_sdpa, None) if best_sdpa != "default" else None
                row["sdpa_ms_after"] = time_ms(lambda: p.sdpa(backend), rep, device)
                sdpa_ms = min(sdpa_ms, row["sdpa_ms_after"])
            del p.k, p.v, p.qd
            row |= {"ms": ms, "gbps": p.bytes / ms / 1e6, "sdpa_ms": sdpa_ms}
            if kind == "decode":
                row["ratio_vs_sdpa"] = sdpa_ms / ms  # GB/s ratio (same bytes)
            else:
                row["ratio_time_vs_sdpa"] = ms / sdpa_ms
                flops = 4 * batch * a["hq"] * a["d"] * ctx * (ctx + 1) / 2
                row["tflops"], row["sdpa_tflops"] = flops / ms / 1e9, flops / sdpa_ms / 1e9
            _log(f"  {name} default {_label(default)}: {ms:.4f} ms, SDPA {sdpa_ms:.4f} ms, ratio "
                 f"{row.get('ratio_vs_sdpa', row.get('ratio_time_vs_sdpa')):.3f}")
            for cand, cfg in cand_rows:
                cms = min(cand["ms_passes"])
                cand |= {"ms": cms, "gbps": p.bytes / cms / 1e6, "speedup_vs_default": ms / cms}
                cand["ratio_vs_sdpa" if kind == "decode" else "ratio_time_vs_sdpa"] = (
                    sdpa_ms / cms if kind == "decode" else cms / sdpa_ms)
                if device == "cuda" and kind == "decode" and small_grid:
                    cand["ms_graph"] = _graph_ms(lambda c=cfg: p.kernel(config=c), half, device)
                rows.append(cand)
                ratio = cand.get("ratio_vs_sdpa", cand.get("ratio_time_vs_sdpa"))
                _log(f"    {cand['label']}: {cms:.4f} ms x{ms / cms:.3f} vs default, "
                     f"{ratio:.3f} SDPA" + (f" graph {cand['ms_graph']:.4f}"
                                           if cand.get("ms_graph") else "")
                     + (f"  {cand['error']}" if "error" in cand else ""))
            rows.append(row)
            del p
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _default_config_for_table(p: _AttnProblem, table: Any) -> Any:
    old = p.block_table
    p.block_table = table
    try:
        return _default_config(p)
    finally:
        p.block_table = old


def _cfg(cfg: Any) -> str:
    return (f"(q {cfg.block_q} x h {cfg.heads_per_program}, tile {cfg.tile_n}, splits "
            f"{cfg.num_splits}, warps {cfg.num_warps}, stages {cfg.num_stages}"
            + (", fused merge" if cfg.fused_merge and cfg.num_splits > 1 else "")
            + (f", range stages {cfg.range_stages}" if cfg.range_stages else "") + ")")


def _warm_up(device: str, seconds: float) -> None:
    """Keep the GPU busy for ``seconds`` (bf16 matmuls) so that clocks and power state settle
    before the first timing."""
    if device != "cuda" or seconds <= 0:
        return
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()


# -- parallel precompile --------------------------------------------------------------------------
def _compile_task(task: tuple) -> str:
    """Run each variant once on a tiny problem with the same specializations (fills the disk
    cache of Triton, so the timing process only loads compiled kernels)."""
    kind, smoke, items = task
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    shape = SMOKE if smoke else GPU
    device = "cpu" if smoke else "cuda"
    errors = []
    if kind == "write":
        from fkv.ops import write as write_mod

        for layout, dtype, cand, tokens in items:
            # a 64-block cache has the run's strides (num_slots is not specialized); the tiling
            # is the one the run's T gets, forced on fewer tokens
            spec = _write_spec(dict(shape, num_blocks=64), layout, dtype)
            tiling = _tiling(spec, cand) or write_mod.write_tiling(spec, tokens)
            tokens = min(tokens, 64 * spec.block_size)
            (k, v), = _kv_inputs(spec, tokens, 1, device, seed=0)
            (s,) = _slots(spec, tokens, "decode", 1, device, seed=0)
            try:
                with _Forced(tiling, _fused(cand)):
                    write_mod.write_kv(k, v, fkv_alloc(spec, device), s, spec, validate=False,
                                       **_scales(spec, device))
                if cand is None:
                    _engine_call(spec, fkv_alloc(spec, device), k, v, s, _scales(spec, device))()
            except Exception as e:
                errors.append(f"{layout} {dtype} {cand}: {str(e)[:160]}")
    else:
        a = shape["attn"]
        for layout, what, fields in items:
            from fkv.ops.attention import AttentionConfig

            q_len = 1 if what == "decode" else 40
            # table width 33 blocks: like the runs' widths (need + 1 column), not divisible by 16
            p = _AttnProblem(a, layout, 2, 32 * a["n"] if not smoke else 100, q_len, device,
                             dense=False)
            try:
                p.kernel(config=AttentionConfig(**fields) if fields else None)
            except Exception as e:
                errors.append(f"{layout} {what} {fields}: {str(e)[:160]}")
    if device == "cuda":
        torch.cuda.synchronize()
    return f"compiled {kind} {len(items)} variants" + (f"; errors: {errors}" if errors else "")


def fkv_alloc(spec: Any, device: str) -> Any:
    import fkv

    return fkv.allocate(spec, device=device)[0]


def _compile_tasks(shape: dict, smoke: bool, quick: bool) -> list[tuple]:
    write_items = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for layout in ("NHD", "HND"):
            decode = DECODE_TILINGS + [c for c in SMALL_T_TILINGS if c not in DECODE_TILINGS]
            for cand in [None, *(decode[:3] if quick else decode)]:
                write_items.append((layout, dtype, cand, shape["decode"][0]))
            for tokens in shape["decode"][1:]:  # the defaults of the small T (another class)
                write_items.append((layout, dtype, None, tokens))
            for cand in PREFILL_TILINGS[dtype][:2] if quick else PREFILL_TILINGS[dtype]:
                write_items.append((layout, dtype, cand, shape["prefill"][0]))
    attn_items = []
    for layout in ("NHD", "HND"):
        for kind, fields in _attn_compile_variants(shape, smoke, quick):
            attn_items.append((layout, kind, fields))
    tasks = [("write", smoke, write_items[i:i + 4]) for i in range(0, len(write_items), 4)]
    tasks += [("attn", smoke, [item]) for item in attn_items]
    return tasks


def _attn_compile_variants(shape: dict, smoke: bool, quick: bool) -> list[tuple[str, dict]]:
    """One (kind, config fields) per compiled variant the attention section will run: the
    defaults and every candidate of every case, split counts folded to 2 (the SPLIT variant) or 1
    (only constexprs matter; the tiny compile problem holds at least 2 tiles of any tile_n)."""
    import attrs

    a = shape["attn"]
    num_sms = _cand_sms("cpu" if smoke else "cuda")
    cases = [("decode", b, ctx) for b, ctx in a["decode"]] + [("prefill", *a["prefill"])]
    seen, out = set(), []
    for kind, batch, ctx in cases:
        default = _shape_default(a, kind, batch, ctx, 1 if smoke else num_sms)
        for cfg in [default] + [c for _, c in _attn_candidates(a, kind, default, batch, ctx,
                                                               num_sms, quick)]:
            cfg = attrs.evolve(cfg, num_splits=min(cfg.num_splits, 2))
            if cfg.num_splits == 1:
                cfg = attrs.evolve(cfg, fused_merge=False)
            if (kind, cfg) not in seen:
                seen.add((kind, cfg))
                out.append((kind, attrs.asdict(cfg)))
    return out


def _precompile(tasks: list[tuple], jobs: int) -> float:
    import multiprocessing

    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(max(1, min(jobs, len(tasks)))) as pool:
        for msg in pool.imap_unordered(_compile_task, tasks):
            if "errors" in msg:
                _log(msg)
    return time.perf_counter() - start


# -- result file (fkv.bench.results) -------------------------------------------------------------
def _result_run(result: dict, args: Any, device: str) -> Any:
    """The sweep as a ``kernels-sweep`` result file: one case per timed row (its config in
    ``params``, its figures in ``metrics``), the same-run ceilings, the raw rows in ``extra``."""
    from fkv.bench import results

    run = results.Run("kernels-sweep", device=device,
                      config={"round": ROUND, "quick": args.quick, "only": args.only,
                              "cpu_smoke": args.cpu_smoke, "rep_ms": args.rep})
    run.ceiling("copy_gbps", result["copy_ceiling_gbps"])
    run.ceiling("read_gbps", result["read_ceiling_gbps"])
    for r in result["write"]:
        tiling = r.get("tiling")
        ident = (f"write {r['kind']} T={r['tokens']} {r['layout']} {r['dtype']} {r['variant']}"
                 + (f" {tuple(tiling)}" if tiling else "") + (" kv" if r.get("fused_kv") else ""))
        params = {"op": "write", "kind": r["kind"], "tokens": r["tokens"], "layout": r["layout"],
                  "dtype": r["dtype"], "variant": r["variant"], "fused_kv": bool(r.get("fused_kv"))}
        if tiling:
            params["tiling"] = list(tiling)
        metrics = {"mismatch_count": r.get("mismatches", 0)}
        if r["kind"] == "decode":
            metrics["graph_per_call_us"] = r["graph_us_per_call"]
            metrics["warm_graph_per_call_us"] = r.get("warm_graph_us_per_call")
        else:
            metrics |= {"kernel_ms": r["ms"], "gbps": r["gbps"], "moved_bytes": r["bytes"]}
        run.add(ident, params=params, metrics=metrics,
                error="MISMATCH vs the reference" if r.get("mismatches") else "")
    for r in result["attention"]:
        cfg = r.get("config", {})
        ident = f"attention {r['kind']} B={r['batch']} x {r['ctx']} {r['layout']} {r['variant']}"
        params = {"op": "attention", "kind": r["kind"], "batch": r["batch"], "ctx": r["ctx"],
                  "layout": r["layout"], "variant": r["variant"], **cfg}
        metrics = {k2: r.get(k1) for k1, k2 in (
            ("ms", "kernel_ms"), ("gbps", "gbps"), ("sdpa_ms", "sdpa_ms"),
            ("ratio_vs_sdpa", "ratio_vs_sdpa_x"), ("ratio_time_vs_sdpa", "time_vs_sdpa_x"),
            ("ms_first", "first_ms"), ("ms_repeat", "repeat_ms"), ("ms_graph", "graph_ms"),
            ("sdpa_ms_graph", "sdpa_graph_ms"),
            ("ms_no_padding_column", "no_padding_column_ms"), ("tflops", "kernel_tflops"),
            ("sdpa_tflops", "sdpa_tflops"), ("speedup_vs_default", "speedup_vs_default_x"),
            ("max_err_vs_reference", "vs_reference_err"), ("max_err_vs_sdpa", "vs_sdpa_err"),
            ("max_err_vs_default", "vs_default_err"), ("sdpa_ms_after", "sdpa_after_ms"),
            ("stress_differing", "stress_differing_count")) if k1 in r}
        extra = {k: r[k] for k in ("sdpa_backend", "sdpa_ms_by_backend", "config_no_padding_column",
                                   "ms_passes", "ms_between_passes", "label", "round",
                                   "stress_runs", "counters_clean")
                 if k in r}
        run.add(ident, params=params, metrics=metrics, error=r.get("error", ""), extra=extra)
    run.extra["seconds"] = result.get("seconds")
    run.extra["precompile_s"] = result.get("precompile_s")
    run.extra["table"] = _table(result)
    return run


# -- report ---------------------------------------------------------------------------------------
def _table(result: dict) -> str:
    lines = [f"== issue 14 sweep on {result['env']['device']} (torch {result['env']['torch']}, "
             f"triton {result['env']['triton']}); copy {result['copy_ceiling_gbps']:.0f} GB/s, "
             f"read {result['read_ceiling_gbps']:.0f} GB/s; {result['seconds']:.0f} s"]
    writes = [r for r in result["write"]]
    if writes:
        lines.append("write_kv decode, us per call in a CUDA graph (target bf16 <= 2.2, fp8 <= 2.5):")
        for key in sorted({(r["tokens"], r["layout"], r["dtype"]) for r in writes
                           if r["kind"] == "decode"}):
            grp = [r for r in writes if r["kind"] == "decode" and
                   (r["tokens"], r["layout"], r["dtype"]) == key]
            dflt = next(r for r in grp if r["variant"] == "default")
            base = next((r for r in grp if r["variant"] == "engine_style_baseline"), None)
            best = min((r for r in grp if r["variant"] != "engine_style_baseline"),
                       key=lambda r: r["graph_us_per_call"])
            def name(r: dict) -> str:
                return f"{tuple(r['tiling'])}{' kv' if r.get('fused_kv') else ''}"

            def warm(r: dict | None) -> str:
                w = r and r.get("warm_graph_us_per_call")
                return f" (one set {w:.2f})" if w else ""
            lines.append(f"  T={key[0]:<4d} {key[1]} {key[2]:13s} default {dflt['graph_us_per_call']:5.2f}"
                         f"{warm(dflt)} {name(dflt)}  best {best['graph_us_per_call']:5.2f} "
                         f"{name(best)}  engine-style {base['graph_us_per_call'] if base else 0:5.2f}"
                         f"{warm(base)}"
                         + ("  MISMATCH" if any(r.get("mismatches") for r in grp
                                                if r["variant"] != "engine_style_baseline") else ""))
        lines.append("write_kv prefill GB/s (must hold 65536 ~3650, 8192 ~2900 bf16):")
        for key in sorted({(r["tokens"], r["layout"], r["dtype"]) for r in writes
                           if r["kind"] == "prefill"}):
            grp = [r for r in writes if r["kind"] == "prefill" and
                   (r["tokens"], r["layout"], r["dtype"]) == key]
            dflt = next(r for r in grp if r["variant"] == "default")
            best = max(grp, key=lambda r: r["gbps"])
            lines.append(f"  T={key[0]:<5d} {key[1]} {key[2]:13s} default {dflt['gbps']:6.0f} "
                         f"{tuple(dflt['tiling'])}  best {best['gbps']:6.0f} {tuple(best['tiling'])}"
                         + ("  MISMATCH" if any(r.get("mismatches") for r in grp) else ""))
    attn = result["attention"]
    if attn:
        lines += _attention_table(attn)
    return "\n".join(lines)


def _attention_table(attn: list[dict]) -> list[str]:
    """Per case and layout: the default and the best candidate; then, per case, the top configs
    by the mean of their NHD and HND times (what a default should be chosen from), and per knob
    the best config with it against the best without it, in every case."""
    def ok(c: dict) -> bool:
        return "ms" in c and "error" not in c

    def g(v: Any) -> str:
        return f"{v:.4f}" if v else "-"

    lines = ["paged_attention (decode: x SDPA GB/s, target >= 0.92; prefill: time / SDPA, "
             "target <= 1.2; graph: ms per call replayed from a CUDA graph):"]
    defaults = [r for r in attn if r["variant"] == "default"]
    for r in defaults:
        grp = [c for c in attn if (c["kind"], c["batch"], c["ctx"], c["layout"]) ==
               (r["kind"], r["batch"], r["ctx"], r["layout"]) and ok(c)]
        best = min(grp, key=lambda c: c["ms"])
        if r["kind"] == "decode":
            lines.append(
                f"  decode B={r['batch']:<3d} x {r['ctx']:<5d} {r['layout']}: default "
                f"{r['ratio_vs_sdpa']:.3f} {r['ms']:.4f} ms [{r['label']}] graph "
                f"{g(r.get('ms_graph'))} vs SDPA {g(r.get('sdpa_ms_graph'))}; no-pad "
                f"{r['ms_no_padding_column'] / r['ms']:.3f}x | best "
                f"{r['sdpa_ms'] / best['ms']:.3f} "
                f"{best['ms']:.4f} ms [{best['label']}] graph {g(best.get('ms_graph'))} | SDPA "
                f"{r['sdpa_backend']} {r['sdpa_ms']:.4f}")
        else:
            lines.append(
                f"  prefill B={r['batch']} x {r['ctx']} {r['layout']}: default "
                f"{r['ratio_time_vs_sdpa']:.3f} {r['ms']:.3f} ms ({r['tflops']:.0f} TFLOP/s) "
                f"[{r['label']}] | best {best['ms'] / r['sdpa_ms']:.3f} {best['ms']:.3f} ms "
                f"[{best['label']}] | SDPA {r['sdpa_backend']} {r['sdpa_ms']:.3f} "
                f"({r['sdpa_tflops']:.0f} TFLOP/s)")
    bad = [c for c in attn if "error" in c]
    for c in bad:
        lines.append(f"  ERROR {c['kind']} B={c['batch']} {c['layout']} [{c['label']}]: "
                     f"{c['error'][:120]}")
    # per case, both layouts: mean ms of each config timed in both
    cases = sorted({(r["kind"], r["batch"], r["ctx"]) for r in defaults},
                   key=lambda k: (k[0], -k[1]))
    by_case: dict[tuple, list[tuple[float, float, str, dict]]] = {}
    for key in cases:
        sdpa = [r["sdpa_ms"] for r in defaults if (r["kind"], r["batch"], r["ctx"]) == key]
        sdpa_ms = sum(sdpa) / len(sdpa)
        labels: dict[str, list[dict]] = {}
        for c in attn:
            if (c["kind"], c["batch"], c["ctx"]) == key and ok(c):
                labels.setdefault(c["label"], []).append(c)
        ranked = []
        for label, rs in labels.items():
            if len(rs) == len(sdpa):
                ms = sum(c["ms"] for c in rs) / len(rs)
                ratio = sdpa_ms / ms if key[0] == "decode" else ms / sdpa_ms
                ranked.append((ms, ratio, label, rs[0]))
        ranked.sort()
        by_case[key] = ranked
    lines.append("picks: mean of NHD and HND (ms, ratio to SDPA), fastest first; * = default:")
    for key, ranked in by_case.items():
        dflt = next(r["label"] for r in defaults if (r["kind"], r["batch"], r["ctx"]) == key)
        top = " | ".join(f"{'*' if lab == dflt else ''}{lab} {ms:.4f} {ratio:.3f}"
                         for ms, ratio, lab, _ in ranked[:5])
        lines.append(f"  {key[0]} B={key[1]} x {key[2]}: {top}")
    knobs = {
        "fused_merge": lambda c: c["config"]["fused_merge"] and c["config"]["num_splits"] > 1,
        "range_stages": lambda c: c["config"]["range_stages"] > 0,
        "lazy_rescale": lambda c: c["config"]["lazy_rescale"],
        "double-buffered decode": lambda c: c["kind"] == "decode" and
        (c["config"]["tile_n"], c["config"]["num_warps"], c["config"]["num_stages"])
        in DEEP_DECODE_TILES,
        "head chunks": lambda c: c["config"]["heads_per_program"] < c["group"],
    }
    lines.append("knobs: best ratio to SDPA with / without, per case (mean of layouts):")
    for knob, has in knobs.items():
        parts = []
        for key, ranked in by_case.items():
            on = [x for x in ranked if has(x[3])]
            off = [x for x in ranked if not has(x[3])]
            if on and off:
                parts.append(f"{key[0]} B={key[1]}: {on[0][1]:.3f} [{on[0][2]}] / {off[0][1]:.3f}")
        if parts:
            lines.append(f"  {knob}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="also write DIR/sweep.json (the raw rows)")
    parser.add_argument("--quick", action="store_true", help="fewer candidates")
    parser.add_argument("--only", choices=("write", "attention"), default=None)
    parser.add_argument("--jobs", type=int, default=None,
                        help="precompile processes (default min(14, CPUs) on CUDA, 0 on CPU)")
    parser.add_argument("--rep", type=int, default=None, help="do_bench rep in ms (default 60)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes under TRITON_INTERPRET=1 (the flow; timings mean nothing)")
    from fkv.bench import results

    results.add_output_arguments(parser, plot=False)
    args = parser.parse_args(argv)
    start = time.perf_counter()

    import torch

    from fkv.bench._common import copy_ceiling_gbps, environment, read_ceiling_gbps

    if args.cpu_smoke:
        device, shape, rep = "cpu", SMOKE, 1
    elif torch.cuda.is_available():
        device, shape, rep = "cuda", GPU, args.rep or 60
    else:
        print("needs a CUDA device (or --cpu-smoke)", file=sys.stderr)
        return 2
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    jobs = args.jobs if args.jobs is not None else (min(14, os.cpu_count() or 1)
                                                    if device == "cuda" else 0)
    result: dict[str, Any] = {"env": environment(device), "argv": sys.argv[1:], "write": [],
                              "attention": []}
    if jobs > 0:
        tasks = [t for t in _compile_tasks(shape, args.cpu_smoke, args.quick)
                 if args.only is None or t[0] == ("write" if args.only == "write" else "attn")]
        result["precompile_s"] = _precompile(tasks, jobs)
        _log(f"precompiled {len(tasks)} tasks in {result['precompile_s']:.0f} s")
    _warm_up(device, WARMUP_S)
    result["copy_ceiling_gbps"] = copy_ceiling_gbps(rep, device, (1 << 30) if device == "cuda"
                                                    else (16 << 20))
    result["read_ceiling_gbps"] = read_ceiling_gbps(rep, device, (2 << 30) if device == "cuda"
                                                    else (16 << 20))
    def save() -> None:
        result["seconds"] = time.perf_counter() - start
        if args.out:
            with open(os.path.join(args.out, "sweep.json"), "w") as f:
                json.dump(result, f, indent=1)

    if args.only in (None, "write"):
        _log("write_kv")
        result["write"] = _write_section(shape, device, rep, args.quick)
        save()
    if args.only in (None, "attention"):
        _log("paged_attention")
        result["attention"] = _attention_section(shape, device, rep, args.quick)
    save()
    print(_table(result), flush=True)
    # bench/results/kernels-sweep-<UTC>.json by default on the GPU; --cpu-smoke only when asked
    results.save(_result_run(result, args, device), args, by_default=not args.cpu_smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
