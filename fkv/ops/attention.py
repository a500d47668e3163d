"""``fkv.ops.paged_attention``: causal attention over a paged KV cache of any layout (Triton).

Three thin layers: the kernels (``fkv.ops._attention_kernels``), a pure configuration function
(:func:`attention_config`: tiles, warps, stages and the flash-decoding split count from the shapes
alone, never from values or timing), and the launcher below, which checks every input against the
spec before anything launches. ``fkv.ops.reference.paged_attention`` shares the checks.

MLA caches (``backend="mla"``, logical ``(NB, N, D)``) are read as multi-query attention over the
latent: every query head attends to the one latent row per token, which is both key and value
(``stride_kv == 0``), so the output is ``[T, Hq, D]``. That is exactly the absorbed-weights MLA
decode when the query is already projected into the latent space (``q = [q_nope @ W_UK, q_rope]``):
the value part is ``out[..., :kv_lora_rank]`` (the remaining rope channels of the output are the
same weighted average over the rope part of the latent, and are usually dropped); ``scale``
defaults to ``1/sqrt(D)`` and should be passed explicitly for MLA models.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch

from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec
from fkv.ops._launch import (KernelLauncher, LaunchSite, check_kernel_device, cuda_capability,
                             pdl_capable)
from fkv.ops._spec import (cache_constexprs, cache_strides, check_cache, check_pdl,
                           check_scale_values, check_validate)

__all__ = ["AttentionConfig", "attention_config", "check_attention_inputs", "model_context",
           "paged_attention"]

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_HEAD_SIZE = 1024
#: flash-decoding splits, prefill-like tiles (compute-bound, one or two programs per SM): split
#: only a grid of fewer than this many programs per SM; every split streams at least
#: _MIN_SPLIT_TOKENS keys.
_PROGRAMS_PER_SM = 4
_MIN_SPLIT_TOKENS = 512
#: flash-decoding splits, decode-like tiles: a wave model of a memory-bound grid (fitted to the
#: H200 sweeps of issue 14, bench/NOTES.md). ``resident`` programs per SM run at once (by decode
#: tile, _DECODE_RESIDENT: without splits, with splits): grids beyond that run in waves. A wave of
#: n concurrent programs streams at the fraction ``1 - (1 - n / S)**2`` of the full bandwidth, S =
#: _SATURATING_PER_SM * num_sms (round 2, B=8 x 32768, 8 splits' time over that of n programs:
#: 64 0.32, 128 0.53-0.54, 256 0.88-0.89, 384 0.98-0.99;
#: bench/results/kernels-sweep-20261201T022307Z.json); each program costs _PROGRAM_OVERHEAD_KEYS
#: keys of its slot's time (start-up latency, partial output).
_RESIDENT_PER_SM = 3
_RESIDENT_PER_SM_SPLIT = 4
_SATURATING_PER_SM = 3
_PROGRAM_OVERHEAD_KEYS = 48
#: decode tile (tile_n, num_warps, num_stages) -> resident programs per SM (no splits, splits).
#: Round-2 H200 sweep (Triton 3.6, padded tables, NHD;
#: bench/results/kernels-sweep-20261201T022307Z.json): (64, 2, 3) runs 512 programs (B=64 x 8192,
#: no split) in one wave (0.486 ms vs 0.610 on 4 warps) and 576 split programs in two (B=8 x 32768:
#: 9 splits 0.356 ms, 8 splits 0.256); (128, 4, 2) fits about 2 per SM (B=8 x 32768: 4 splits =
#: 256 programs 0.257 ms, 8 = 512 0.292; B=16 x 4096: 2 splits 0.0815 HND (0.0816 NHD), 4 splits
#: 0.0925). Tiles not listed: the fit of round 1 ((64, 4, 3): 3 without, 4 with splits).
#: Round 4 (bench/results/kernels-sweep-20261201T052909Z.json): (128, 4, 5) double-buffers K/V
#: (3 buffers of 64 KiB): one program per SM; B=16 x 4096 unsplit 0.0789 ms (0.954x SDPA) vs 2
#: splits 0.0891, B=8 x 32768 2 splits 0.2549 (0.990x) vs 4 splits 0.2628.
_DECODE_RESIDENT = {(64, 2, 3): (4, 4), (128, 4, 2): (2, 2), (128, 4, 5): (1, 1)}
#: the split model sees the block table's capacity rounded down to 1/_CONTEXT_STEPS of its power
#: of two (model_context): spare columns change no split count.
_CONTEXT_STEPS = 8
#: scores as one FMA per element: p = exp2(qk * scale - m), the row max taken on raw qk.
_FMA_SCORES = True
#: default of AttentionConfig.fused_merge for split launches, and of lazy_rescale for tiles of
#: more than 16 rows: off until the issue-14 round-4 H200 sweep (bench/gpu_kernels_sweep.py)
#: measures them (attention_config is cached: clear it after changing these).
_FUSED_MERGE = False
_LAZY_RESCALE = False
#: default of AttentionConfig.row_halves: 16-bit tiles without splits of at least
#: _HALVES_MIN_ROWS[tuning key] rows (query tokens x heads, rounded up to a power of two). H200:
#: the 256-row prefill tile, B=4 x 4096 causal, 1.254 / 1.262 ms against 1.374 / 1.371 ms without
#: (same run; bench/results/raw/prefill-halves2-masked-exp-20261201T2124.json); the 128-row mid
#: tile on 4 warps (chunked prefill, 32 queries x 4 heads of 128; 64 x 4096) 0.385 / 0.385 ms
#: against 0.461 / 0.464 ms, the same bytes there (bench/results/raw/mid-halves-exp-20261201T2300
#: .json); 64-row tiles lose (0.463 / 0.457 against 0.290 / 0.287 ms). Head sizes <= 32 keep
#: halves to the 256-row tile (their mid tile is unmeasured; with 3 stages Triton 3.6's ptxas
#: crashed on it, whole or in halves). Every default was compiled for sm_90a with Triton 3.6
#: (bench/experiments/compile_defaults.py).
_ROW_HALVES = True
_HALVES_MIN_ROWS = {(32, False): 256, (128, False): 128}
#: default of AttentionConfig.warp_specialized for the 256-row prefill tile (head size 128,
#: 16-bit, no splits): the Gluon kernel of fkv.ops._attention_gluon on sm_90. H200, B=4 x 4096
#: causal: 1.228 / 1.218 ms (NHD / HND) against the Triton tile's 1.249 / 1.259 in the same run,
#: the same bytes (bench/results/raw/prefill-gluon-ws16-exp-20261202T0500.json).
#: ``FKV_ATTENTION_GLUON=0`` in the environment when fkv is imported turns it off (every launch
#: then runs the Triton kernel).
_WARP_SPECIALIZED = os.environ.get("FKV_ATTENTION_GLUON", "1").strip() != "0"
#: grid order: the KV heads of one (query tile, split) are consecutive programs, so they stream
#: neighbouring bytes of the same pages together (NHD interleaves heads within a token row).
_HEADS_FIRST = True
#: (head_pad up to, 32-bit inputs) -> (max rows (query token x head pairs) per program,
#: (tile_n, num_warps, num_stages) for: decode-like tiles (<= 16 rows), mid tiles (<= half the
#: max rows), full tiles[, decode-like tiles of a small grid]). Rows bound the fp32 accumulator's
#: registers. D <= 128, 16-bit: measured on the H200 (Triton 3.6, bench/NOTES.md; issue 14 sweeps,
#: padded block tables, ms NHD / HND; round 2: bench/results/kernels-sweep-20261201T022307Z.json,
#: round 4: bench/results/kernels-sweep-20261201T052909Z.json):
#: - decode, grids of >= num_sms programs without splits: 64 keys on 2 warps, 3 stages (B=64 x
#:   8192, no split: 0.486 / 0.486 vs 0.495 / 0.497 for (64, 4, 3) with 2 splits; B=256 x 2048:
#:   0.485 / 0.486 vs 0.519 / 0.519).
#: - decode, smaller grids (the 4th entry): 128 keys on 4 warps, 5 stages (the block-table ids
#:   take two, so K/V are double-buffered; one program per SM), splits filling one wave (round
#:   4: B=16 x 4096 unsplit 0.0789 / 0.0784 vs 0.0817 / 0.0824 for round 2's (128, 4, 2) with 2
#:   splits; B=8 x 32768, 2 splits: 0.2549 / 0.2546 vs 0.2577 / 0.2573 with 4 splits).
#: - prefill B=4 x 4096 causal: 256 rows (64 queries x 4 heads) x 64 keys on 8 warps, 5 stages
#:   (round 4: 1.368 / 1.370 vs 4 stages 1.481 / 1.474; 128-row tiles of 1, 2 or 4 heads and a
#:   lazy rescale took 12-37 % longer than it). 128-row tiles (mid) keep (64, 4, 3). With row
#:   halves (_ROW_HALVES, 2026-12-01 evening): 1.247-1.262 ms; 3, 4 and 6 stages 1.29 / 1.29 /
#:   1.25 (bench/results/raw/prefill-halves2-masked-exp-20261201T2124.json), 128-row tiles with
#:   halves 1.37 (4 warps) and 2.55 (8 warps), heads-last grid 1.29
#:   (bench/results/raw/prefill-halves3-exp-20261201T2127.json).
#: ``bench/gpu_kernels_sweep.py`` times alternatives on the GPU.
_TUNING = {
    # head_pad <= 32: as <= 128 but mid tiles take 2 stages. Triton 3.6's ptxas crashes
    # (SIGSEGV) on (64, 4, 3) mid tiles of 64 or 128 rows at head size 32 (16-bit cache, no window
    # nor softcap), found by compiling every default configuration of a grid of shapes for sm_90a
    # (bench/experiments/compile_defaults.py; bench/results/raw/compile-defaults-*: the failures
    # before, every head-32 kernel compiling after).
    (32, False): (256, (64, 2, 3), (64, 4, 2), (64, 8, 5), (128, 4, 5)),
    (128, False): (256, (64, 2, 3), (64, 4, 3), (64, 8, 5), (128, 4, 5)),
    (256, False): (64, (32, 4, 2), (32, 8, 2), (32, 8, 2)),
    (1024, False): (16, (16, 8, 1), (16, 8, 1), (16, 8, 1)),
    (128, True): (32, (32, 8, 2), (16, 8, 2), (16, 8, 2)),
    (256, True): (16, (16, 8, 2), (16, 8, 2), (16, 8, 2)),
    (1024, True): (16, (16, 8, 1), (16, 8, 1), (16, 8, 1)),
}


@attrs.frozen(kw_only=True)
class AttentionConfig:
    """Launch configuration of the attention kernel (one compiled variant per distinct value).

    - ``block_q``: query tokens of one sequence per program (1 for decode).
    - ``heads_per_program``: query heads of one KV head per program (GQA packing; all of them
      unless the tile would be too large, then the group is split into chunks).
    - ``tile_n``: keys per inner-loop iteration (several pages).
    - ``num_splits``: key segments per (query tile, KV head), reduced afterwards (flash-decoding).
    - ``num_warps``, ``num_stages``: Triton launch options.
    - ``fused_merge``: with several splits, the last split of each (query tile, head group) to
      finish merges them in the same launch (a ticket counter per group in a per-device, per-stream
      workspace that the kernel resets) instead of a second kernel; off: ``_reduce_splits_kernel``.
      Falls back to the second kernel while a CUDA graph is being captured and the workspace is
      too small (it cannot grow during capture). Concurrent calls on one stream are ordered, so
      they never share counters; a graph replayed on another stream concurrently with calls on
      its capture stream could, so keep the default (off) for that.
    - ``range_stages``: > 0 pipelines the unmasked key loop with ``tl.range(num_stages=...)``
      instead of the launch's ``num_stages`` (which then applies to the masked loops only). Same
      arithmetic either way. (Equal to ``num_stages`` it compiles to the same code: the launch
      option already pipelines the block-table ids of these loops.)
    - ``lazy_rescale``: unmasked key tiles (scores without softcap) raise the running row max,
      and rescale the accumulator, only when some row's max grew by more than 8 (base 2) since
      the last raise (FlashAttention-4's conditional rescaling, one decision per tile): fewer
      multiplies per tile once the maxima settle, one block-wide max more. Not bit-identical to
      the default (P is at most 2**8 instead of 1); as accurate.
    - ``row_halves``: a program's rows run as two halves with their own accumulators, and each
      unmasked key tile issues both halves' QK^T before either softmax, so one half's softmax
      overlaps the other's tensor-core work. The same values as without: the same bytes for
      16-bit queries where the halves run the whole tile's MMA instructions (the 256-row prefill
      tile on Hopper, measured; the CPU interpreter), otherwise within rounding (a smaller tile's
      halves may take another MMA shape, fp32 dot products another summation order). Applies to
      tiles of at least 32 rows (query tokens x heads, rounded up to a power of two) launched
      without splits (others ignore it); not with ``lazy_rescale`` or ``range_stages``.
    - ``warp_specialized``: on an sm_90 GPU (Hopper), the 256-row prefill tile (``block_q *
      heads_per_program == 256``, ``tile_n == 64``, no splits; head size 128, a 16-bit cache
      and queries of its dtype, block size 8 to 64, no window, softcap nor ``pdl``) runs as a
      warp-specialized Gluon kernel (``fkv.ops._attention_gluon``: a producer warp gathering
      pages, two consumer warp groups of 128 rows taking turns at the tensor cores) instead of
      the Triton kernel: the same bytes, 0.4-5 % faster on an H200 over nine runs
      (bench/results/attention-*.json from 2026-12-02 on, ``ms`` against ``triton_tile_ms``).
      Any other launch, a Triton without Gluon, or a kernel that fails to compile keeps the
      Triton kernel. The default turns it on for that tile unless ``FKV_ATTENTION_GLUON=0`` was
      set when fkv was imported.
    """

    block_q: int = attrs.field(validator=attrs.validators.ge(1))
    heads_per_program: int = attrs.field(validator=attrs.validators.ge(1))
    tile_n: int = attrs.field(validator=attrs.validators.ge(16))
    num_splits: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    num_warps: int = attrs.field(default=4, validator=attrs.validators.in_((1, 2, 4, 8, 16)))
    num_stages: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    fused_merge: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    range_stages: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    lazy_rescale: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    row_halves: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    warp_specialized: bool = attrs.field(default=False,
                                         validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.tile_n & (self.tile_n - 1):
            raise field_error("tile_n", self.tile_n, "a power of two >= 16")
        if self.row_halves and (self.lazy_rescale or self.range_stages):
            raise FkvError("AttentionConfig: 'row_halves' runs the plain key loop: it takes "
                           "neither 'lazy_rescale' nor 'range_stages'; turn those off")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def attention_config(*, num_seqs: int, num_q_tokens: int, num_q_heads: int, num_kv_heads: int,
                     head_size: int, max_context: int, itemsize: int, num_sms: int,
                     varlen: bool) -> AttentionConfig:
    """The default launch configuration: a pure function of the shapes (no autotuning).

    ``max_context`` is the block-table capacity in tokens (``max_blocks * block_size``): the split
    count never depends on ``seq_lens`` values, so choosing it needs no device sync. The model
    plans for :func:`model_context` of it (rounded down, so the padding columns engines allocate
    change nothing; the kernel cuts each sequence's keys by its real length). Decode (and varlen
    batches whose mean query length is small) takes the split count that minimizes
    :func:`_split_cost` (each split >= 512 keys) for its decode tile (a grid of fewer programs
    than SMs before splitting gets the small-grid tile, when the table has one); prefill-like
    tiles split only a small grid (to about ``4 * num_sms`` programs).

    >>> c = attention_config(num_seqs=8, num_q_tokens=8, num_q_heads=32, num_kv_heads=8,
    ...                      head_size=128, max_context=32768, itemsize=2, num_sms=132, varlen=False)
    >>> c.block_q, c.heads_per_program, c.num_splits, c.tile_n, c.num_warps
    (1, 4, 2, 128, 4)
    """
    group = num_q_heads // num_kv_heads
    head_pad = _pow2(max(head_size, 16))
    if head_pad > _MAX_HEAD_SIZE:
        raise field_error("head_size", head_size, f"<= {_MAX_HEAD_SIZE} for attention")
    size = next(k for k in _TUNING if head_pad <= k[0] and (itemsize >= 4) == k[1])
    rows_cap, decode_tiles, mid_tiles, full_tiles, *small_grid = _TUNING[size]
    heads = min(group, rows_cap)
    if varlen:
        mean_q = max(1, -(-num_q_tokens // max(num_seqs, 1)))
        block_q = max(1, min(_pow2(mean_q), rows_cap // heads))
    else:
        block_q = 1
    rows = block_q * heads
    tile_n, warps, stages = (decode_tiles if rows <= 16 else
                             mid_tiles if 2 * rows <= rows_cap else full_tiles)
    chunks = -(-group // heads)
    tiles = num_seqs if not varlen else num_q_tokens // block_q + num_seqs
    programs = max(1, tiles * num_kv_heads * chunks)
    if rows <= 16 and small_grid and programs < num_sms:
        tile_n, warps, stages = small_grid[0]
    max_context = model_context(max_context)
    most = max(1, -(-max_context // max(_MIN_SPLIT_TOKENS, tile_n)))
    if rows <= 16:
        resident = decode_residency(tile_n, warps, stages)
        splits = min(range(1, most + 1), key=lambda n: _split_cost(
            n, programs, max_context, tile_n, num_sms, resident))
    else:
        splits = max(1, min(-(-(_PROGRAMS_PER_SM * num_sms) // programs), most))
    splits = -(-max_context // _split_len(max_context, splits, tile_n))
    halves = (_ROW_HALVES and splits == 1 and not _LAZY_RESCALE
              and _pow2(rows) >= _HALVES_MIN_ROWS.get(size, 1 << 30))
    ws = (_WARP_SPECIALIZED and halves and rows == 256 and tile_n == 64 and warps == 8
          and head_size == 128 and itemsize == 2)
    return AttentionConfig(block_q=block_q, heads_per_program=heads, tile_n=tile_n,
                           num_splits=splits, num_warps=warps, num_stages=stages,
                           fused_merge=_FUSED_MERGE and splits > 1,
                           lazy_rescale=_LAZY_RESCALE and rows > 16, row_halves=halves,
                           warp_specialized=ws)


def model_context(max_context: int) -> int:
    """The context the split model plans for: the block table's capacity rounded down to a
    multiple of ``max(512, 2**floor(log2(capacity)) / 8)`` tokens (unchanged below 512).

    Engines allocate block tables with spare columns (one more than needed, or a fixed maximum);
    rounding makes the split count, hence the grid, the same with or without them (the kernel
    splits each sequence by its real length, so the extra capacity is never walked).

    >>> [model_context(c) for c in (32768, 32768 + 16, 2048 + 16, 4096 + 16, 8192 + 48, 300)]
    [32768, 32768, 2048, 4096, 8192, 300]
    """
    step = max(_MIN_SPLIT_TOKENS, (1 << (max(1, max_context).bit_length() - 1)) // _CONTEXT_STEPS)
    return max_context - max_context % step if max_context >= step else max_context


def _split_len(max_context: int, splits: int, tile_n: int) -> int:
    """Keys per split: whole tiles (the last split may be shorter)."""
    return -(-(-(-max_context // splits)) // tile_n) * tile_n


def decode_residency(tile_n: int, num_warps: int, num_stages: int) -> tuple[int, int]:
    """Resident programs per SM the split model assumes for a decode tile (no splits, splits)."""
    return _DECODE_RESIDENT.get((tile_n, num_warps, num_stages),
                                (_RESIDENT_PER_SM, _RESIDENT_PER_SM_SPLIT))


def _split_cost(splits: int, programs: int, max_context: int, tile_n: int, num_sms: int,
                resident: tuple[int, int] = (_RESIDENT_PER_SM, _RESIDENT_PER_SM_SPLIT)) -> float:
    """Modelled time of a memory-bound split grid, in keys streamed at the full bandwidth.

    ``programs * splits`` programs of ``split_len`` keys run in waves of ``slots`` (resident
    programs: ``resident[1]`` per SM with splits, ``resident[0]`` without); a wave
    of ``n`` programs streams ``n * split_len`` keys at the fraction ``_wave_rate(n)`` of the full
    bandwidth; each program adds ``_PROGRAM_OVERHEAD_KEYS``. A split count that rounds to fewer
    splits costs as much as that count plus a little, so ties go to the smaller one.

    >>> [round(_split_cost(n, 128, 4096, 128, 132, (2, 2)) / 1000) for n in (1, 2, 3, 4, 8)]  # B=16
    [973, 611, 765, 624, 649]
    """
    split_len = _split_len(max_context, splits, tile_n)
    total = programs * -(-max_context // split_len)
    slots = (resident[1] if total > programs else resident[0]) * num_sms
    waves, rest = divmod(total, slots)
    saturating = _SATURATING_PER_SM * num_sms
    time = waves * slots / _wave_rate(slots, saturating)
    if rest:
        time += rest / _wave_rate(rest, saturating)
    return split_len * time + total * _PROGRAM_OVERHEAD_KEYS + splits * 1e-6


def _wave_rate(n: int, saturating: int) -> float:
    """Fraction of the full bandwidth ``n`` concurrent streaming programs reach."""
    return 1.0 - (1.0 - min(n, saturating) / saturating) ** 2


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # CPU (Triton interpreter): small grids


#: a forced default (see _set_config_override): None, a dict of AttentionConfig fields applied to
#: the default, or a function (default, **shapes) -> AttentionConfig.
_CONFIG_OVERRIDE: Any = None


def _set_config_override(override: Any) -> None:
    """Change the default configuration of every later call that passes no ``config``: a dict of
    :class:`AttentionConfig` fields to apply to :func:`attention_config`'s choice (for example
    ``{"fused_merge": True}``), a function ``(default, **shapes) -> AttentionConfig`` (the shapes
    are :func:`attention_config`'s keyword arguments), or None for the default. The GPU sweep's and
    the benches' knob: candidates run through the whole launcher before they become defaults."""
    global _CONFIG_OVERRIDE
    if override is not None and not (isinstance(override, dict) or callable(override)):
        raise field_error("override", override,
                          "a dict of AttentionConfig fields, a function or None")
    if isinstance(override, dict):
        attrs.evolve(AttentionConfig(block_q=1, heads_per_program=1, tile_n=16), **override)
    _CONFIG_OVERRIDE = override


def _overridden(default: AttentionConfig, shapes: dict[str, Any]) -> AttentionConfig:
    override = _CONFIG_OVERRIDE
    if override is None:
        return default
    if isinstance(override, dict):
        return attrs.evolve(default, **override)
    cfg = override(default, **shapes)
    if not isinstance(cfg, AttentionConfig):
        raise field_error("config override result", cfg, "an AttentionConfig")
    return cfg


#: ticket counters of fused split merges, per (device, stream): zero between launches (the kernel
#: resets each counter it uses), grown by reallocation outside CUDA graph capture.
_MERGE_COUNTERS: dict[tuple[Any, ...], torch.Tensor] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least ``n`` zeroed int32 counters for a fused merge on ``device``'s current stream, or
    None when they would have to be allocated during CUDA graph capture."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (str(device), stream)
    buf = _MERGE_COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        size = max(n, 2 * buf.numel() if buf is not None else 1024)
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _MERGE_COUNTERS[key] = buf
    return buf


class Problem(NamedTuple):
    """Derived sizes of a checked call."""

    num_seqs: int
    num_q_tokens: int
    num_q_heads: int
    group: int
    varlen: bool
    max_context: int
    scale: float
    window: int | None    # sliding window; None when off (None or 0 given)
    softcap: float | None  # logit softcap; None when off (None or 0 given)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _check_index(name: str, t: Any, ndim: int, device: torch.device) -> None:
    if not _is_tensor(t):
        raise field_error(name, type(t).__name__, "a torch.Tensor")
    if t.dim() != ndim:
        raise FkvError(f"{name!r} must have {ndim} dim(s) (got shape {tuple(t.shape)})")
    if t.dtype not in _INDEX_DTYPES:
        raise field_error(f"{name}.dtype", str(t.dtype), "torch.int32 or torch.int64")
    if t.device != device:
        raise FkvError(f"{name!r} is on {t.device} but 'q' is on {device}; move it to {device}")


def _check_scale_tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise field_error(name, value, "a finite scale > 0")
        value = torch.full((1,), float(value), dtype=torch.float32, device=device)
    if not _is_tensor(value) or value.numel() != 1 or value.dtype != torch.float32:
        raise field_error(name, value if not _is_tensor(value) else
                          f"tensor {tuple(value.shape)} {value.dtype}",
                          "a float or a float32 tensor of one element")
    if value.device != device:
        raise FkvError(f"{name!r} is on {value.device} but 'q' is on {device}")
    return value


def check_attention_inputs(q: Any, cache: Any, spec: KVCacheSpec, block_table: Any, seq_lens: Any,
                           *, query_start_loc: Any = None, scale: Any = None,
                           sliding_window: Any = None, softcap: Any = None, k_scale: Any = None,
                           v_scale: Any = None, out: Any = None, alibi_slopes: Any = None,
                           sinks: Any = None) -> Problem:
    """Check shapes, dtypes, devices and options of a ``paged_attention`` call (no device sync).

    Raises FkvError naming the field, the value and what was expected.
    """
    check_cache(cache, spec)
    if not _is_tensor(q):
        raise field_error("q", type(q).__name__, "a torch.Tensor [total_q_tokens, Hq, D]")
    if q.dim() != 3 or q.shape[2] != spec.head_size:
        raise FkvError(f"'q' must have shape [total_q_tokens, Hq, {spec.head_size}] (head_size of "
                       f"the spec) (got {tuple(q.shape)})")
    if q.dtype not in _Q_DTYPES:
        raise field_error("q.dtype", str(q.dtype), "torch.bfloat16, torch.float16 or torch.float32")
    if not spec.is_fp8 and str(q.dtype).removeprefix("torch.") != spec.dtype:
        raise FkvError(f"'q.dtype' is {q.dtype} but the cache holds {spec.dtype!r}; q must have the "
                       f"cache's dtype (only fp8 caches take a q of another dtype)")
    if spec.head_size > _MAX_HEAD_SIZE:
        raise field_error("spec.head_size", spec.head_size, f"<= {_MAX_HEAD_SIZE} for attention")
    device = q.device
    if cache.device != device:
        raise FkvError(f"'cache' is on {cache.device} but 'q' is on {device}")
    num_q_heads, hkv = q.shape[1], spec.num_kv_heads
    if num_q_heads < hkv or num_q_heads % hkv:
        raise FkvError(f"'q' has {num_q_heads} query heads, which must be a positive multiple of "
                       f"the cache's {hkv} KV heads (GQA: query head h uses KV head h // (Hq/Hkv))")
    _check_index("block_table", block_table, 2, device)
    _check_index("seq_lens", seq_lens, 1, device)
    num_seqs = block_table.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise FkvError(f"'seq_lens' has {seq_lens.shape[0]} entries but 'block_table' has "
                       f"{num_seqs} rows; both need one per sequence")
    if block_table.shape[1] < 1 and num_seqs:
        raise FkvError("'block_table' must have at least one column (got shape "
                       f"{tuple(block_table.shape)})")
    if query_start_loc is None:
        varlen = False
        if q.shape[0] != num_seqs:
            raise FkvError(f"decode (query_start_loc=None) takes one query per sequence: 'q' has "
                           f"{q.shape[0]} tokens but there are {num_seqs} sequences; pass "
                           f"query_start_loc for prefill")
    else:
        varlen = True
        _check_index("query_start_loc", query_start_loc, 1, device)
        if query_start_loc.shape[0] != num_seqs + 1:
            raise FkvError(f"'query_start_loc' must have num_seqs + 1 = {num_seqs + 1} cumulative "
                           f"offsets (got {query_start_loc.shape[0]})")
    if scale is None:
        scale = 1.0 / math.sqrt(spec.head_size)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0):
        raise field_error("scale", scale, "a positive finite float (or None for 1/sqrt(head_size))")
    # Engines pass 0 for "off" (vLLM's sliding_window and logits_soft_cap): 0 and None mean off.
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int) or sliding_window < 0):
        raise field_error("sliding_window", sliding_window, "a positive int, or 0 / None for no window")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not (math.isfinite(softcap) and softcap >= 0)):
        raise field_error("softcap", softcap, "a positive finite float, or 0 / None for no softcap")
    if spec.is_fp8:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is None:
                raise FkvError(f"{name!r} is required for an fp8 cache ({spec.dtype}): pass the "
                               f"per-tensor float32 scale the cache was written with")
            _check_scale_tensor(name, value, device)
    elif k_scale is not None or v_scale is not None:
        raise FkvError(f"'k_scale'/'v_scale' apply only to fp8 caches, but spec.dtype is "
                       f"{spec.dtype!r}; drop them")
    if out is not None:
        if not _is_tensor(out) or tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if _is_tensor(out) else type(out).__name__
            raise field_error("out", got, f"a tensor of q's shape {tuple(q.shape)} and dtype {q.dtype}")
        if out.device != device:
            raise FkvError(f"'out' is on {out.device} but 'q' is on {device}")
    for name, value in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if value is None:
            continue
        if (not _is_tensor(value) or value.dtype != torch.float32 or value.dim() != 1
                or value.shape[0] != num_q_heads):
            got = (f"{tuple(value.shape)} {value.dtype}" if _is_tensor(value)
                   else type(value).__name__)
            raise field_error(name, got, f"a float32 tensor of shape ({num_q_heads},): one value "
                              f"per query head", "convert with .float()")
        if value.device != device:
            raise FkvError(f"{name!r} is on {value.device} but 'q' is on {device}")
    return Problem(num_seqs=num_seqs, num_q_tokens=q.shape[0], num_q_heads=num_q_heads,
                   group=num_q_heads // hkv, varlen=varlen,
                   max_context=block_table.shape[1] * spec.block_size, scale=float(scale),
                   window=sliding_window or None, softcap=float(softcap) if softcap else None)


def check_attention_values(spec: KVCacheSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor | None, num_q_tokens: int) -> None:
    """Check the values of the index tensors with one device sync (skipped during graph capture).

    Every block id a sequence uses (the first ``ceil(seq_len / block_size)`` of its row) must be in
    ``[0, num_blocks)``; ``seq_lens`` within the block table's capacity; ``query_start_loc`` starts
    at 0, never decreases, ends at ``num_q_tokens``, and no sequence has more queries than tokens.
    """
    if seq_lens.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    if block_table.shape[0] == 0:
        if query_start_loc is not None and num_q_tokens:
            raise FkvError(f"'query_start_loc' must run from 0 to total_q_tokens={num_q_tokens}, "
                           f"but there are no sequences")
        return
    n = spec.block_size
    lens = seq_lens.to(torch.int64)
    cap = block_table.shape[1] * n
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < ((lens + n - 1) // n)[:, None]
    bt = block_table.to(torch.int64)
    bad_block = ((bt < 0) | (bt >= spec.num_blocks)) & used
    checks = [lens < 0, lens > cap, bad_block.any(1)]
    if query_start_loc is None:
        checks.append(lens < 1)
    else:
        qsl = query_start_loc.to(torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        checks += [q_lens < 0, q_lens > lens]
    flags = torch.stack(checks)  # [num_checks, B]
    summary = torch.cat([flags.any(1).to(torch.int64), flags.to(torch.int64).argmax(1)])
    extra = []
    if query_start_loc is not None:
        extra = [query_start_loc[0].to(torch.int64), query_start_loc[-1].to(torch.int64)]
    values = torch.cat([summary, torch.stack(extra)]) if extra else summary
    v = values.tolist()  # the one sync
    k = len(checks)
    hit, where = v[:k], v[k:2 * k]
    if query_start_loc is not None:
        first, last = v[2 * k], v[2 * k + 1]
        if first != 0 or last != num_q_tokens:
            raise FkvError(f"'query_start_loc' must run from 0 to total_q_tokens={num_q_tokens} "
                           f"(got {first} ... {last})")
    if hit[0]:
        b = where[0]
        raise field_error(f"seq_lens[{b}]", int(seq_lens[b]), "a non-negative token count")
    if hit[1]:
        b = where[1]
        raise FkvError(f"'seq_lens[{b}]' is {int(seq_lens[b])} tokens but the block table holds "
                       f"{block_table.shape[1]} blocks of {n} = {cap} tokens per sequence")
    if hit[2]:
        b = where[2]
        row = bad_block[b].nonzero()[0, 0].item()
        raise FkvError(f"'block_table[{b}, {row}]' is {int(block_table[b, row])}, outside the "
                       f"cache's [0, {spec.num_blocks}) blocks (sequence {b} uses its first "
                       f"{-(-int(seq_lens[b]) // n)} entries)")
    if query_start_loc is None:
        if hit[3]:
            raise field_error(f"seq_lens[{where[3]}]", int(seq_lens[where[3]]),
                              ">= 1 in decode (the query's own token is in the cache)")
    else:
        if hit[3]:
            b = where[3]
            raise FkvError(f"'query_start_loc' decreases at sequence {b} "
                           f"({int(query_start_loc[b])} -> {int(query_start_loc[b + 1])})")
        if hit[4]:
            b = where[4]
            raise FkvError(f"sequence {b} has {int(query_start_loc[b + 1] - query_start_loc[b])} "
                           f"queries but 'seq_lens[{b}]' is {int(seq_lens[b])}; the queries are the "
                           f"last tokens of the sequence, so seq_len must include them")


def _interpreted(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def paged_attention(q: torch.Tensor, cache: torch.Tensor, spec: KVCacheSpec,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                    query_start_loc: torch.Tensor | None = None, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    k_scale: Any = None, v_scale: Any = None, out: torch.Tensor | None = None,
                    validate: bool | None = None,
                    config: AttentionConfig | None = None, pdl: bool = False,
                    alibi_slopes: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``q`` over one layer of a paged KV cache, any backend and layout.

    Shapes: ``q`` ``[T, Hq, D]`` (bf16, fp16 or fp32); ``cache`` one layer's logical view of
    ``spec`` (triton/flashinfer ``(NB, 2, N, H, D)``, flash_attn ``(2, NB, N, H, D)``, mla
    ``(NB, N, D)``; NHD or HND, per-layer or cross-layer); ``block_table`` ``[B, max_blocks]``
    int32; ``seq_lens`` ``[B]`` tokens per sequence (context plus queries). Returns ``[T, Hq, D]``
    in q's dtype (written into ``out`` when given).

    - decode: ``query_start_loc=None``, one query per sequence (``T == B``), at position
      ``seq_len - 1``.
    - prefill / chunked prefill: ``query_start_loc`` ``[B + 1]`` cumulative query offsets; the
      queries of sequence b are its last ``qsl[b+1] - qsl[b]`` tokens.
    - query head h reads KV head ``h // (Hq / Hkv)``; ``sliding_window=W``: position p sees keys
      ``p-W+1 .. p``; ``softcap=c``: scores (after ``scale``, default ``1/sqrt(D)``) become
      ``c * tanh(s / c)``; as engines pass them, ``sliding_window=0`` and ``softcap=0`` mean off
      (like None); fp8 caches need ``k_scale``/``v_scale`` (float32, one element).
    - MLA: multi-query attention over the latent, which is both key and value (module docstring).
    - ``validate``: check the values of ``block_table`` (the entries each sequence uses),
      ``seq_lens``, ``query_start_loc`` and fp8 ``k_scale``/``v_scale`` tensors (finite, > 0;
      a float scale is always checked) and raise FkvError naming the first bad one. Default, as
      in ``write_kv``: on for CPU tensors, off for CUDA (checking needs a device sync); always
      skipped during CUDA graph capture. Unvalidated bad values never fault nor write outside
      ``out``: the kernel reads block 0 for an id outside ``[0, num_blocks)``, clamps ``seq_lens``
      to the block table's capacity and masks query rows outside ``q``; the affected outputs are
      unspecified. ``config`` overrides :func:`attention_config`.
    - ``alibi_slopes``: float32 ``[Hq]``, ALiBi: query head ``h`` adds ``alibi_slopes[h] * (key
      position - query position)`` to its scores (after the softcap). ``sinks``: float32
      ``[Hq]``, attention sinks: query head ``h``'s softmax gets one more logit, ``sinks[h]``,
      with no value (its share of the weight goes nowhere). Both are checked finite when
      ``validate`` is (below). Such launches run the Triton kernel (not the Gluon prefill tile).
    - ``pdl``: launch the attention kernel with programmatic dependent launch (sm_90 or newer;
      ignored elsewhere), as ``write_kv(pdl=True)``: it waits for the kernel before it to finish
      before reading anything and lets the next PDL kernel launch early (a split launch's merge
      kernel is launched plainly after it). Same bytes. On an H200 a decode step's write and
      attention per layer, both with PDL, came within -2 % .. +1 % of the plain launches
      (bench/results/raw/pdl-decode-step-exp-20261201T1915.json): off by default, for engines whose
      other kernels use PDL.

    >>> import torch, fkv
    >>> spec = fkv.KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=2,
    ...                        head_size=64, dtype="float32")
    >>> (cache,) = fkv.allocate(spec)
    >>> _ = cache.copy_(torch.randn(cache.shape))
    >>> q = torch.randn(2, 4, 64)                         # decode: 2 sequences, 4 query heads
    >>> bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    >>> out = paged_attention(q, cache, spec, bt, torch.tensor([20, 7], dtype=torch.int32))
    >>> out.shape
    torch.Size([2, 4, 64])
    """
    prob = check_attention_inputs(q, cache, spec, block_table, seq_lens,
                                  query_start_loc=query_start_loc, scale=scale,
                                  sliding_window=sliding_window, softcap=softcap,
                                  k_scale=k_scale, v_scale=v_scale, out=out,
                                  alibi_slopes=alibi_slopes, sinks=sinks)
    if config is not None and not isinstance(config, AttentionConfig):
        raise field_error("config", config, "an AttentionConfig or None")
    check_pdl(pdl)
    check_validate(validate)
    device = q.device
    if spec.is_fp8:
        k_scale = _check_scale_tensor("k_scale", k_scale, device)
        v_scale = _check_scale_tensor("v_scale", v_scale, device)
    if device.type == "cpu" if validate is None else validate:
        check_attention_values(spec, block_table, seq_lens, query_start_loc, prob.num_q_tokens)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if spec.is_fp8:
                check_scale_values(k_scale=k_scale, v_scale=v_scale)
            check_finite_per_head(alibi_slopes=alibi_slopes, sinks=sinks)
    if out is None:
        out = torch.empty_like(q)
    if prob.num_q_tokens == 0 or prob.num_seqs == 0:
        return out
    if config is None:
        shapes = dict(
            num_seqs=prob.num_seqs, num_q_tokens=prob.num_q_tokens, num_q_heads=prob.num_q_heads,
            num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, max_context=prob.max_context,
            itemsize=q.element_size(), num_sms=_num_sms(device), varlen=prob.varlen)
        config = attention_config(**shapes)
        if _CONFIG_OVERRIDE is not None:
            config = _overridden(config, shapes)
    # The kernels step one element along seq_lens, query_start_loc and a block-table row (the
    # table's row stride is an argument): other strides take a copy (none for engines' tensors).
    block_table, seq_lens = _unit_stride(block_table), _unit_stride(seq_lens)
    if query_start_loc is not None:
        query_start_loc = _unit_stride(query_start_loc)
    _launch(q, cache, spec, block_table, seq_lens, query_start_loc, prob, config,
            prob.window, prob.softcap, k_scale, v_scale, out,
            pdl and not _interpreted(device) and pdl_capable(device), alibi_slopes, sinks)
    return out


def check_finite_per_head(**values: Any) -> None:
    """Raise FkvError naming the first query head whose ALiBi slope or sink (a float32 tensor,
    or None: skipped) is not finite (one device sync for CUDA tensors)."""
    for name, value in values.items():
        if value is None:
            continue
        bad = torch.nonzero(~torch.isfinite(value)).flatten()
        if bad.numel():
            h = int(bad[0])
            raise FkvError(f"'{name}[{h}]' is {float(value[h])}; every query head's value must be "
                           f"finite")


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when its last dim has more than one element and a stride other
    than 1 (a slice with a step, a transposed or an expanded tensor)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def gluon_prefill_refusal(q: torch.Tensor, spec: KVCacheSpec, out: torch.Tensor, *,
                          varlen: bool, rows: int, tile_n: int, splits: int,
                          sliding_window: int | None, softcap: float | None, pdl: bool,
                          cache_dtype: torch.dtype, alibi: bool = False,
                          sinks: bool = False) -> str | None:
    """None where a launch is one the warp-specialized Gluon prefill kernel computes
    (``AttentionConfig.warp_specialized``), else the first reason it is not (the Triton kernel
    then runs it). The device is checked apart (:func:`_gluon_device`)."""
    if not varlen:
        return "decode (no query_start_loc)"
    if rows != 256 or tile_n != 64:
        return f"a {rows}-row tile of {tile_n} keys (256 x 64 wanted)"
    if splits != 1:
        return f"{splits} splits"
    if sliding_window is not None:
        return "a sliding window"
    if softcap is not None:
        return "a softcap"
    if alibi:
        return "ALiBi slopes"
    if sinks:
        return "attention sinks"
    if pdl:
        return "pdl=True"
    if spec.is_mla:
        return "an MLA cache"
    if spec.is_fp8:
        return "an fp8 cache"
    if spec.head_size != 128:
        return f"head size {spec.head_size} (128 wanted)"
    if spec.block_size not in (8, 16, 32, 64):
        return f"block size {spec.block_size} (8 to 64 wanted)"
    if q.dtype not in (torch.bfloat16, torch.float16) or q.dtype != cache_dtype:
        return f"{q.dtype} queries on a {cache_dtype} cache"
    if q.stride(2) != 1 or out.stride(2) != 1:
        return "q or out strided along the head dimension"
    if not (_FMA_SCORES and _HEADS_FIRST):
        return "kernel knobs changed from their defaults"
    return None


def _gluon_device(device: torch.device) -> bool:
    """An sm_90 GPU (Hopper): the kernel's warpgroup MMAs and register reallocation."""
    return cuda_capability(device) == (9, 0)


def _fp32_score_mult(scale: float) -> float:
    """``scale * log2(e)`` rounded as the Triton kernel computes it (two fp32 operands, an fp32
    product), so both kernels scale the scores by the same number."""
    return float(np.float32(scale) * np.float32(1.4426950408889634))


# The attention kernel's direct launch (fkv.ops._launch): one KernelLauncher per kernel object
# (tests and experiments swap the module's kernel for a recorder or a variant), one LaunchSite
# per set of fixed arguments and launch options.
_LAUNCHERS: dict[int, KernelLauncher] = {}
_SITES: dict[tuple, LaunchSite] = {}
_PER_CALL = ("q_ptr", "cache_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr", "k_scale_ptr",
             "v_scale_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr", "ctr_ptr", "alibi_ptr",
             "sinks_ptr",
             "scale", "softcap", "window", "num_seqs", "num_tiles", "num_q_tokens", "max_context",
             "num_splits", "stride_qt", "stride_qh", "stride_qd", "stride_ot", "stride_oh",
             "stride_od", "stride_bt")
_POINTERS = _PER_CALL[:13]


def _site(kernel: Any, fixed: dict[str, Any], options: tuple[int, int, bool],
          args: tuple) -> LaunchSite:
    """The launch site of ``kernel`` for these fixed arguments, (num_warps, num_stages, pdl) and
    the dtypes of the per-call tensors ``args[:13]``: a site's compiled variants are keyed by
    alignment and integer specialization only, and Triton types each pointer by its dtype (a
    bf16 variant must never run fp16 queries or an int64 block table)."""
    key = (id(kernel), tuple(fixed.values()), options, tuple(a.dtype for a in args[:13]))
    site = _SITES.get(key)
    if site is None or site.launcher.kernel is not kernel:
        launcher = _LAUNCHERS.get(id(kernel))
        if launcher is None or launcher.kernel is not kernel:
            launcher = _LAUNCHERS[id(kernel)] = KernelLauncher(kernel, _PER_CALL, _POINTERS)
        warps, stages, pdl = options
        site = _SITES[key] = launcher.site(fixed, {"num_warps": warps, "num_stages": stages,
                                                   **({"launch_pdl": True} if pdl else {})})
    return site


def _launch(q: torch.Tensor, cache: torch.Tensor, spec: KVCacheSpec, block_table: torch.Tensor,
            seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None, prob: Problem,
            config: AttentionConfig, sliding_window: int | None, softcap: float | None,
            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, out: torch.Tensor,
            pdl: bool = False, alibi_slopes: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None) -> None:
    from fkv.ops._attention_kernels import _paged_attention_kernel, _reduce_splits_kernel

    check_kernel_device(q.device, _paged_attention_kernel, "q", "paged_attention")
    head_size = spec.head_size
    head_pad = _pow2(max(head_size, 16))
    heads = min(config.heads_per_program, prob.group)
    chunks = -(-prob.group // heads)
    block_q = config.block_q if prob.varlen else 1
    tile_n = config.tile_n
    # Never more splits than tiles of capacity; the kernel cuts each sequence by its real length.
    num_splits = max(1, min(config.num_splits, -(-prob.max_context // tile_n)))
    num_tiles = prob.num_q_tokens // block_q + prob.num_seqs if prob.varlen else prob.num_seqs
    strides = cache_strides(spec)
    split = num_splits > 1
    if split:
        part_out = torch.empty((prob.num_q_tokens, prob.num_q_heads, num_splits, head_size),
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty((prob.num_q_tokens, prob.num_q_heads, num_splits),
                               dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if (config.warp_specialized and _gluon_device(q.device) and gluon_prefill_refusal(
            q, spec, out, varlen=prob.varlen, rows=block_q * heads, tile_n=tile_n,
            splits=num_splits, sliding_window=sliding_window, softcap=softcap, pdl=pdl,
            cache_dtype=cache.dtype, alibi=alibi_slopes is not None,
            sinks=sinks is not None) is None):
        from fkv.ops import _attention_gluon

        if _attention_gluon.launch(
                q, cache, block_table, seq_lens, query_start_loc, out,
                score_mult=_fp32_score_mult(prob.scale), num_seqs=prob.num_seqs,
                num_tiles=num_tiles, num_q_tokens=prob.num_q_tokens, num_blocks=spec.num_blocks,
                max_context=prob.max_context, strides=strides, block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads, head_size=head_size, group=prob.group,
                heads=heads, chunks=chunks, block_q=block_q):
            return
    dummy = seq_lens
    block_m = _pow2(max(16, block_q * heads))  # rows per program (a power of two >= 16)
    grid = (num_tiles * spec.num_kv_heads * chunks, num_splits)
    counters = _merge_counters(q.device, grid[0]) if split and config.fused_merge else None
    fused = counters is not None
    fixed = {
        "num_q_heads": prob.num_q_heads, "num_blocks": spec.num_blocks,
        "stride_block": strides["stride_block"], "stride_kv": strides["stride_kv"],
        "stride_head": strides["stride_head"], **cache_constexprs(spec),
        "STRIDE_TOKEN": strides["stride_token"],
        "HEAD_PAD": head_pad, "GROUP": prob.group, "HEADS_PER_PROG": heads, "HEAD_CHUNKS": chunks,
        "BLOCK_Q": block_q, "BLOCK_M": block_m, "TILE_N": tile_n,
        "VARLEN": prob.varlen, "SPLIT": split, "USE_WINDOW": sliding_window is not None,
        "USE_SOFTCAP": softcap is not None,
        "DOT_F32": _interpreted(q.device) and q.dtype == torch.bfloat16,
        "PRECISION": "ieee" if q.dtype == torch.float32 else None, "HEADS_FIRST": _HEADS_FIRST,
        "FMA_SCORES": _FMA_SCORES, "FUSED_MERGE": fused, "RANGE_STAGES": config.range_stages,
        "LAZY_RESCALE": config.lazy_rescale, "PDL": pdl,
        "ROW_HALVES": config.row_halves and not split and block_m >= 32,
        "USE_ALIBI": alibi_slopes is not None, "USE_SINKS": sinks is not None,
    }
    args = (
        q, cache, block_table, seq_lens,
        query_start_loc if query_start_loc is not None else dummy,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        out, part_out, part_lse, counters if fused else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        sinks if sinks is not None else dummy,
        prob.scale, float(softcap or 1.0), int(sliding_window or 0), prob.num_seqs, num_tiles,
        prob.num_q_tokens, prob.max_context, num_splits,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        block_table.stride(0))
    options = (config.num_warps, config.num_stages, pdl)
    _site(_paged_attention_kernel, fixed, options, args)((grid[0], grid[1], 1), args)
    if split and not fused:
        _reduce_splits_kernel[(prob.num_q_tokens, prob.num_q_heads)](
            part_out, part_lse, out, prob.num_q_heads, num_splits,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, SPLITS_PAD=_pow2(max(num_splits, 2)),
            num_warps=4,
        )
