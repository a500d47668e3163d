"""One H200 run for issue 14: write_kv tilings and paged_attention configurations, checked, timed
against same-run baselines, written as a result file (and raw JSON).

    PYTHONPATH=. python3 bench/gpu_kernels_sweep.py --out DIR   # the run (< 3 min on an H200):
                          # bench/results/kernels-sweep-<UTC>.json (--json PATH, --results-dir,
                          # --no-save as every bench) and DIR/sweep.json (raw rows)
    PYTHONPATH=. python3 bench/gpu_kernels_sweep.py --out DIR --cpu-smoke
                          # tiny shapes under TRITON_INTERPRET=1: the flow only (a result file
                          # only with --json or --results-dir)

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
3. ``paged_attention`` decode B=64 x 8192, 256 x 2048, 8 x 32768, 16 x 4096 (Hq 32, Hkv 8, D 128,
   bf16, block 16, random block permutations with ONE padding column of garbage), both layouts:
   the default config (timed twice, the faster kept; also with no padding column, to show it
   costs nothing) and candidates
   (split counts, key tiles, warps, stages), forced with ``config=``; each checked against the
   default's output, the default against ``fkv.ops.reference`` and SDPA. Baseline: dense torch
   SDPA on the same values, the fastest backend that runs (flash, efficient, cudnn, default
   dispatch). Prefill B=4 x 4096 causal the same way. GB/s = K+V bytes read once.
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
             attn=dict(hq=4, hkv=2, d=32, n=16, decode=((2, 100), (1, 300)), prefill=(2, 40)))

# write_kv tilings to try at decode: (tokens per program, heads per program, warps[, "kv"]); "kv":
# K and V in one program (write._FUSE_KV_TOKENS). Defaults on 8 x 128 now: bf16 (1, 8, 4) for
# T <= 16, (1, 8, 2) above; fp8 (1, 8, 8). Round 2 (us per call in a graph, NHD / HND): bf16 T=256
# 2 warps 2.45 / 2.79, 4 warps 2.76 / 2.75; T=16 4 warps 2.20 / 2.20 vs 2.28 / 2.27; fp8 8 warps
# won every T (T=256 2.87 / 2.85 vs 2.93 / 2.91 on 4); 2-token tiles and "kv" lost everywhere
# (0.1-0.9 us), dropped.
DECODE_TILINGS = [(1, 8, 2), (1, 8, 4), (1, 8, 8)]
SMALL_T_TILINGS = [(1, 8, 2), (1, 8, 4), (1, 8, 8)]  # T = 1, 16
# prefill (None: the default; bf16 (16, 8, 8), fp8 (4, 8, 4)), per cache dtype. Round 2 GB/s NHD /
# HND: bf16 8192 tokens (16, 8, 8) 3017 / 2778, (8, 8, 8) 3035 / 2933, (4, 8, 2) 2960 / 2996;
# 65536 all within 1 % (3578-3662). fp8 (4, 8, 4) 2537 / 2525 and 3323 / 3309 vs the old (8, 8, 4)
# 2146 / 2140 and 3025 / 2970, (8, 8, 8) 2394 / 2401 and 3150 / 3136; (16, 8, 8) lost 15-25 %.
# (2, 8, 4) for fp8 is new (smaller tiles kept winning).
PREFILL_TILINGS = {"bfloat16": [None, (8, 8, 8), (4, 8, 2), (8, 8, 4)],
                   "float8_e4m3fn": [None, (8, 8, 4), (8, 8, 8), (2, 8, 4)]}

# paged_attention candidates: decode (tile_n, num_warps, num_stages). Defaults now: grids of >= 132
# programs before splitting (64, 2, 3), unsplit here; smaller grids (128, 4, 2), split to ~2
# programs per SM (B=8 x 32768: 4, B=16 x 4096: 2). Round 2: (64, 2, 2/3/4) within 0.5 % of each
# other; (128, 4, 3), (128, 8, 2) and (64, 4, 2) never ahead; the old default (64, 4, 3) stays as
# a reference. Every tile is timed at the default's split count, then the split counts around it
# for the default tile and for the other decode tile (ALT_DECODE_TILE).
DECODE_TILES = [(64, 4, 3), (64, 2, 3), (64, 2, 2), (128, 4, 2)]
ALT_DECODE_TILE = {(64, 2, 3): (128, 4, 2), (128, 4, 2): (64, 2, 3)}
# prefill (block_q queries x 4 heads = rows, tile_n, num_warps, num_stages). Default now (64, 64,
# 8, 4) = 256 rows (round 2: 1.479 / 1.480 ms NHD / HND; 3 stages 1.492 / 1.499; 128 rows (32, 64,
# 4, 4) 1.531 / 1.527, (32, 32, 4, 3) 1.527 / 1.527, the old (32, 64, 4, 3) 1.546 / 1.537 at its
# second timing); 128-key tiles, 64 rows and 256 rows x 32 keys lost 4-20 %. (64, 64, 8, 5) is new.
PREFILL_CONFIGS = [(64, 64, 8, 3), (32, 64, 4, 4), (32, 32, 4, 3), (32, 64, 4, 3),
                   (64, 64, 8, 5)]
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

        self.saved = write_mod._FUSE_KV_TOKENS
        write_mod._FUSE_KV_TOKENS = 1 << 30 if self.fused else 0
        write_mod._set_tiling_override(self.tiling)

    def __exit__(self, *exc: Any) -> None:
        from fkv.ops import write as write_mod

        write_mod._FUSE_KV_TOKENS = self.saved
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


def _engine_style_kernel():
    """A re-implementation of the engine's reshape-and-cache structure (same-run baseline): one
    program per token (padding tokens return early, so loads wait for the slot), K and V of all
    heads in it, 16 warps; any layout through strides; fp8 by approximate division."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
               key_stride, value_stride, stride_block, stride_kv, stride_token, stride_head,
               BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
               H_PAD: tl.constexpr, FP8: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:
            return
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, HEAD_SIZE)
        mask = (h < NUM_HEADS)[:, None]
        blk = slot // BLOCK_SIZE
        dst = blk * stride_block + (slot % BLOCK_SIZE) * stride_token + \
            (h * stride_head)[:, None] + d[None, :]
        src = (h * HEAD_SIZE)[:, None] + d[None, :]
        k = tl.load(key_ptr + token * key_stride + src, mask=mask)
        v = tl.load(value_ptr + token * value_stride + src, mask=mask)
        if FP8:
            k = k.to(tl.float32) / tl.load(k_scale_ptr)
            v = v.to(tl.float32) / tl.load(v_scale_ptr)
        tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + stride_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)

    return kernel


_ENGINE = None


def _engine_call(spec: Any, cache: Any, key: Any, value: Any, slots: Any, scales: dict):
    import triton

    from fkv.ops._spec import cache_strides

    global _ENGINE
    if _ENGINE is None:
        _ENGINE = _engine_style_kernel()
    st = cache_strides(spec)
    ks = scales.get("k_scale", key)
    vs = scales.get("v_scale", key)
    tokens = slots.shape[0]
    kernel = _ENGINE

    def run() -> None:
        kernel[(tokens,)](key, value, cache, slots, ks, vs, key.stride(0), value.stride(0),
                          st["stride_block"], st["stride_kv"], st["stride_token"],
                          st["stride_head"], BLOCK_SIZE=spec.block_size,
                          NUM_HEADS=spec.num_kv_heads, HEAD_SIZE=spec.head_size,
                          H_PAD=triton.next_power_of_2(spec.num_kv_heads), FP8=spec.is_fp8,
                          num_warps=16 if spec.num_kv_heads * spec.head_size >= 1024 else 4,
                          num_stages=10 if os.environ.get("TRITON_INTERPRET") != "1" else 1)
    return run


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
    import torch

    from fkv.ops.attention import _num_sms, attention_config

    return attention_config(num_seqs=p.batch, num_q_tokens=p.q.shape[0], num_q_heads=p.a["hq"],
                            num_kv_heads=p.a["hkv"], head_size=p.a["d"],
                            max_context=p.block_table.shape[1] * p.a["n"], itemsize=2,
                            num_sms=_num_sms(p.q.device), varlen=p.q_len > 1)


def _attn_candidates(kind: str, default: Any, ctx: int, quick: bool) -> list[tuple[str, Any]]:
    import attrs

    out = []
    if kind == "decode":
        def counts(n: int) -> list[int]:
            return [c for c in sorted({1, max(1, n // 2), max(1, n - 1), n + 1, 2 * n} - {n})
                    if c == 1 or ctx // c >= 256]

        n = default.num_splits
        for splits in counts(n)[:2] if quick else counts(n):
            out.append((f"splits={splits}", attrs.evolve(default, num_splits=splits)))
        for tile, warps, stages in DECODE_TILES[:2] if quick else DECODE_TILES:
            cfg = attrs.evolve(default, tile_n=tile, num_warps=warps, num_stages=stages)
            if cfg != default:
                out.append((f"tile={tile} warps={warps} stages={stages}", cfg))
        alt = ALT_DECODE_TILE.get((default.tile_n, default.num_warps, default.num_stages))
        if alt and not quick:
            # the other decode tile at the split counts around the default's (its residency,
            # hence its best count, differs: 128-key tiles about half the programs per SM)
            tile, warps, stages = alt
            seen = {cfg for _, cfg in out}
            for splits in sorted({n, 2 * n}):
                if splits == 1 or ctx // splits >= 256:
                    cfg = attrs.evolve(default, tile_n=tile, num_warps=warps, num_stages=stages,
                                       num_splits=splits)
                    if cfg not in seen:
                        out.append((f"tile={tile} warps={warps} stages={stages} "
                                    f"splits={splits}", cfg))
    else:
        for block_q, tile, warps, stages in PREFILL_CONFIGS[:3] if quick else PREFILL_CONFIGS:
            cfg = attrs.evolve(default, block_q=block_q, tile_n=tile, num_warps=warps,
                               num_stages=stages)
            if cfg != default:
                out.append((f"rows={block_q * default.heads_per_program} tile={tile} "
                            f"warps={warps} stages={stages}", cfg))
    return out


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


def _attention_section(shape: dict, device: str, rep: int, quick: bool) -> list[dict]:
    import attrs
    import torch

    from fkv.bench._common import time_ms
    from fkv.ops import reference

    a = shape["attn"]
    rows: list[dict] = []
    cases = [("decode", b, ctx) for b, ctx in a["decode"]] + [("prefill", *a["prefill"])]
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
            if err_ref > 3e-2 or err_sdpa > 3e-2 or not torch.isfinite(got).all():
                _log(f"MISMATCH {name}: |kernel - reference| {err_ref:.3g}, |kernel - SDPA| "
                     f"{err_sdpa:.3g}")
            sdpa = _sdpa_times(p, p.sdpa().float(), rep, device)
            best_sdpa = min(sdpa, key=sdpa.get)
            sdpa_ms = sdpa[best_sdpa]
            # timed twice, the faster kept (round 2: one first timing read 2.2x its repeat)
            ms_first = time_ms(lambda: p.kernel(), rep, device)
            ms_repeat = time_ms(lambda: p.kernel(), rep, device)
            ms = min(ms_first, ms_repeat)
            row = {"op": "attention", "kind": kind, "batch": batch, "ctx": ctx, "layout": layout,
                   "variant": "default", "config": attrs.asdict(default), "ms": ms,
                   "ms_first": ms_first, "ms_repeat": ms_repeat, "bytes": p.bytes,
                   "gbps": p.bytes / ms / 1e6,
                   "sdpa_ms": sdpa_ms, "sdpa_backend": best_sdpa, "sdpa_ms_by_backend": sdpa,
                   "max_err_vs_reference": err_ref, "max_err_vs_sdpa": err_sdpa}
            if kind == "decode":
                row["ratio_vs_sdpa"] = sdpa_ms / ms  # GB/s ratio (same bytes)
                nopad = p.tables[0]
                row["ms_no_padding_column"] = time_ms(lambda: p.kernel(table=nopad), rep, device)
                row["config_no_padding_column"] = attrs.asdict(
                    _default_config_for_table(p, nopad))
            else:
                row["ratio_time_vs_sdpa"] = ms / sdpa_ms
                flops = 4 * batch * a["hq"] * a["d"] * ctx * (ctx + 1) / 2
                row["tflops"], row["sdpa_tflops"] = flops / ms / 1e9, flops / sdpa_ms / 1e9
            if device == "cuda":
                import triton.testing

                row["ms_graph"] = triton.testing.do_bench_cudagraph(lambda: p.kernel(), rep=rep,
                                                                    return_mode="median")
                if best_sdpa != "default":
                    from torch.nn.attention import SDPBackend

                    backend = getattr(SDPBackend, best_sdpa)
                    row["sdpa_ms_graph"] = triton.testing.do_bench_cudagraph(
                        lambda: p.sdpa(backend), rep=rep, return_mode="median")
            rows.append(row)
            ratio = row.get("ratio_vs_sdpa", row.get("ratio_time_vs_sdpa"))
            _log(f"  {name} default {_cfg(default)}: {ms:.3f} ms ({p.bytes / ms / 1e6:.0f} GB/s), "
                 f"SDPA {best_sdpa} {sdpa_ms:.3f} ms, ratio {ratio:.3f}"
                 + (f", no padding column {row['ms_no_padding_column']:.3f} ms"
                    if kind == "decode" else ""))
            del p.k, p.v, p.qd
            if device == "cuda":
                torch.cuda.empty_cache()
            for label, cfg in _attn_candidates(kind, default, ctx, quick):
                cand = {"op": "attention", "kind": kind, "batch": batch, "ctx": ctx,
                        "layout": layout, "variant": label, "config": attrs.asdict(cfg)}
                try:
                    err = (p.kernel(config=cfg).float() - got).abs().max().item()
                    cms = time_ms(lambda c=cfg: p.kernel(config=c), max(1, rep // 2), device)
                except Exception as e:  # a config that does not fit (registers, shared memory)
                    cand["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(cand)
                    _log(f"    {label}: {cand['error']}")
                    continue
                cand |= {"ms": cms, "gbps": p.bytes / cms / 1e6, "max_err_vs_default": err,
                         "speedup_vs_default": ms / cms}
                cand["ratio_vs_sdpa" if kind == "decode" else "ratio_time_vs_sdpa"] = (
                    sdpa_ms / cms if kind == "decode" else cms / sdpa_ms)
                if err > 3e-2:
                    cand["error"] = "MISMATCH vs the default's output"
                rows.append(cand)
                _log(f"    {label}: {cms:.3f} ms x{ms / cms:.3f} vs default"
                     + (f" MISMATCH {err:.3g}" if err > 3e-2 else ""))
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
            f"{cfg.num_splits}, warps {cfg.num_warps}, stages {cfg.num_stages})")


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
        for layout, what, cfg_fields in items:
            import attrs

            q_len = 1 if what == "decode" else 40
            # table width 33 blocks: like the runs' widths (need + 1 column), not divisible by 16
            p = _AttnProblem(a, layout, 2, 32 * a["n"] if not smoke else 100, q_len, device,
                             dense=False)
            try:
                cfg = attrs.evolve(_default_config(p), **cfg_fields) if cfg_fields else None
                p.kernel(config=cfg)
            except Exception as e:
                errors.append(f"{layout} {what} {cfg_fields}: {str(e)[:160]}")
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
        for tile, warps, stages in DECODE_TILES[:3] if quick else DECODE_TILES:
            fields = {"tile_n": tile, "num_warps": warps, "num_stages": stages}
            attn_items.append((layout, "decode", {**fields, "num_splits": 4}))  # SPLIT variant
            attn_items.append((layout, "decode", {**fields, "num_splits": 1}))
        attn_items.append((layout, "prefill", {}))
        for block_q, tile, warps, stages in PREFILL_CONFIGS[:3] if quick else PREFILL_CONFIGS:
            attn_items.append((layout, "prefill", {"block_q": block_q, "tile_n": tile,
                                                   "num_warps": warps, "num_stages": stages}))
    tasks = [("write", smoke, write_items[i:i + 4]) for i in range(0, len(write_items), 4)]
    tasks += [("attn", smoke, [item]) for item in attn_items]
    return tasks


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
                      config={"quick": args.quick, "only": args.only, "cpu_smoke": args.cpu_smoke,
                              "rep_ms": args.rep})
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
            ("max_err_vs_default", "vs_default_err")) if k1 in r}
        extra = {k: r[k] for k in ("sdpa_backend", "sdpa_ms_by_backend", "config_no_padding_column")
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
        lines.append("paged_attention (decode: x SDPA GB/s, target >= 0.92; prefill: time / SDPA, "
                     "target <= 1.2):")
        for r in [r for r in attn if r["variant"] == "default"]:
            grp = [c for c in attn if (c["kind"], c["batch"], c["ctx"], c["layout"]) ==
                   (r["kind"], r["batch"], r["ctx"], r["layout"]) and "ms" in c
                   and "error" not in c]
            best = min(grp, key=lambda c: c["ms"])
            if r["kind"] == "decode":
                lines.append(f"  decode B={r['batch']:<3d} x {r['ctx']:<5d} {r['layout']}: default "
                             f"{r['ratio_vs_sdpa']:.3f} ({r['gbps']:.0f} GB/s, splits "
                             f"{r['config']['num_splits']}, no-pad {r['ms_no_padding_column'] / r['ms']:.3f}x "
                             f"time)  best {r['sdpa_ms'] / best['ms']:.3f} [{best['variant']}]  "
                             f"SDPA {r['sdpa_backend']}")
            else:
                lines.append(f"  prefill B={r['batch']} x {r['ctx']} {r['layout']}: default "
                             f"{r['ratio_time_vs_sdpa']:.3f} ({r['tflops']:.0f} TFLOP/s)  best "
                             f"{best['ms'] / r['sdpa_ms']:.3f} [{best['variant']}]  SDPA "
                             f"{r['sdpa_backend']} {r['sdpa_tflops']:.0f} TFLOP/s")
    return "\n".join(lines)


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
