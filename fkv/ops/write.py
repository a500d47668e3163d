"""``write_kv``: reshape-and-cache into any paged layout, one Triton variant per layout.

Three thin layers:

1. ``_write_kv_kernel``: sees only pointers, strides and ``tl.constexpr``. One program writes one
   tile of ``BLOCK_T`` consecutive tokens × ``HEAD_TILE`` heads × the whole head of either K or V
   (grid axis 1 picks the half; MLA has one). In HND (``HEADS_OUTER``) the tile is arranged
   ``[heads, tokens, dim]`` so that, for a run of consecutive slots, every head's rows land as one
   contiguous stretch of its (head, block) page tile; in NHD it is ``[tokens, heads, dim]``, one
   contiguous stretch per token. Loads read whole head rows of ``key``/``value`` (any strides)
   and do not wait for the slot load (their mask depends only on the token count), so a decode
   step costs one memory round trip before its stores, not two.
2. :func:`write_tiling`: a pure, cached function of the spec and the token count's power-of-two
   class giving the tile sizes and ``num_warps`` (no autotuning): prefill-sized T gets big tiles,
   decode-sized T many one-token programs; and :func:`write_constexprs`: the spec's constexprs
   (``fkv.ops._spec.cache_constexprs`` plus the in-page strides), so each (layout, tiling)
   compiles once.
3. :func:`write_kv`: checks tensors against the spec (FkvError before launch), then launches with
   keyword arguments. No per-token Python work and no host sync when ``validate=False``, so the
   call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import triton
import triton.language as tl

from fkv.errors import FkvError
from fkv.layout import KVCacheSpec
from fkv.ops._launch import KernelLauncher, LaunchSite, check_kernel_device, pdl_capable
from fkv.ops._spec import (cache_constexprs, cache_strides, check_pdl, check_scale_values,
                           check_validate, join_kv_views)
from fkv.ops.reference._write import check_slots, check_token_counts, check_write_inputs

if TYPE_CHECKING:
    import torch

__all__ = ["WriteTiling", "write_constexprs", "write_kv", "write_tiling"]

# Integers only compared against, never used in addresses: specializing them (divisibility by 16)
# would only multiply variants (the token count changes every step, num_slots with the cache size).
_DO_NOT_SPECIALIZE = ("num_tokens", "num_slots")
# Elements of one program's tile (one K or V half). bf16/fp16/fp32 caches: 16384 (32 KiB of bf16
# read + written; round-5 H200 sweep, 65536 tokens: HND 3589 GB/s vs 3564 for 8192 elements on 4
# warps, NHD 3654 vs 3651; bench/results/kernels-sweep-20261201T082902Z.json). fp8 caches: 4096 on
# 4 warps (the quantizing kernel loses occupancy with bigger tiles; round-2 H200 sweep, NHD / HND
# GB/s: 65536 tokens 3323 / 3309 vs 3025 / 2970 for 8192 elements on 4 warps and 3150 / 3136 on 8;
# 8192 tokens 2537 / 2525 vs 2146 / 2140; bench/results/kernels-sweep-20261201T022307Z.json).
_TILE_ELEMENTS = 16384
_TILE_ELEMENTS_FP8 = 4096
# One warp per this many tile elements (1..8 warps): 2048 bf16 elements = 4 KiB, 16 B a lane;
# fp8 caches one per _ELEMENTS_PER_WARP // _FP8_WARP_FACTOR (1024: 4096 elements on 4 warps).
_ELEMENTS_PER_WARP = 2048
_FP8_WARP_FACTOR = 2
# Small T (decode): tiles shrink until the grid has about this many programs (K and V halves
# together), down to this many elements (one token of 8 heads x 128), one warp per
# _SMALL_ELEMENTS_PER_WARP elements. A 256-token decode of 8 x 128 then runs 512 programs of one
# token each instead of 32 of 16 tokens (faster per call in a graph, bf16 and fp8, in a by-hand
# H200 run before results were committed; no committed file times the 16-token tiles).
_TARGET_PROGRAMS = 512
_MIN_TILE_ELEMENTS = 1024
_SMALL_ELEMENTS_PER_WARP = 512
_SMALL_MAX_WARPS = 4
# Token classes up to _FEW_TOKENS (a grid of a few programs): one warp per
# _FEW_ELEMENTS_PER_WARP elements (bf16 one token of 8 x 128 on 4 warps; round-2 H200 sweep,
# bench/results/kernels-sweep-20261201T022307Z.json, us per call in a graph, NHD / HND: T=16
# 2.20 / 2.20 vs 2.28 / 2.27 on 2 warps, T=1 2.03 / 2.03 vs 2.03 / 2.05; at T=256 2 warps stay:
# 2.45 / 2.79 vs 2.76 / 2.75 on 4).
_FEW_TOKENS = 16
_FEW_ELEMENTS_PER_WARP = 256
# fp8 caches (quantizing): one warp per _SMALL_ELEMENTS_PER_WARP_FP8 elements of a small tile, up
# to _SMALL_MAX_WARPS_FP8. Since the division takes one reciprocal per program (_div_rn_by_scalar),
# 4 warps per token of 8 x 128 lead 8 (H200, us per call in a 32-call graph, rotating inputs / one
# input set, NHD; bench/results/raw/write-decode-probe-exp-20261202T0759.json): T=256 2.53 / 2.05
# vs 2.57 / 2.20; T=16 2.05 / 1.62 vs 2.06 / 1.66; T=1 1.82 / 1.52 vs 1.89 / 1.59 (8 warps had won
# while every element ran its own div_rn).
_SMALL_ELEMENTS_PER_WARP_FP8 = 256
_SMALL_MAX_WARPS_FP8 = 8
# A forced tiling (see _set_tiling_override): None = the default choice.
_TILING_OVERRIDE: Any = None
# fp8 dtype -> (largest finite value, mantissa bits, smallest normal exponent)
_FP8 = {"float8_e4m3fn": (448.0, 3, -6), "float8_e5m2": (57344.0, 2, -14)}
# Cache modifier of the cache stores ("" = default write-back; ".cs" = streaming): a bench knob.
_STORE_MODIFIER = ""
# Compiled quantizing writes of token classes up to _FAST_DIVISION_TOKENS divide with one
# reciprocal per program and an fma correction (_div_rn_by_scalar, the same bits) instead of div_rn
# per element; False: div_rn everywhere (a bench knob). Same-run A/B on an H200 (fp8 e4m3, NHD /
# HND; bench/results/raw/write-fastdiv-20261202T110800Z.json against write-divrn-20261202T110742Z
# and write-divrn-20261202T110817Z beside it, div_rn before and after): decode 256 per call in a graph
# 2.13 / 2.46 us against 2.28 / 2.62 with div_rn, but prefill 65536 3172 / 3053 GB/s against
# 3559-3584 / 3407-3426 and 8192 2346 / 2212 against 2549-2562 / 2454-2473: larger classes keep
# div_rn.
_FAST_DIVISION = True
_FAST_DIVISION_TOKENS = 256
# fp8 caches: at least this many elements per thread. With fewer, Triton 3.6's fp32 -> fp8
# conversion writes wrong bytes on sm_90: a 1 x 8 x 128 tile on 16 warps (2 elements per thread)
# differed from the reference in half its bytes, fused or not, both layouts, T = 1, 16, 256; 8
# warps (4 per thread) and every bf16 tiling were exact
# (bench/results/raw/write-warps-check-20261201T2150.json). The launch caps num_warps to keep it.
_MIN_FP8_ELEMENTS_PER_THREAD = 4
# Token classes up to this many tokens write K and V in one program (grid axis 1 of one program,
# the slot load and address math shared; its warps counted over both halves) instead of one
# program per half; 0 = never. Caches that are not fp8: once every load was issued before the slot
# math, one token of 8 x 128 x 2 halves on 4 warps led every other tiling at T = 1, 16 and 256 in
# both layouts (H200, us per call in a graph, rotating / one input set, NHD;
# bench/results/raw/write-decode-probe-exp-20261202T0759.json): T=256 2.50 / 1.97 against 2.80
# / 2.07 for a program per half; T=16 1.95 / 1.52 against 2.21 / 1.67; T=1 1.76 / 1.44 against
# 2.03 / 1.57. fp8 caches (_FUSE_KV_TOKENS_FP8): a program per half stayed ahead (T=256 2.53 /
# 2.05 against 2.61 / 2.07 fused).
_FUSE_KV_TOKENS = 256
_FUSE_KV_TOKENS_FP8 = 0


@triton.jit
def _arrange(tok, head, dim, HEADS_OUTER: tl.constexpr):
    """Broadcast-add per-token, per-head and per-dim offsets into the tile's 3-D arrangement."""
    if HEADS_OUTER:
        out = head[:, None, None] + tok[None, :, None] + dim[None, None, :]
    else:
        out = tok[:, None, None] + head[None, :, None] + dim[None, None, :]
    return out


@triton.jit
def _arrange_mask(tok, head, dim, HEADS_OUTER: tl.constexpr):
    if HEADS_OUTER:
        out = head[:, None, None] & tok[None, :, None] & dim[None, None, :]
    else:
        out = tok[:, None, None] & head[None, :, None] & dim[None, None, :]
    return out


@triton.jit
def _round_to_fp8_grid(y, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
                       FP8_MIN_EXP: tl.constexpr):
    """Round finite float32 ``y`` to the nearest fp8 value (ties to even), saturating at
    ``FP8_MAX`` (+-inf saturate too; NaN is the caller's).

    Adding then subtracting ``1.5 * 2**(ulp_exp + 23)`` makes the float32 adder round ``y`` to a
    multiple of the fp8 ulp ``2**ulp_exp``; the result is exactly representable in fp8.
    """
    y = tl.clamp(y, -2.0 * FP8_MAX, 2.0 * FP8_MAX)
    exp = ((y.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    ulp_exp = tl.maximum(exp, FP8_MIN_EXP) - FP8_MANT
    magic = (((ulp_exp + 150).to(tl.uint32) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (y + magic) - magic
    # A value that rounds to zero keeps its sign (-0.0), as a direct cast would.
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    rounded = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.clamp(rounded, -FP8_MAX, FP8_MAX)


@triton.jit
def _fp8_bits(y, FP8_TYPE: tl.constexpr, NATIVE_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
              FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_SUBNORMAL: tl.constexpr):
    """The fp8 byte (uint8) of float32 ``y``: round to nearest even, +-inf and out-of-range values
    saturate to +-FP8_MAX, NaN stays NaN with its sign (0x7F / 0xFF), as torch's cast after the
    reference's clamp.

    Compiled: the GPU's conversion (a saturating cvt on sm_89+, after a clamp), NaN's sign set
    afterwards. Interpreter: its fp8 downcast neither carries a rounded mantissa into the exponent
    nor keeps NaN (NaN became 0xFE = -448), so the byte is built from the float32 bits of the value
    rounded to the fp8 grid.
    """
    u = y.to(tl.uint32, bitcast=True)
    if NATIVE_FP8:
        # The conversion keeps every sign but NaN's (canonical 0x7F): OR-ing the sign of y into
        # every byte is exact for finite values and +-inf (already signed) and restores -NaN's, with
        # no NaN test and no widening of the bytes (which slowed the fp8 prefill: a layout
        # conversion through shared memory on Triton 3.6; a by-hand H200 round, no committed file).
        x = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        sign8 = ((u >> 24) & 0x80).to(tl.uint8)
        return x.to(FP8_TYPE).to(tl.uint8, bitcast=True) | sign8
    else:
        sign = (u >> 24) & 0x80
        nan = y != y
        r = _round_to_fp8_grid(tl.where(nan, 0.0, y), FP8_MAX, FP8_MANT, FP8_MIN_EXP)
        a = r.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
        e = (a >> 23).to(tl.int32) - 127
        is_normal = e >= FP8_MIN_EXP
        normal = ((e - FP8_MIN_EXP + 1) << FP8_MANT).to(tl.uint32) | ((a & 0x7FFFFF) >> (23 - FP8_MANT))
        # exact: a subnormal is an integer multiple 0 .. 2**MANT - 1 of 2**(MIN_EXP - MANT)
        subnormal = (tl.where(is_normal, 0.0, tl.abs(r)) * FP8_SUBNORMAL).to(tl.int32).to(tl.uint32)
        bits = tl.where(is_normal, normal, subnormal) | sign
        return tl.where(nan, sign | 0x7F, bits).to(tl.uint8)


@triton.jit
def _div_rn_by_scalar(x, s):
    """``x / s`` rounded to nearest even (the bits of ``div_rn`` and of torch's division) for a
    scalar ``s``: one correctly rounded reciprocal ``r`` per program and, per element, Markstein's
    correction ``q0 = x * r``, ``e = x - s * q0`` (exact in an fma), ``q = q0 + e * r`` (one
    rounding), which is the correctly rounded quotient when ``r`` is and nothing under- or
    overflows. ``div_rn`` per element instead runs a reciprocal, its refinement and a range check
    with a branch for every element (sm_90: a dependent chain of ~6 operations each, elements kept
    apart by the branches), which was most of an fp8 decode write's time after its loads.

    Ranges: ``|s|`` in [2**-64, 2**64] takes this path (else ``div_rn`` per element). There an exact
    ``e`` can only underflow when ``|x| < ~2**-102``, where the quotient (< 2**-38) is an fp8 zero of
    the right sign either way; an infinite or NaN ``q0`` (|x / s| beyond float32, x infinite or NaN)
    and an exact ``q0`` (``e == 0``, which also keeps the sign of a zero) are returned as they are.
    """
    a = tl.abs(s)
    if (a >= 5.421010862427522e-20) & (a <= 1.8446744073709552e19):  # 2**-64, 2**64
        r = tl.math.div_rn(1.0, s)
        q0 = x * r
        e = tl.fma(-s, q0, x)
        q = tl.where((e == 0.0) | (tl.abs(q0) == float("inf")), q0, tl.fma(e, r, q0))
    else:
        q = tl.math.div_rn(x, s)
    return q


@triton.jit
def _load_half(src_ptr, src_tok, stride_h, stride_d, load_mask, scale_ptr, h, d,
               HEADS_OUTER: tl.constexpr, QUANT: tl.constexpr):
    """One half's input tile (and its fp8 scale): loads that wait for nothing."""
    src_off = _arrange(src_tok, h * stride_h, d * stride_d, HEADS_OUTER)
    x = tl.load(src_ptr + src_off, mask=load_mask, eviction_policy="evict_first")
    if QUANT:
        scale = tl.load(scale_ptr)
    else:
        scale = 1.0
    return x, scale


@triton.jit
def _store_half(x, scale, dst_ptr, dst_off, store_mask, QUANT: tl.constexpr,
                NATIVE_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
                FP8_MIN_EXP: tl.constexpr, FP8_SUBNORMAL: tl.constexpr,
                STORE_MODIFIER: tl.constexpr, FAST_DIV: tl.constexpr):
    if QUANT:
        if FAST_DIV:
            y = _div_rn_by_scalar(x.to(tl.float32), scale)
        else:  # (the interpreter's fma is not fused: it always takes this path)
            y = tl.math.div_rn(x.to(tl.float32), scale)
        bits = _fp8_bits(y, dst_ptr.dtype.element_ty, NATIVE_FP8, FP8_MAX, FP8_MANT, FP8_MIN_EXP,
                         FP8_SUBNORMAL)
        tl.store(dst_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + dst_off, bits,
                 mask=store_mask, cache_modifier=STORE_MODIFIER)
    else:
        tl.store(dst_ptr + dst_off, x.to(dst_ptr.dtype.element_ty), mask=store_mask,
                 cache_modifier=STORE_MODIFIER)


@triton.jit
def _destination(slot, in_range, num_slots, stride_block, h, d, h_ok, d_ok,
                 BLOCK_SIZE: tl.constexpr, STRIDE_TOKEN: tl.constexpr,
                 STRIDE_HEAD: tl.constexpr, STRIDE_DIM: tl.constexpr,
                 HEADS_OUTER: tl.constexpr):
    """Cache offsets and store mask of the tile's tokens. Padding (negative) and out-of-cache
    slots write nothing, validated or not."""
    ok = in_range & (slot >= 0) & (slot < num_slots)
    block = slot // BLOCK_SIZE
    dst_tok = block * stride_block + (slot - block * BLOCK_SIZE) * STRIDE_TOKEN
    dst_off = _arrange(dst_tok, h * STRIDE_HEAD, d * STRIDE_DIM, HEADS_OUTER)
    return dst_off, _arrange_mask(ok, h_ok, d_ok, HEADS_OUTER)


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_tokens, num_slots, slot_stride,
    key_stride_t, key_stride_h, key_stride_d,
    value_stride_t, value_stride_h, value_stride_d,
    stride_block, stride_kv,
    STRIDE_TOKEN: tl.constexpr, STRIDE_HEAD: tl.constexpr, STRIDE_DIM: tl.constexpr,
    HEADS_OUTER: tl.constexpr, IS_MLA: tl.constexpr, CACHE_FP8: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    QUANT: tl.constexpr, NATIVE_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr, FP8_SUBNORMAL: tl.constexpr, STORE_MODIFIER: tl.constexpr,
    FAST_DIV: tl.constexpr, FUSE_KV: tl.constexpr, PDL: tl.constexpr,
    BLOCK_T: tl.constexpr, HEAD_TILE: tl.constexpr, D_PAD: tl.constexpr,
):
    if PDL:  # nothing is read before the kernel before this one has finished
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    half = tl.program_id(1)
    h = tl.program_id(2) * HEAD_TILE + tl.arange(0, HEAD_TILE)
    d = tl.arange(0, D_PAD)
    in_range = t < num_tokens
    h_ok = h < NUM_HEADS
    d_ok = d < HEAD_SIZE
    load_mask = _arrange_mask(in_range, h_ok, d_ok, HEADS_OUTER)
    t64 = t.to(tl.int64)
    # Every load (slots, inputs, scales) is issued before anything uses the slots: the slot
    # arithmetic placed before the input loads made each program wait two memory round trips
    # (sm_90 SASS: the inputs' loads sat behind the branch on the half, after the slot math), not
    # one. int64 offsets: int32 ones compile to more instructions and registers (each element's
    # offset is widened for its pointer add; sm_90 SASS, Triton 3.6).
    slot = tl.load(slot_ptr + t * slot_stride, mask=in_range, other=-1).to(tl.int64)
    if FUSE_KV:  # one program writes K and V of its tokens (grid axis 1 has one program)
        xk, k_scale = _load_half(key_ptr, t64 * key_stride_t, key_stride_h, key_stride_d,
                                 load_mask, k_scale_ptr, h, d, HEADS_OUTER, QUANT)
        xv, v_scale = _load_half(value_ptr, t64 * value_stride_t, value_stride_h, value_stride_d,
                                 load_mask, v_scale_ptr, h, d, HEADS_OUTER, QUANT)
        dst_off, store_mask = _destination(slot, in_range, num_slots, stride_block, h, d, h_ok,
                                           d_ok, BLOCK_SIZE, STRIDE_TOKEN, STRIDE_HEAD,
                                           STRIDE_DIM, HEADS_OUTER)
        _store_half(xk, k_scale, cache_ptr, dst_off, store_mask, QUANT, NATIVE_FP8, FP8_MAX,
                    FP8_MANT, FP8_MIN_EXP, FP8_SUBNORMAL, STORE_MODIFIER, FAST_DIV)
        _store_half(xv, v_scale, cache_ptr + stride_kv, dst_off, store_mask, QUANT, NATIVE_FP8,
                    FP8_MAX, FP8_MANT, FP8_MIN_EXP, FP8_SUBNORMAL, STORE_MODIFIER, FAST_DIV)
    else:
        # The half as arithmetic, not a branch: a branch splits the kernel into blocks the
        # assembler schedules apart, so the slot math above it would run before the loads below.
        is_k = half == 0
        x, scale = _load_half(tl.where(is_k, key_ptr, value_ptr),
                              t64 * tl.where(is_k, key_stride_t, value_stride_t),
                              tl.where(is_k, key_stride_h, value_stride_h),
                              tl.where(is_k, key_stride_d, value_stride_d),
                              load_mask, tl.where(is_k, k_scale_ptr, v_scale_ptr), h, d,
                              HEADS_OUTER, QUANT)
        dst_off, store_mask = _destination(slot, in_range, num_slots, stride_block, h, d, h_ok,
                                           d_ok, BLOCK_SIZE, STRIDE_TOKEN, STRIDE_HEAD,
                                           STRIDE_DIM, HEADS_OUTER)
        _store_half(x, scale, cache_ptr + half.to(tl.int64) * stride_kv, dst_off, store_mask,
                    QUANT, NATIVE_FP8, FP8_MAX, FP8_MANT, FP8_MIN_EXP, FP8_SUBNORMAL,
                    STORE_MODIFIER, FAST_DIV)


class WriteTiling(NamedTuple):
    """Tile and launch shape of ``write_kv`` for one spec and token-count class."""

    block_t: int    # consecutive tokens per program
    head_tile: int  # heads per program
    d_pad: int      # head_size rounded up to a power of two
    num_warps: int


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def token_class(num_tokens: int) -> int:
    """The token-count class the tiling is chosen by: ``num_tokens`` rounded up to a power of two.

    >>> [token_class(t) for t in (1, 16, 17, 256, 8192, 8193)]
    [1, 16, 32, 256, 8192, 16384]
    """
    return 1 << max(0, num_tokens - 1).bit_length()


def write_tiling(spec: KVCacheSpec, num_tokens: int | None = None) -> WriteTiling:
    """Tile sizes and ``num_warps`` for ``spec`` writing ``num_tokens`` tokens (None: a large
    prefill), a pure function of the spec and :func:`token_class` (no autotune).

    Large T: about 16384 elements per program, one warp per 2048 (fp8 caches: 4096 elements, one
    warp per 1024: the quantizing kernel loses occupancy with bigger tiles). Small T: tiles shrink
    (down to ``_MIN_TILE_ELEMENTS``, one whole token of the bench shape) until the grid has about
    ``_TARGET_PROGRAMS`` programs, so a decode step spreads over the GPU instead of running a few
    long programs; fewer elements per warp there (``_SMALL_ELEMENTS_PER_WARP``, at most
    ``_SMALL_MAX_WARPS`` warps; fewer still for up to ``_FEW_TOKENS`` tokens and for fp8 caches,
    up to 8 warps). Decode classes of caches that are not fp8 write K and V in one program
    (``_FUSE_KV_TOKENS``), whose warps count the elements of both halves.

    >>> from fkv import KVCacheSpec
    >>> spec = KVCacheSpec(num_blocks=1, block_size=16, num_kv_heads=8, head_size=128)
    >>> write_tiling(spec)
    WriteTiling(block_t=16, head_tile=8, d_pad=128, num_warps=8)
    >>> write_tiling(spec, 256)
    WriteTiling(block_t=1, head_tile=8, d_pad=128, num_warps=4)
    """
    override = _TILING_OVERRIDE
    if override is not None:
        return override(spec, num_tokens) if callable(override) else override
    tokens = None if num_tokens is None else token_class(num_tokens)
    return _tiling(spec, tokens, tokens is not None and fuses_kv(spec, tokens))


def fuses_kv(spec: KVCacheSpec, num_tokens: int) -> bool:
    """Whether a write of ``num_tokens`` tokens runs K and V in one program (module comment at
    ``_FUSE_KV_TOKENS``).

    >>> from fkv import KVCacheSpec
    >>> spec = KVCacheSpec(num_blocks=1, block_size=16, num_kv_heads=8, head_size=128)
    >>> fuses_kv(spec, 256), fuses_kv(spec, 257), fuses_kv(spec.evolve(dtype="fp8"), 16)
    (True, False, False)
    """
    limit = _FUSE_KV_TOKENS_FP8 if spec.is_fp8 else _FUSE_KV_TOKENS
    return not spec.is_mla and token_class(num_tokens) <= limit


@functools.lru_cache(maxsize=None)
def _tiling(spec: KVCacheSpec, tokens: int | None, fused: bool = False) -> WriteTiling:
    largest = _TILE_ELEMENTS_FP8 if spec.is_fp8 else _TILE_ELEMENTS
    d_pad = triton.next_power_of_2(spec.head_size)
    h_pad = triton.next_power_of_2(spec.num_kv_heads)
    halves = 1 if spec.is_mla else 2
    tile, most_warps = largest, 8
    per_warp = _ELEMENTS_PER_WARP // (_FP8_WARP_FACTOR if spec.is_fp8 else 1)
    if tokens is not None:
        spread = _pow2_floor(tokens * h_pad * d_pad * halves // _TARGET_PROGRAMS)
        if spread < largest:
            tile = max(spread, _MIN_TILE_ELEMENTS)
            if spec.is_fp8:
                per_warp, most_warps = _SMALL_ELEMENTS_PER_WARP_FP8, _SMALL_MAX_WARPS_FP8
            elif tokens <= _FEW_TOKENS:
                per_warp, most_warps = _FEW_ELEMENTS_PER_WARP, _SMALL_MAX_WARPS
            else:
                per_warp, most_warps = _SMALL_ELEMENTS_PER_WARP, _SMALL_MAX_WARPS
    head_tile = max(1, min(h_pad, tile // d_pad))
    block_t = max(1, tile // (head_tile * d_pad))
    elements = block_t * head_tile * d_pad * (2 if fused else 1)
    num_warps = max(1, min(most_warps, elements // per_warp))
    return WriteTiling(block_t, head_tile, d_pad, num_warps)


def _clear_tiling_caches() -> None:
    _tiling.cache_clear()
    _PREPARED.clear()


write_tiling.cache_clear = _clear_tiling_caches  # type: ignore[attr-defined]  # bench knobs


def _set_tiling_override(override: Any) -> None:
    """Force a tiling (a :class:`WriteTiling`, a function ``(spec, num_tokens) -> WriteTiling``,
    or None for the default) on every later call: the GPU sweep's knob. Clears the launch caches."""
    global _TILING_OVERRIDE
    _TILING_OVERRIDE = override
    _clear_tiling_caches()


@functools.lru_cache(maxsize=None)
def write_constexprs(spec: KVCacheSpec, quantize: bool) -> dict[str, Any]:
    """Every constexpr of the kernel for ``spec`` but the tiling's: the layout's
    (``cache_constexprs``), the in-page strides and fp8 handling. Equal specs give equal dicts, so
    one compiled variant per (spec, tiling).

    fp8 rounding: compiled kernels use the GPU's conversion (``NATIVE_FP8``); the CPU interpreter's
    fp8 downcast does not carry a rounded mantissa into the exponent nor keep NaN, so there the
    kernel builds the fp8 byte itself (same bits, ~3x the instructions).
    """
    st = cache_strides(spec)
    fp8_max, fp8_mant, fp8_min_exp = _FP8.get(spec.dtype, (0.0, 0, 0))
    return {
        **cache_constexprs(spec),
        "STRIDE_TOKEN": st["stride_token"],
        "STRIDE_HEAD": st["stride_head"],
        "STRIDE_DIM": st["stride_dim"],
        "QUANT": quantize,
        "NATIVE_FP8": _LAUNCHER.compiles,
        "FP8_MAX": fp8_max,
        "FP8_MANT": fp8_mant,
        "FP8_MIN_EXP": fp8_min_exp,
        "FP8_SUBNORMAL": float(2.0 ** (fp8_mant - fp8_min_exp)),
        "STORE_MODIFIER": _STORE_MODIFIER,
        "FAST_DIV": _FAST_DIVISION and _LAUNCHER.compiles,
    }


# Per call: the tensors and the token count; everything after them is fixed per input signature.
_LAUNCHER = KernelLauncher(
    _write_kv_kernel,
    per_call=("key_ptr", "value_ptr", "cache_ptr", "slot_ptr", "k_scale_ptr", "v_scale_ptr",
              "num_tokens"),
    pointers=("key_ptr", "value_ptr", "cache_ptr", "slot_ptr", "k_scale_ptr", "v_scale_ptr"),
)


class _Prepared:
    """Everything a launch needs that does not depend on the data: the checked fixed arguments
    and, per token class, the launch site of its tiling (sites shared between classes of one
    tiling)."""

    __slots__ = ("fixed", "kv_halves", "num_heads", "quantize", "is_mla", "cpu_slots", "spec",
                 "by_class", "by_tiling", "site", "pdl_capable")

    def __init__(self, fixed: dict[str, Any], spec: KVCacheSpec, quantize: bool,
                 cpu_slots: bool, pdl_capable: bool = False) -> None:
        self.fixed = fixed
        self.pdl_capable = pdl_capable  # compiled kernels on sm_90+: write_kv(pdl=True) applies
        self.spec = spec
        self.kv_halves = 1 if spec.is_mla else 2
        self.num_heads = spec.num_kv_heads
        self.quantize = quantize
        self.is_mla = spec.is_mla
        self.cpu_slots = cpu_slots  # validate by default: reading slots costs no sync on CPU
        # (token class, PDL) -> (site, block_t, head_tiles, programs on grid axis 1); (tiling, K
        # and V fused, PDL, fast division) -> the same
        self.by_class: dict[tuple[int, bool], tuple[LaunchSite, int, int, int]] = {}
        self.by_tiling: dict[tuple[WriteTiling, bool, bool, bool],
                             tuple[LaunchSite, int, int, int]] = {}
        self.site: LaunchSite | None = None  # the last site launched (bench/tests look at it)

    def launch_for(self, num_tokens: int, pdl: bool = False) -> tuple[LaunchSite, int, int, int]:
        cls = 1 << max(0, num_tokens - 1).bit_length()
        pdl = pdl and self.pdl_capable
        entry = self.by_class.get((cls, pdl))
        if entry is None:
            tiling = write_tiling(self.spec, num_tokens)
            fuse = self.kv_halves == 2 and fuses_kv(self.spec, cls)
            fast = self.fixed["FAST_DIV"] and cls <= _FAST_DIVISION_TOKENS
            entry = self.by_tiling.get((tiling, fuse, pdl, fast))
            if entry is None:
                site = _LAUNCHER.site({**self.fixed, "BLOCK_T": tiling.block_t,
                                       "HEAD_TILE": tiling.head_tile, "D_PAD": tiling.d_pad,
                                       "FUSE_KV": fuse, "PDL": pdl, "FAST_DIV": fast},
                                      {"num_warps": launch_warps(tiling, self.quantize),
                                       **({"launch_pdl": True} if pdl else {})})
                entry = (site, tiling.block_t, triton.cdiv(self.num_heads, tiling.head_tile),
                         1 if fuse else self.kv_halves)
                self.by_tiling[(tiling, fuse, pdl, fast)] = entry
            self.by_class[(cls, pdl)] = entry
        self.site = entry[0]
        return entry


def launch_warps(tiling: WriteTiling, quantize: bool) -> int:
    """The ``num_warps`` a tiling launches with: its own, except that a quantizing (fp8) launch
    keeps at least ``_MIN_FP8_ELEMENTS_PER_THREAD`` elements per thread (module comment).

    >>> launch_warps(WriteTiling(1, 8, 128, 16), True), launch_warps(WriteTiling(1, 8, 128, 16), False)
    (8, 16)
    """
    if not quantize:
        return tiling.num_warps
    elements = tiling.block_t * tiling.head_tile * tiling.d_pad
    return max(1, min(tiling.num_warps, elements // (32 * _MIN_FP8_ELEMENTS_PER_THREAD)))


_PREPARED: dict[tuple, _Prepared] = {}
_PREPARED_MAX = 1024


def _signature(key: Any, value: Any, cache: Any, slot_mapping: Any, spec: Any, k_scale: Any,
               v_scale: Any) -> tuple:
    """What the checks depend on, except the token count: equal signatures pass equal checks.

    Raises AttributeError/TypeError on anything that is not a tensor (the slow path then says why).
    """
    return (
        spec, key.shape[1:], key.stride(), key.dtype, key.device,
        None if value is None or spec.is_mla else
        (value.shape[1:], value.stride(), value.dtype, value.device),
        cache.shape, cache.stride(), cache.dtype, cache.device,
        slot_mapping.stride(), slot_mapping.dtype, slot_mapping.device,
        None if k_scale is None else (k_scale.dtype, k_scale.numel(), k_scale.device),
        None if v_scale is None else (v_scale.dtype, v_scale.numel(), v_scale.device),
    )


def _prepare(key: Any, value: Any, cache: Any, slot_mapping: Any, spec: Any, k_scale: Any,
             v_scale: Any) -> _Prepared:
    """All checks (FkvError before launch), then the launch values that depend on the spec only."""
    if not isinstance(spec, KVCacheSpec):
        raise FkvError(f"'spec' must be a KVCacheSpec (got {type(spec).__name__})")
    ins = check_write_inputs(key, value, cache, slot_mapping, spec, k_scale, v_scale)
    check_kernel_device(cache.device, _LAUNCHER.kernel, "cache", "write_kv")
    k = ins.key
    v = k if ins.value is None else ins.value
    st = cache_strides(spec)
    fixed = dict(
        num_slots=spec.num_blocks * spec.block_size, slot_stride=slot_mapping.stride(0),
        key_stride_t=k.stride(0), key_stride_h=k.stride(1), key_stride_d=k.stride(2),
        value_stride_t=v.stride(0), value_stride_h=v.stride(1), value_stride_d=v.stride(2),
        stride_block=st["stride_block"], stride_kv=st["stride_kv"],
        **write_constexprs(spec, ins.quantize),
    )
    return _Prepared(fixed, spec, ins.quantize, slot_mapping.device.type == "cpu",
                     _pdl_capable(cache.device))


def _pdl_capable(device: Any) -> bool:
    """Whether this kernel on ``device`` can use programmatic dependent launch (compiled, sm_90+)."""
    return _LAUNCHER.compiles and pdl_capable(device)


def write_kv(key: torch.Tensor, value: torch.Tensor | None, cache: torch.Tensor,
             slot_mapping: torch.Tensor, spec: KVCacheSpec, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, validate: bool | None = None,
             pdl: bool = False) -> None:
    """Write each token's K and V (MLA: its latent) into its slot of one layer's paged cache.

    Token ``t`` goes to block ``slot_mapping[t] // N``, offset ``slot_mapping[t] % N``; the
    addresses come from the spec's strides, so every layout is written correctly.

    - ``key``, ``value``: ``[T, H, D]`` with any strides (e.g. slices of a fused QKV tensor).
      MLA: ``key`` is the latent, ``[T, D]`` or ``[T, 1, D]``; ``value`` is ignored (pass None).
    - ``cache``: one layer's logical view of ``spec`` (from ``fkv.allocate``, also a cross-layer
      layer view): triton/flashinfer ``(NB, 2, N, H, D)``, flash_attn ``(2, NB, N, H, D)``, mla
      ``(NB, N, D)``; NHD or HND strides. Or, as engines pass it, the pair ``(key_cache,
      value_cache)`` of that view's halves: ``(cache[:, 0], cache[:, 1])`` (flash_attn:
      ``(cache[0], cache[1])``); both must be views of one buffer of ``spec`` (FkvError otherwise).
    - ``slot_mapping``: ``[T]`` int64 (or int32), any stride; negative = padding (nothing
      written). It may be shorter than ``key`` (extra rows are ignored), never longer.
    - fp8 ``spec.dtype`` fed with bf16/fp16/fp32: stored value is ``x / k_scale`` (``v_scale``),
      saturated to the fp8 range; ``k_scale``/``v_scale`` are float32 tensors of one element.
      Input already in the cache's fp8 dtype is stored unchanged.
    - ``validate``: raise FkvError naming the first slot ``>= num_blocks * block_size``, or an
      fp8 ``k_scale``/``v_scale`` that is not finite and > 0. Default:
      on for CPU tensors, off for CUDA (checking needs a device sync). Such slots are never written
      either way (masked in the kernel); with ``validate=False`` the call is CUDA-graph capturable.
    - ``pdl``: launch with programmatic dependent launch (sm_90 or newer; ignored elsewhere and on
      the CPU interpreter): the launch overlaps the end of the kernel before it on the stream, and
      the kernel waits for that kernel to finish (its writes visible) before it reads anything, so
      the bytes are the same. It pays off when the kernel before is itself launched with PDL
      (another ``write_kv(pdl=True)``, or an engine's PDL kernels): on an H200, 256 tokens per call
      in a CUDA graph of such calls took 1.87 us instead of 2.50 (bf16 NHD); right after a plain
      kernel it costs about 0.2 us more than without (bench/results/write-20261203T220331Z.json;
      bench/NOTES.md, write bench). Off by
      default.

    Repeated calls with the same input signature (spec, shapes but T, strides, dtypes, devices)
    reuse the checks and the compiled kernel and launch it directly (:mod:`fkv.ops._launch`).

    >>> import torch
    >>> from fkv import KVCacheSpec, allocate
    >>> spec = KVCacheSpec(layout="HND", num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> (cache,) = allocate(spec)
    >>> k, v = torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 2, 8).bfloat16()
    >>> write_kv(k, v, cache, torch.tensor([5, -1, 0]), spec)  # doctest: +SKIP
    >>> bool((cache[1, 0, 1] == k[0]).all()), bool((cache[0, 1, 0] == v[2]).all())  # doctest: +SKIP
    (True, True)

    (Runs on CUDA tensors, or on CPU with ``TRITON_INTERPRET=1`` set before triton is imported.)
    """
    check_pdl(pdl)
    check_validate(validate)
    if type(cache) is tuple or type(cache) is list:
        cache = join_kv_views(cache, spec)
    try:
        sig = _signature(key, value, cache, slot_mapping, spec, k_scale, v_scale)
        prep = _PREPARED.get(sig)
    except (AttributeError, TypeError):  # not tensors, or an unhashable spec
        sig = prep = None
    if prep is None:
        prep = _prepare(key, value, cache, slot_mapping, spec, k_scale, v_scale)
        if sig is not None:
            if len(_PREPARED) >= _PREPARED_MAX:
                _PREPARED.clear()
            _PREPARED[sig] = prep
        num_tokens = slot_mapping.shape[0]
    else:  # same signature as a checked call: only the token counts remain to check
        num_tokens = slot_mapping.shape[0]
        rows = key.shape[0]
        if num_tokens > rows or (not prep.is_mla and value.shape[0] != rows):
            check_token_counts(key, None if prep.is_mla else value, slot_mapping)
    if prep.cpu_slots if validate is None else validate:
        check_slots(slot_mapping, spec)
        if prep.quantize:
            check_scale_values(k_scale=k_scale, v_scale=None if prep.is_mla else v_scale)
    if num_tokens == 0:
        return
    if prep.is_mla:
        value, v_scale = key, k_scale
    if not prep.quantize:
        k_scale = v_scale = key
    site, block_t, head_tiles, halves = prep.launch_for(num_tokens, pdl)
    site(((num_tokens + block_t - 1) // block_t, halves, head_tiles),
         (key, value, cache, slot_mapping, k_scale, v_scale, num_tokens))
