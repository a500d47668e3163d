"""Triton kernels of ``fkv.ops.paged_attention`` (pointers, strides and constexprs only).

One kernel serves decode and varlen prefill. A program owns ``BLOCK_Q`` query tokens of one
sequence times ``HEADS_PER_PROG`` query heads that share one KV head (GQA packing: the rows of the
score tile are (query token, head) pairs, so each K/V tile is read once for all of them), and one
of ``num_splits`` segments of the keys it sees (flash-decoding when there are several), cut by the
sequence's real length so padding columns of the block table cost nothing.
Keys are walked in tiles of ``TILE_N`` tokens, several pages per tile; element ``(token t, dim d)``
of KV head ``h`` is at ``block_table[t // BLOCK_SIZE] * stride_block + (t % BLOCK_SIZE) *
STRIDE_TOKEN + h * stride_head + d`` (K) and ``+ stride_kv`` (V), so the layout is fixed by the
stride constexprs of the spec and every layout compiles its own variant once.

Scores live in the base-2 domain (``log2(e)`` folded into the scale). Tiles entirely visible to
every row skip the causal/window mask; the rest are masked. With several splits each program
writes a normalized partial output and its base-2 log-sum-exp; ``_reduce_splits_kernel`` merges,
or (``FUSED_MERGE``) the last split of each (query tile, head group) to finish merges them in the
same launch: every split takes a ticket from a per-group counter after its partial stores, the one
that draws the last ticket reads all partials back (in split order: the result does not depend on
which program merged) and resets the counter to 0 for the next launch.
``RANGE_STAGES > 0`` pipelines the unmasked key loop with ``tl.range(num_stages=RANGE_STAGES)``
instead of the launch's ``num_stages`` (the masked loops keep the launch's); the arithmetic is
unchanged. ``LAZY_RESCALE`` (unmasked tiles, scores without softcap): the running row max is
raised, and the accumulator rescaled, only when some row's max grew by more than 8 (base 2) since
the last raise; otherwise p = exp2(s - stale max) <= 2**8, exact in fp32 sums and as precise in
bf16 (FlashAttention-4's conditional rescaling, decided for the whole tile).
``USE_ALIBI``: each query head's slope (``alibi_ptr``, natural log units) times the key's
position minus the query's is added to the scores after the softcap (a per-row constant apart,
the engines' bias; the softmax does not see the difference); such tiles take the plain softmax
path (no lazy rescaling). ``USE_SINKS``: each query head's sink logit (``sinks_ptr``) joins the
softmax's denominator with no value: the row max starts at the sink and the row sum at 1, in the
first split only, so a split launch counts it once.
``ROW_HALVES`` (no splits): the program's rows are two halves of ``BLOCK_M // 2`` with their own
accumulators; each key tile is loaded once and both halves' QK^T are issued before either
softmax. Triton 3.6 waits for each QK^T at once but keeps the (loop-carried) PV dots in flight, so
half a's PV runs during half b's softmax (bench/NOTES.md reads it from the PTX). Every row sees
the same operations in the same order as with one tile; the bytes are identical when each half's
dots take the whole tile's MMA instructions (16-bit, 256 rows on 8 warps: a warpgroup MMA per 64
rows either way), within rounding otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_paged_attention_kernel", "_reduce_splits_kernel"]

@triton.jit
def _tanh(x):
    # Portable across Triton versions: 1 - 2 / (exp(2x) + 1) saturates correctly at +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tile_rows(start, hi, bt_row_ptr, head_off, stride_block, num_blocks,
               BLOCK_SIZE: tl.constexpr, STRIDE_TOKEN: tl.constexpr, TILE_N: tl.constexpr,
               MASKED: tl.constexpr):
    """Keys [start, start + TILE_N): their positions and row offsets in the cache (K of the
    program's KV head; V is ``stride_kv`` further)."""
    t = start + tl.arange(0, TILE_N)
    if MASKED:
        blk = tl.load(bt_row_ptr + t // BLOCK_SIZE, mask=t < hi, other=0)
    else:
        blk = tl.load(bt_row_ptr + t // BLOCK_SIZE)
    # Memory safety without validation: an id outside [0, num_blocks) reads block 0 instead.
    blk = tl.where((blk >= 0) & (blk < num_blocks), blk, 0)
    return t, blk.to(tl.int64) * stride_block + (t % BLOCK_SIZE) * STRIDE_TOKEN + head_off


@triton.jit
def _load_rows(ptr, row, t, hi, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
               MASKED: tl.constexpr):
    """The [TILE_N, HEAD_PAD] tile at ``row`` offsets (zeros past ``hi`` or the head size)."""
    d = tl.arange(0, HEAD_PAD)
    ptrs = ptr + row[:, None] + d[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=(t < hi)[:, None] & (d[None, :] < HEAD_SIZE), other=0.0)
    elif HEAD_PAD != HEAD_SIZE:
        x = tl.load(ptrs, mask=(d < HEAD_SIZE)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _qk(q, k, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    k = k.to(q.dtype)
    if DOT_F32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    return qk


@triton.jit
def _softmax_pv(acc, l_i, m_i, qk, visible, v, score_mult, softcap_mult, bias,
                MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr,
                PRECISION: tl.constexpr, FMA_SCORES: tl.constexpr, LAZY: tl.constexpr,
                USE_BIAS: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) by the raw scores ``qk`` of one key tile and its
    values ``v`` (in the query dtype); ``visible`` masks scores when MASKED; USE_BIAS adds
    ``bias`` (base 2, after the softcap: ALiBi). LAZY (unmasked, FMA scores, no softcap, no
    bias): the kernel docstring's lazy rescaling."""
    if USE_SOFTCAP or not FMA_SCORES or USE_BIAS:
        if USE_SOFTCAP:
            s = softcap_mult * _tanh(qk * score_mult)
        else:
            s = qk * score_mult
        if USE_BIAS:
            s = s + bias
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    elif LAZY:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * score_mult)
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
        else:
            m_new = m_i
        p = tl.exp2(qk * score_mult - m_new[:, None])
    else:
        # score_mult > 0: the row max of qk * score_mult is score_mult * the row max of qk, and
        # qk * score_mult - m is one FMA per element.
        if MASKED:
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * score_mult)
        p = tl.exp2(qk * score_mult - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    l_i = l_i + tl.sum(p, 1)
    # P is rounded to the input dtype like FlashAttention does (bf16/fp16 tensor-core dot).
    p = p.to(v.dtype)
    if DOT_F32:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(p, v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos, start, hi,
    cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window, score_mult,
    softcap_mult, BLOCK_SIZE: tl.constexpr, STRIDE_TOKEN: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    FMA_SCORES: tl.constexpr, LAZY: tl.constexpr = False, alibi=0.0,
    USE_ALIBI: tl.constexpr = False,
):
    """One key tile [start, start + TILE_N): online-softmax update of (acc, l_i, m_i); USE_ALIBI:
    each row's ``alibi`` slope (base 2) times the key's distance from the query is added."""
    t, row = _tile_rows(start, hi, bt_row_ptr, head_off, stride_block, num_blocks, BLOCK_SIZE,
                        STRIDE_TOKEN, TILE_N, MASKED)
    k = _load_rows(cache_ptr, row, t, hi, HEAD_SIZE, HEAD_PAD, MASKED)
    v = _load_rows(cache_ptr + stride_kv, row, t, hi, HEAD_SIZE, HEAD_PAD, MASKED)
    qk = _qk(q, k, DOT_F32, PRECISION)
    visible = qk  # unused unless MASKED
    if MASKED:
        visible = (t[None, :] <= q_pos[:, None]) & (t < hi)[None, :]
        if USE_WINDOW:
            visible = visible & (t[None, :] > q_pos[:, None] - window)
    bias = qk  # unused unless USE_ALIBI
    if USE_ALIBI:
        bias = alibi[:, None] * (t[None, :] - q_pos[:, None]).to(tl.float32)
    return _softmax_pv(acc, l_i, m_i, qk, visible, v.to(q.dtype), score_mult, softcap_mult, bias,
                       MASKED, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES,
                       LAZY and not USE_ALIBI, USE_ALIBI)


@triton.jit
def _attend_tile2(
    acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, q_pos_a, q_pos_b, start, hi,
    cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window, score_mult,
    softcap_mult, BLOCK_SIZE: tl.constexpr, STRIDE_TOKEN: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    FMA_SCORES: tl.constexpr, alibi_a=0.0, alibi_b=0.0, USE_ALIBI: tl.constexpr = False,
):
    """One key tile for two row halves (``ROW_HALVES``): K/V loaded once, both QK^T issued
    before either softmax; each half updates its (acc, l, m) exactly as ``_attend_tile``."""
    t, row = _tile_rows(start, hi, bt_row_ptr, head_off, stride_block, num_blocks, BLOCK_SIZE,
                        STRIDE_TOKEN, TILE_N, MASKED)
    k = _load_rows(cache_ptr, row, t, hi, HEAD_SIZE, HEAD_PAD, MASKED)
    v = _load_rows(cache_ptr + stride_kv, row, t, hi, HEAD_SIZE, HEAD_PAD, MASKED).to(q_a.dtype)
    qk_a = _qk(q_a, k, DOT_F32, PRECISION)
    qk_b = _qk(q_b, k, DOT_F32, PRECISION)
    vis_a = qk_a  # unused unless MASKED
    vis_b = qk_b
    if MASKED:
        vis_a = (t[None, :] <= q_pos_a[:, None]) & (t < hi)[None, :]
        vis_b = (t[None, :] <= q_pos_b[:, None]) & (t < hi)[None, :]
        if USE_WINDOW:
            vis_a = vis_a & (t[None, :] > q_pos_a[:, None] - window)
            vis_b = vis_b & (t[None, :] > q_pos_b[:, None] - window)
    bias_a = qk_a  # unused unless USE_ALIBI
    bias_b = qk_b
    if USE_ALIBI:
        bias_a = alibi_a[:, None] * (t[None, :] - q_pos_a[:, None]).to(tl.float32)
        bias_b = alibi_b[:, None] * (t[None, :] - q_pos_b[:, None]).to(tl.float32)
    acc_a, l_a, m_a = _softmax_pv(acc_a, l_a, m_a, qk_a, vis_a, v, score_mult, softcap_mult,
                                  bias_a, MASKED, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES,
                                  False, USE_ALIBI)
    acc_b, l_b, m_b = _softmax_pv(acc_b, l_b, m_b, qk_b, vis_b, v, score_mult, softcap_mult,
                                  bias_b, MASKED, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES,
                                  False, USE_ALIBI)
    return acc_a, l_a, m_a, acc_b, l_b, m_b


@triton.jit
def _attend_range2(
    acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, q_pos_a, q_pos_b, lo, hi_tiles, hi,
    cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window, score_mult,
    softcap_mult, BLOCK_SIZE: tl.constexpr, STRIDE_TOKEN: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    FMA_SCORES: tl.constexpr, alibi_a=0.0, alibi_b=0.0, USE_ALIBI: tl.constexpr = False,
):
    """The key tiles starting in [lo, hi_tiles) for both row halves (``_attend_tile2`` each)."""
    for start in range(lo, hi_tiles, TILE_N):
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attend_tile2(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, q_pos_a, q_pos_b, start, hi, cache_ptr,
            bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window, score_mult,
            softcap_mult, BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N, MASKED,
            USE_WINDOW, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, alibi_a, alibi_b, USE_ALIBI)
    return acc_a, l_a, m_a, acc_b, l_b, m_b


@triton.jit
def _rows(r, chunk, kv_head, q_start, q_tile, q_len, seq_len, num_q_tokens, d,
          HEADS_PER_PROG: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
          VARLEN: tl.constexpr, HEAD_SIZE: tl.constexpr):
    """Rows ``r`` of a program (query token x head pairs): their query head, token, validity,
    position in the sequence and load/store mask."""
    qi = r // HEADS_PER_PROG
    hh = chunk * HEADS_PER_PROG + r % HEADS_PER_PROG
    hq = kv_head * GROUP + hh
    tok = (q_start + q_tile + qi).to(tl.int64)
    row_ok = (r < BLOCK_Q * HEADS_PER_PROG) & (q_tile + qi < q_len) & (hh < GROUP)
    if VARLEN:
        row_ok = row_ok & (tok >= 0) & (tok < num_q_tokens)
    q_pos = seq_len - q_len + q_tile + qi
    io_mask = row_ok[:, None] & (d[None, :] < HEAD_SIZE)
    return hq, tok, row_ok, q_pos, io_mask


@triton.jit
def _merge_if_last(part_out_ptr, part_lse_ptr, ctr_ptr, out_ptr, group, base, o_offs, row_ok,
                   io_mask, d, num_splits, BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr,
                   HEAD_PAD: tl.constexpr):
    """After this program stored its partials: take a ticket; the last split of ``group`` merges
    the ``num_splits`` partials of its rows (``base``: their first partial index) into ``out``."""
    # Every thread's partial stores happen before the ticket (the barrier orders them within the
    # program, the acq_rel atomic publishes them to the GPU and acquires the other splits').
    tl.debug_barrier()
    ticket = tl.atomic_add(ctr_ptr + group, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        tl.store(ctr_ptr + group, 0)  # every split has taken its ticket: reset for the next launch
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in range(0, num_splits):
            lse = tl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf"),
                          cache_modifier=".cg")
            m = tl.maximum(m, lse)
        m = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in range(0, num_splits):
            lse = tl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf"),
                          cache_modifier=".cg")
            w = tl.exp2(lse - m)
            o = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_SIZE + d[None, :], mask=io_mask,
                        other=0.0, cache_modifier=".cg")
            acc += o * w[:, None]
            w_sum += w
        res = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
        tl.store(out_ptr + o_offs, res.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["window", "num_seqs", "num_tiles", "num_q_tokens", "num_blocks",
                               "max_context", "num_splits"])
def _paged_attention_kernel(
    # per call (fkv.ops._launch: the direct launch passes these first; pointers, then scalars)
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, ctr_ptr, alibi_ptr, sinks_ptr,
    scale, softcap, window, num_seqs, num_tiles, num_q_tokens, max_context, num_splits,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_bt,
    # fixed per input signature
    num_q_heads, num_blocks, stride_block, stride_kv, stride_head,
    # spec constexprs (fkv.ops._spec.cache_constexprs) and the token stride of the layout
    HEADS_OUTER: tl.constexpr, IS_MLA: tl.constexpr, CACHE_FP8: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    STRIDE_TOKEN: tl.constexpr,
    # launch configuration
    HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    HEAD_CHUNKS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    VARLEN: tl.constexpr, SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr, FMA_SCORES: tl.constexpr, FUSED_MERGE: tl.constexpr,
    RANGE_STAGES: tl.constexpr, LAZY_RESCALE: tl.constexpr, PDL: tl.constexpr = False,
    ROW_HALVES: tl.constexpr = False, USE_ALIBI: tl.constexpr = False,
    USE_SINKS: tl.constexpr = False,
):
    if PDL:  # launched with PDL: nothing is read before the kernel before this one has finished
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Axis 0 enumerates (query tile, KV head x head chunk); HEADS_FIRST: the heads of one tile are
    # consecutive programs (they read neighbouring bytes of the same pages at the same time).
    pid = tl.program_id(0)
    if HEADS_FIRST:
        hc = pid % (NUM_HEADS * HEAD_CHUNKS)
        tile_idx = pid // (NUM_HEADS * HEAD_CHUNKS)
    else:
        hc = pid // num_tiles
        tile_idx = pid % num_tiles
    # Longest query tiles first (they come last in each sequence): better tail balance in prefill.
    tile = num_tiles - 1 - tile_idx
    kv_head = hc // HEAD_CHUNKS
    chunk = hc % HEAD_CHUNKS
    split = tl.program_id(1)

    if VARLEN:
        # Sequence b owns tiles [qsl[b] // BLOCK_Q + b, ...): find the last b starting <= tile.
        lo = tile * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= tile
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        seq = lo
        q_start = tl.load(qsl_ptr + seq).to(tl.int32)
        q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
        q_tile = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    else:
        seq = tile
        q_start = tile
        q_len = 1
        q_tile = 0
    if q_tile >= q_len:
        return
    # Unvalidated values cannot fault: seq_len is clamped to the block table's capacity and rows
    # outside [0, num_q_tokens) are masked (their results are unspecified, nothing else is touched).
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + seq).to(tl.int32), 0), max_context)

    d = tl.arange(0, HEAD_PAD)

    # s = q.k * scale * k_scale; softcap: s = c * tanh(s / c); then in base 2: s * log2(e).
    score_mult = scale
    if CACHE_FP8:
        score_mult = score_mult * tl.load(k_scale_ptr)
    softcap_mult = softcap * 1.4426950408889634
    if USE_SOFTCAP:
        score_mult = score_mult / softcap
    else:
        score_mult = score_mult * 1.4426950408889634

    # Key range of this program: the causal (and window) range of the tile, [lo, last_pos], cut
    # into num_splits segments of whole tiles by its real length (not the block table's
    # capacity: padding columns cost nothing, and a window splits only the keys it sees).
    first_pos = seq_len - q_len + q_tile
    last_pos = tl.minimum(first_pos + BLOCK_Q - 1, seq_len - 1)
    lo = first_pos * 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    lo = (lo // TILE_N) * TILE_N
    if SPLIT:
        seg = tl.cdiv(tl.cdiv(tl.maximum(last_pos + 1 - lo, 0), num_splits), TILE_N) * TILE_N
        kv_lo = lo + split * seg
        kv_hi = tl.minimum(last_pos + 1, kv_lo + seg)
    else:
        kv_lo = lo
        kv_hi = last_pos + 1
    if USE_WINDOW:
        kv_lo = tl.maximum(kv_lo, first_pos - window + 1)
    # Tiles in [u_lo, u_hi) are visible to every row: no mask. Before and after: masked.
    u_lo = tl.cdiv(kv_lo, TILE_N) * TILE_N
    if USE_WINDOW:
        u_lo = tl.maximum(u_lo, tl.cdiv(tl.maximum(last_pos - window + 1, 0), TILE_N) * TILE_N)
    u_hi = tl.maximum((tl.minimum(first_pos + 1, kv_hi) // TILE_N) * TILE_N, u_lo)
    a_lo = (kv_lo // TILE_N) * TILE_N
    a_hi = tl.minimum(u_lo, kv_hi)

    head_off = kv_head.to(tl.int64) * stride_head
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    if ROW_HALVES:
        # Two row halves (no splits), each key tile loaded once for both.
        tl.static_assert(not SPLIT, "ROW_HALVES needs num_splits == 1")
        HALF: tl.constexpr = BLOCK_M // 2
        r_a = tl.arange(0, HALF)
        hq_a, tok_a, ok_a, q_pos_a, io_a = _rows(
            r_a, chunk, kv_head, q_start, q_tile, q_len, seq_len, num_q_tokens, d, HEADS_PER_PROG,
            GROUP, BLOCK_Q, VARLEN, HEAD_SIZE)
        hq_b, tok_b, ok_b, q_pos_b, io_b = _rows(
            r_a + HALF, chunk, kv_head, q_start, q_tile, q_len, seq_len, num_q_tokens, d,
            HEADS_PER_PROG, GROUP, BLOCK_Q, VARLEN, HEAD_SIZE)
        q_a = tl.load(q_ptr + tok_a[:, None] * stride_qt + hq_a[:, None] * stride_qh
                      + d[None, :] * stride_qd, mask=io_a, other=0.0)
        q_b = tl.load(q_ptr + tok_b[:, None] * stride_qt + hq_b[:, None] * stride_qh
                      + d[None, :] * stride_qd, mask=io_b, other=0.0)
        acc_a = tl.zeros([HALF, HEAD_PAD], dtype=tl.float32)
        acc_b = tl.zeros([HALF, HEAD_PAD], dtype=tl.float32)
        l_a = tl.zeros([HALF], dtype=tl.float32)
        l_b = tl.zeros([HALF], dtype=tl.float32)
        m_a = tl.full([HALF], -1.0e30, dtype=tl.float32)
        m_b = tl.full([HALF], -1.0e30, dtype=tl.float32)
        alibi_a = tl.zeros([HALF], dtype=tl.float32)
        alibi_b = tl.zeros([HALF], dtype=tl.float32)
        if USE_ALIBI:  # slopes in base 2
            alibi_a = tl.load(alibi_ptr + hq_a, mask=ok_a, other=0.0) * 1.4426950408889634
            alibi_b = tl.load(alibi_ptr + hq_b, mask=ok_b, other=0.0) * 1.4426950408889634
        if USE_SINKS:  # the sink: one more logit per query head, with no value (no splits here)
            m_a = tl.load(sinks_ptr + hq_a, mask=ok_a, other=0.0) * 1.4426950408889634
            m_b = tl.load(sinks_ptr + hq_b, mask=ok_b, other=0.0) * 1.4426950408889634
            l_a = l_a + 1.0
            l_b = l_b + 1.0
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attend_range2(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, q_pos_a, q_pos_b, a_lo, a_hi, kv_hi,
            cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window,
            score_mult, softcap_mult, BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N,
            True, USE_WINDOW, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, alibi_a, alibi_b,
            USE_ALIBI)
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attend_range2(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, q_pos_a, q_pos_b, u_lo, u_hi, kv_hi,
            cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window,
            score_mult, softcap_mult, BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N,
            False, USE_WINDOW, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, alibi_a, alibi_b,
            USE_ALIBI)
        acc_a, l_a, m_a, acc_b, l_b, m_b = _attend_range2(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, q_pos_a, q_pos_b, u_hi, kv_hi, kv_hi,
            cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window,
            score_mult, softcap_mult, BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N,
            True, USE_WINDOW, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, alibi_a, alibi_b,
            USE_ALIBI)
        o_a = acc_a / tl.where(l_a == 0.0, 1.0, l_a)[:, None]
        o_b = acc_b / tl.where(l_b == 0.0, 1.0, l_b)[:, None]
        if CACHE_FP8:
            o_a = o_a * tl.load(v_scale_ptr)
            o_b = o_b * tl.load(v_scale_ptr)
        d_off = d[None, :] * stride_od
        tl.store(out_ptr + tok_a[:, None] * stride_ot + hq_a[:, None] * stride_oh + d_off,
                 o_a.to(out_ptr.dtype.element_ty), mask=io_a)
        tl.store(out_ptr + tok_b[:, None] * stride_ot + hq_b[:, None] * stride_oh + d_off,
                 o_b.to(out_ptr.dtype.element_ty), mask=io_b)
    else:
        r = tl.arange(0, BLOCK_M)
        hq, tok, row_ok, q_pos, io_mask = _rows(
            r, chunk, kv_head, q_start, q_tile, q_len, seq_len, num_q_tokens, d, HEADS_PER_PROG,
            GROUP, BLOCK_Q, VARLEN, HEAD_SIZE)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + hq[:, None] * stride_qh
                    + d[None, :] * stride_qd, mask=io_mask, other=0.0)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Finite row-max start: a fully masked row gives exp2(-inf - m) = 0, never NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        alibi = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_ALIBI:  # slopes in base 2
            alibi = tl.load(alibi_ptr + hq, mask=row_ok, other=0.0) * 1.4426950408889634
        if USE_SINKS:  # the sink: one more logit per query head, with no value; once: split 0
            sink = tl.load(sinks_ptr + hq, mask=row_ok, other=0.0) * 1.4426950408889634
            m_i = tl.where(split == 0, sink, m_i)
            l_i = tl.where(split == 0, l_i + 1.0, l_i)
        for start in range(a_lo, a_hi, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start, kv_hi, cache_ptr, bt_row_ptr, head_off,
                stride_block, stride_kv, num_blocks, window, score_mult, softcap_mult,
                BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N, True, USE_WINDOW,
                USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, False, alibi, USE_ALIBI)
        if RANGE_STAGES > 0:
            for start in tl.range(u_lo, u_hi, TILE_N, num_stages=RANGE_STAGES):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, q_pos, start, kv_hi, cache_ptr, bt_row_ptr, head_off,
                    stride_block, stride_kv, num_blocks, window, score_mult, softcap_mult,
                    BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N, False, USE_WINDOW,
                    USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, LAZY_RESCALE, alibi, USE_ALIBI)
        else:
            for start in range(u_lo, u_hi, TILE_N):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, q_pos, start, kv_hi, cache_ptr, bt_row_ptr, head_off,
                    stride_block, stride_kv, num_blocks, window, score_mult, softcap_mult,
                    BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N, False, USE_WINDOW,
                    USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, LAZY_RESCALE, alibi, USE_ALIBI)
        for start in range(u_hi, kv_hi, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start, kv_hi, cache_ptr, bt_row_ptr, head_off,
                stride_block, stride_kv, num_blocks, window, score_mult, softcap_mult,
                BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N, True, USE_WINDOW,
                USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, False, alibi, USE_ALIBI)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if CACHE_FP8:
            o = o * tl.load(v_scale_ptr)
        o_offs = tok[:, None] * stride_ot + hq[:, None] * stride_oh + d[None, :] * stride_od
        if SPLIT:
            base = (tok * num_q_heads + hq) * num_splits
            part = base + split
            tl.store(part_out_ptr + part[:, None] * HEAD_SIZE + d[None, :], o, mask=io_mask)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # -inf: no visible key
            tl.store(part_lse_ptr + part, lse, mask=row_ok)
            if FUSED_MERGE:
                _merge_if_last(part_out_ptr, part_lse_ptr, ctr_ptr, out_ptr, pid, base, o_offs,
                               row_ok, io_mask, d, num_splits, BLOCK_M, HEAD_SIZE, HEAD_PAD)
        else:
            tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_q_heads, num_splits,
    stride_ot, stride_oh, stride_od,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge the per-split partial outputs of one (query token, query head) by their weights."""
    tok = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    base = (tok * num_q_heads + hq) * num_splits
    s_ok = s < num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    mask = s_ok[:, None] & (d[None, :] < HEAD_SIZE)
    o = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_SIZE + d[None, :], mask=mask, other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + hq * stride_oh + d * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)
