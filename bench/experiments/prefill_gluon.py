"""Experiment: prefill attention in Gluon, where the waits of the warpgroup MMAs are stated.

The default prefill tile (256 rows as two 128-row halves, 64-key tiles, 8 warps) is Triton code;
Triton 3.6 waits for each QK^T warpgroup MMA right after issuing it and keeps only the
loop-carried PV MMAs in flight (bench/NOTES.md reads it from the PTX). Gluon states the waits.
Modes (``VARIANTS``):

- ``""``: both halves' QK^T issued, then a wait with one MMA outstanding
  (``warpgroup_mma_wait(1)``), so half b's QK^T runs while half a's softmax does;
- ``"serial"``: each QK^T waited for at once, as Triton compiles the default;
- ``"pipe"``: each half's QK^T issued half a tile ahead (FA3's intra-warpgroup pipelining);
- ``"ws"``: warp-specialized, a producer warp group gathering K/V pages into a ring of
  mbarrier-guarded slots and two consumer warp groups of half the rows each;
- ``"ws-pipe"``: the same, each consumer issuing tile j+1's QK^T before tile j's softmax,
  which runs under it and under PV(j-1);
- ``"ws-fa3"``: each consumer in FlashAttention-3's order (S(j) and PV(j-1) issued together,
  tile j's softmax under PV(j-1), the rescale after it); ``"ws-fa3-pp"``: and the two consumers
  taking turns to issue their MMAs (FA3's ping-pong, here two mbarriers passing the turn).

K/V tiles are gathered page by page with ``cp.async`` into shared-memory slots; Q sits in shared
memory as the A operand, P in registers. Scope (the case the 1.2x target is about): varlen
prefill, 16-bit cache and queries, head size 64 or 128, no window, no softcap, no splits; every
row is computed as the default computes it (same scores scale, same base-2 online softmax, P
rounded to the input dtype).

    PYTHONPATH=$T36/site:. python bench/experiments/prefill_gluon.py --compile   # sm_90a, no GPU
    python bench/experiments/prefill_gluon.py          # GPU: bytes against the default, times
    for k in 0 1 2 3 4 5; do timeout 90 python bench/experiments/prefill_gluon.py --only=$k; done
``--compile`` prints shared memory and ``ptxas``'s registers and spills of each variant. The GPU
JSON goes to ``$OUT`` (or /tmp) as ``prefill-gluon-exp.json``.
"""

from __future__ import annotations

import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

# Shared with the library's kernel (the variant it adopted): the program mapping, in the Triton
# kernel's order, the one-warp page producer of the "ws256" modes, the online-softmax step.
from fkv.ops._attention_gluon import _producer as _page_producer
from fkv.ops._attention_gluon import _program
from fkv.ops._attention_gluon import _softmax as _softmax_stats  # (P, alpha, l, m), no acc


@gluon.jit
def _issue_kv(k_smem, v_smem, slot, blk, j, hi, cache_ptr, stride_kv, stride_block, head_off,
              num_blocks, BLOCK_SIZE: gl.constexpr, STRIDE_TOKEN: gl.constexpr,
              HEAD: gl.constexpr, TILE_N: gl.constexpr, LOAD: gl.constexpr):
    """Copy key tile ``j`` (its block ids ``blk``, read earlier) into ring slot ``slot``."""
    t = j * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LOAD))
    blk = gl.where((blk >= 0) & (blk < num_blocks), blk, 0)
    row = blk.to(gl.int64) * stride_block + (t % BLOCK_SIZE) * STRIDE_TOKEN + head_off
    d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, LOAD))
    ptrs = cache_ptr + gl.expand_dims(row, 1) + gl.expand_dims(d, 0)
    ok = gl.expand_dims(t < hi, 1) & gl.expand_dims(d < HEAD, 0)
    cp.async_copy_global_to_shared(k_smem.index(slot), ptrs, mask=ok)
    cp.async_copy_global_to_shared(v_smem.index(slot), ptrs + stride_kv, mask=ok)
    cp.commit_group()


@gluon.jit
def _block_ids(bt_row_ptr, j, hi, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr,
               LOAD: gl.constexpr):
    t = j * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LOAD))
    return gl.load(bt_row_ptr + t // BLOCK_SIZE, mask=t < hi, other=0)


@gluon.jit
def _softmax(s, m_i, l_i, acc, score_mult, pos0, t0, hi, MASKED: gl.constexpr,
             TILE_N: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
             ROW0: gl.constexpr, HPP: gl.constexpr):
    """Online-softmax step of one half (rows ROW0...): (P, rescaled acc, l, m), as the default
    kernel does it. Masked tiles rebuild the rows' positions from ``pos0`` (the position of the
    program's first query), so nothing row-sized stays live across the unmasked loop."""
    p, alpha, l_i, m_new = _softmax_stats(s, m_i, l_i, score_mult, pos0, t0, hi, MASKED, TILE_N,
                                          S_LAYOUT, ROW0, HPP)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
    return p, acc, l_i, m_new


@gluon.jit
def _key_tile(j, q_a, q_b, k_smem, v_smem, acc_a, acc_b, m_a, l_a, m_b, l_b, blk,
              pos0, hi, bt_row_ptr, cache_ptr, stride_kv, stride_block, head_off,
              num_blocks, score_mult, BLOCK_SIZE: gl.constexpr, STRIDE_TOKEN: gl.constexpr,
              HEAD: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
              MASKED: gl.constexpr, LOAD: gl.constexpr, S_LAYOUT: gl.constexpr,
              O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, HALF: gl.constexpr,
              SERIAL_QK: gl.constexpr, HPP: gl.constexpr):
    slot = j % STAGES
    # Tile j's copies (this thread's) landed and are fenced for the MMAs' async proxy; the
    # barrier makes every thread's visible and says every warp group finished tile j - 1's
    # waits, so tile j - 2's PV MMAs are done everywhere and its slot can be refilled.
    cp.wait_group(STAGES - 3)
    fence_async_shared()
    gl.thread_barrier()
    _issue_kv(k_smem, v_smem, (j + STAGES - 2) % STAGES, blk, j + STAGES - 2, hi, cache_ptr,
              stride_kv, stride_block, head_off, num_blocks, BLOCK_SIZE, STRIDE_TOKEN, HEAD,
              TILE_N, LOAD)
    blk = _block_ids(bt_row_ptr, j + STAGES - 1, hi, BLOCK_SIZE, TILE_N, LOAD)
    k_t = k_smem.index(slot).permute((1, 0))
    v = v_smem.index(slot)
    zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
    s_a = warpgroup_mma(q_a, k_t, zero, use_acc=False, is_async=True)
    if SERIAL_QK:  # as Triton 3.6 compiles the default: each QK^T waited for once issued
        s_a, acc_a, acc_b = warpgroup_mma_wait(0, deps=[s_a, acc_a, acc_b])
        s_b = warpgroup_mma(q_b, k_t, zero, use_acc=False, is_async=True)
        s_b = warpgroup_mma_wait(0, deps=[s_b])
        s_b = warpgroup_mma_init(s_b)
    else:
        s_b = warpgroup_mma(q_b, k_t, zero, use_acc=False, is_async=True)
        # In flight: the last PVs of both halves, then s_a, s_b. Leave s_b running.
        s_a, acc_a, acc_b = warpgroup_mma_wait(1, deps=[s_a, acc_a, acc_b])
    p_a, acc_a, l_a, m_a = _softmax(s_a, m_a, l_a, acc_a, score_mult, pos0, j * TILE_N, hi,
                                    MASKED, TILE_N, S_LAYOUT, O_LAYOUT, 0, HPP)
    p_a = gl.convert_layout(p_a.to(q_a.dtype), P_LAYOUT)
    acc_a = warpgroup_mma(p_a, v, acc_a, is_async=True)
    s_b = warpgroup_mma_wait(1, deps=[s_b])  # half a's PV keeps running
    p_b, acc_b, l_b, m_b = _softmax(s_b, m_b, l_b, acc_b, score_mult, pos0, j * TILE_N, hi,
                                    MASKED, TILE_N, S_LAYOUT, O_LAYOUT, HALF, HPP)
    p_b = gl.convert_layout(p_b.to(q_a.dtype), P_LAYOUT)
    acc_b = warpgroup_mma(p_b, v, acc_b, is_async=True)
    return acc_a, acc_b, m_a, l_a, m_b, l_b, blk


@gluon.jit
def _key_tile_pipe(j, q_a, q_b, k_smem, v_smem, s_a, s_b, acc_a, acc_b, m_a, l_a, m_b, l_b,
                   blk, pos0, hi, bt_row_ptr, cache_ptr, stride_kv, stride_block,
                   head_off, num_blocks, score_mult, BLOCK_SIZE: gl.constexpr,
                   STRIDE_TOKEN: gl.constexpr, HEAD: gl.constexpr, TILE_N: gl.constexpr,
                   STAGES: gl.constexpr, MASKED: gl.constexpr, LOAD: gl.constexpr,
                   S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
                   HALF: gl.constexpr, HPP: gl.constexpr):
    """Key tile j, each half's QK^T issued half a tile ahead: on entry S_a(j) and S_b(j) are in
    flight (after PV_a(j-1) and PV_b(j-1) respectively); half a's softmax runs while PV_b(j-1) and
    S_b(j) do, half b's while PV_a(j) and S_a(j+1) do. Tile j + 1's QK^T reads a slot that
    holds zeros past the keys (the last tile's is computed and dropped)."""
    v = v_smem.index(j % STAGES)
    s_a, acc_a = warpgroup_mma_wait(2, deps=[s_a, acc_a])  # PV_b(j-1), S_b(j) may still run
    p_a, acc_a, l_a, m_a = _softmax(s_a, m_a, l_a, acc_a, score_mult, pos0, j * TILE_N, hi,
                                    MASKED, TILE_N, S_LAYOUT, O_LAYOUT, 0, HPP)
    p_a = gl.convert_layout(p_a.to(q_a.dtype), P_LAYOUT)
    acc_a = warpgroup_mma(p_a, v, acc_a, is_async=True)
    # Tile j + 1 landed (every thread's, fenced for the async proxy); every warp group is past
    # tile j's first wait, so tile j - 2's MMAs are done everywhere and its slot can be refilled.
    cp.wait_group(STAGES - 4)
    fence_async_shared()
    gl.thread_barrier()
    _issue_kv(k_smem, v_smem, (j + STAGES - 2) % STAGES, blk, j + STAGES - 2, hi, cache_ptr,
              stride_kv, stride_block, head_off, num_blocks, BLOCK_SIZE, STRIDE_TOKEN, HEAD,
              TILE_N, LOAD)
    blk = _block_ids(bt_row_ptr, j + STAGES - 1, hi, BLOCK_SIZE, TILE_N, LOAD)
    k_t = k_smem.index((j + 1) % STAGES).permute((1, 0))
    zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
    s_a = warpgroup_mma(q_a, k_t, zero, use_acc=False, is_async=True)
    s_b, acc_b = warpgroup_mma_wait(2, deps=[s_b, acc_b])  # PV_a(j), S_a(j+1) may still run
    p_b, acc_b, l_b, m_b = _softmax(s_b, m_b, l_b, acc_b, score_mult, pos0, j * TILE_N, hi,
                                    MASKED, TILE_N, S_LAYOUT, O_LAYOUT, HALF, HPP)
    p_b = gl.convert_layout(p_b.to(q_a.dtype), P_LAYOUT)
    acc_b = warpgroup_mma(p_b, v, acc_b, is_async=True)
    s_b = warpgroup_mma(q_b, k_t, zero, use_acc=False, is_async=True)
    return s_a, s_b, acc_a, acc_b, m_a, l_a, m_b, l_b, blk


@gluon.jit
def _rows(r, chunk, kv_head, q_start, q_tile, q_len, seq_len, HPP: gl.constexpr,
          GROUP: gl.constexpr, BLOCK_Q: gl.constexpr):
    qi = r // HPP
    hh = chunk * HPP + r % HPP
    hq = kv_head * GROUP + hh
    tok = (q_start + q_tile + qi).to(gl.int64)
    ok = (r < BLOCK_Q * HPP) & (q_tile + qi < q_len) & (hh < GROUP)
    return hq, tok, ok, seq_len - q_len + q_tile + qi


@gluon.jit
def _keys(seq_lens_ptr, seq, q_len, q_tile, max_context, BLOCK_Q: gl.constexpr,
          TILE_N: gl.constexpr):
    """(sequence length, position of the program's first query, keys it sees, key tiles, key
    tiles every row sees whole) for a program without window or splits."""
    seq_len = gl.minimum(gl.maximum(gl.load(seq_lens_ptr + seq).to(gl.int32), 0), max_context)
    first_pos = seq_len - q_len + q_tile
    kv_hi = gl.minimum(first_pos + BLOCK_Q - 1, seq_len - 1) + 1
    n_open = gl.maximum(gl.minimum(first_pos + 1, kv_hi) // TILE_N, 0)
    return seq_len, first_pos, kv_hi, gl.cdiv(kv_hi, TILE_N), n_open


@gluon.jit
def _q_to_shared(q_ptr, chunk, kv_head, q_start, q_tile, q_len, seq_len, num_q_tokens,
                 stride_qt, stride_qh, HALF: gl.constexpr, HEAD: gl.constexpr, HPP: gl.constexpr,
                 GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, LOAD: gl.constexpr,
                 Q_SMEM: gl.constexpr):
    """Q of both row halves in shared memory, [2, HALF, HEAD] (the A operand of QK^T)."""
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2, HALF, HEAD], Q_SMEM)
    d_l = gl.arange(0, HEAD, layout=gl.SliceLayout(0, LOAD))
    for h in gl.static_range(2):
        r = h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, LOAD))
        hq, tok, ok, _ = _rows(r, chunk, kv_head, q_start, q_tile, q_len, seq_len, HPP, GROUP,
                               BLOCK_Q)
        ok = ok & (tok < num_q_tokens)
        qv = gl.load(q_ptr + gl.expand_dims(tok * stride_qt + hq * stride_qh, 1)
                     + gl.expand_dims(d_l, 0), mask=gl.expand_dims(ok, 1), other=0.0)
        q_smem.index(h).store(qv)
    return q_smem


@gluon.jit
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    score_mult, num_seqs, num_tiles, num_q_tokens, num_blocks, max_context,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_kv, stride_head,
    BLOCK_SIZE: gl.constexpr, STRIDE_TOKEN: gl.constexpr, NUM_HEADS: gl.constexpr,
    HEAD: gl.constexpr, GROUP: gl.constexpr, HPP: gl.constexpr, HEAD_CHUNKS: gl.constexpr,
    BLOCK_Q: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
    PIPE: gl.constexpr = False, SERIAL_QK: gl.constexpr = False,
):
    NW: gl.constexpr = gl.num_warps()
    HALF: gl.constexpr = BLOCK_Q * HPP // 2
    TPW: gl.constexpr = HEAD // 8  # threads of a warp along one 16-byte-vector row
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW, TPW], [NW, 1], [1, 0])
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, TILE_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, HEAD, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD], gl.bfloat16)
    KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HEAD], gl.bfloat16)

    kv_head, chunk, seq, q_start, q_len, q_tile = _program(qsl_ptr, num_seqs, num_tiles,
                                                           NUM_HEADS, HEAD_CHUNKS, BLOCK_Q)
    if q_tile < q_len:
        seq_len, first_pos, kv_hi, n_tiles, n_open = _keys(seq_lens_ptr, seq, q_len, q_tile,
                                                           max_context, BLOCK_Q, TILE_N)
        head_off = kv_head.to(gl.int64) * stride_head
        bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bt

        q_smem = _q_to_shared(q_ptr, chunk, kv_head, q_start, q_tile, q_len, seq_len,
                              num_q_tokens, stride_qt, stride_qh, HALF, HEAD, HPP, GROUP,
                              BLOCK_Q, LOAD, Q_SMEM)
        k_smem = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD],
                                           KV_SMEM)  # the ring of key tiles, and of values:
        v_smem = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD],
                                           KV_SMEM)
        for i in gl.static_range(STAGES - 2):
            _issue_kv(k_smem, v_smem, i, _block_ids(bt_row_ptr, i, kv_hi, BLOCK_SIZE, TILE_N, LOAD),
                      i, kv_hi, cache_ptr, stride_kv, stride_block, head_off, num_blocks,
                      BLOCK_SIZE, STRIDE_TOKEN, HEAD, TILE_N, LOAD)
        blk = _block_ids(bt_row_ptr, STAGES - 2, kv_hi, BLOCK_SIZE, TILE_N, LOAD)
        fence_async_shared()

        pos0 = first_pos  # position of the program's first query (row r: pos0 + r // HPP)
        acc_a = warpgroup_mma_init(gl.zeros([HALF, HEAD], gl.float32, layout=O_LAYOUT))
        acc_b = warpgroup_mma_init(gl.zeros([HALF, HEAD], gl.float32, layout=O_LAYOUT))
        l_a = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        l_b = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        m_a = gl.full([HALF], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        m_b = gl.full([HALF], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        q_a = q_smem.index(0)
        q_b = q_smem.index(1)
        if PIPE:
            # Tile 0's QK^T of half a waited for at once (nothing else is in flight yet), so
            # that every tile's first wait leaves exactly PV_b(j-1) and S_b(j) running.
            cp.wait_group(STAGES - 3)
            fence_async_shared()
            gl.thread_barrier()
            k_t = k_smem.index(0).permute((1, 0))
            zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
            s_a = warpgroup_mma(q_a, k_t, zero, use_acc=False, is_async=True)
            s_a = warpgroup_mma_wait(0, deps=[s_a])
            s_a = warpgroup_mma_init(s_a)
            s_b = warpgroup_mma(q_b, k_t, zero, use_acc=False, is_async=True)
            for j in range(0, n_open):
                s_a, s_b, acc_a, acc_b, m_a, l_a, m_b, l_b, blk = _key_tile_pipe(
                    j, q_a, q_b, k_smem, v_smem, s_a, s_b, acc_a, acc_b, m_a, l_a, m_b, l_b,
                    blk, pos0, kv_hi, bt_row_ptr, cache_ptr, stride_kv,
                    stride_block, head_off, num_blocks, score_mult, BLOCK_SIZE, STRIDE_TOKEN,
                    HEAD, TILE_N, STAGES, False, LOAD, S_LAYOUT, O_LAYOUT, P_LAYOUT, HALF, HPP)
            for j in range(n_open, n_tiles):
                s_a, s_b, acc_a, acc_b, m_a, l_a, m_b, l_b, blk = _key_tile_pipe(
                    j, q_a, q_b, k_smem, v_smem, s_a, s_b, acc_a, acc_b, m_a, l_a, m_b, l_b,
                    blk, pos0, kv_hi, bt_row_ptr, cache_ptr, stride_kv,
                    stride_block, head_off, num_blocks, score_mult, BLOCK_SIZE, STRIDE_TOKEN,
                    HEAD, TILE_N, STAGES, True, LOAD, S_LAYOUT, O_LAYOUT, P_LAYOUT, HALF, HPP)
            s_a, s_b = warpgroup_mma_wait(0, deps=[s_a, s_b])
        else:
            for j in range(0, n_open):
                acc_a, acc_b, m_a, l_a, m_b, l_b, blk = _key_tile(
                    j, q_a, q_b, k_smem, v_smem, acc_a, acc_b, m_a, l_a, m_b, l_b, blk, pos0,
                    kv_hi, bt_row_ptr, cache_ptr, stride_kv, stride_block, head_off,
                    num_blocks, score_mult, BLOCK_SIZE, STRIDE_TOKEN, HEAD, TILE_N, STAGES, False,
                    LOAD, S_LAYOUT, O_LAYOUT, P_LAYOUT, HALF, SERIAL_QK, HPP)
            for j in range(n_open, n_tiles):
                acc_a, acc_b, m_a, l_a, m_b, l_b, blk = _key_tile(
                    j, q_a, q_b, k_smem, v_smem, acc_a, acc_b, m_a, l_a, m_b, l_b, blk, pos0,
                    kv_hi, bt_row_ptr, cache_ptr, stride_kv, stride_block, head_off,
                    num_blocks, score_mult, BLOCK_SIZE, STRIDE_TOKEN, HEAD, TILE_N, STAGES, True,
                    LOAD, S_LAYOUT, O_LAYOUT, P_LAYOUT, HALF, SERIAL_QK, HPP)
        acc_a, acc_b = warpgroup_mma_wait(0, deps=[acc_a, acc_b])
        cp.wait_group(0)

        r_o = gl.arange(0, HALF, layout=gl.SliceLayout(1, O_LAYOUT))
        d_o = gl.arange(0, HEAD, layout=gl.SliceLayout(0, O_LAYOUT))
        for h in gl.static_range(2):
            if h == 0:
                acc = acc_a
                l_i = l_a
            else:
                acc = acc_b
                l_i = l_b
            hq, tok, ok, _ = _rows(r_o + h * HALF, chunk, kv_head, q_start, q_tile, q_len,
                                   seq_len, HPP, GROUP, BLOCK_Q)
            ok = ok & (tok < num_q_tokens)
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
            o = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
            gl.store(out_ptr + gl.expand_dims(tok * stride_ot + hq * stride_oh, 1)
                     + gl.expand_dims(d_o, 0), o.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(ok, 1))


# -- warp-specialized: a producer warp group and two consumer warp groups of 128 rows each ---------------

@gluon.jit
def _ws_producer(k_smem, v_smem, full, empty, bt_row_ptr, cache_ptr, kv_hi, n_fill, stride_kv,
                 stride_block, head_off, num_blocks, BLOCK_SIZE: gl.constexpr,
                 STRIDE_TOKEN: gl.constexpr, HEAD: gl.constexpr, TILE_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """One warp group: gathers key tiles 0 .. n_fill - 1 (those past the keys all zeros: the
    consumers' pipelines may read one more) into ring slot j % STAGES once both consumers
    released it; every thread's copies arrive on the slot's ``full`` barrier as they land."""
    TPW: gl.constexpr = HEAD // 8
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW, TPW], [4, 1], [1, 0])
    for j in range(0, n_fill):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        blk = _block_ids(bt_row_ptr, j, kv_hi, BLOCK_SIZE, TILE_N, LOAD)
        t = j * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LOAD))
        blk = gl.where((blk >= 0) & (blk < num_blocks), blk, 0)
        row = blk.to(gl.int64) * stride_block + (t % BLOCK_SIZE) * STRIDE_TOKEN + head_off
        d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, LOAD))
        ptrs = cache_ptr + gl.expand_dims(row, 1) + gl.expand_dims(d, 0)
        ok = gl.expand_dims(t < kv_hi, 1) & gl.expand_dims(d < HEAD, 0)
        cp.async_copy_global_to_shared(k_smem.index(slot), ptrs, mask=ok)
        cp.async_copy_global_to_shared(v_smem.index(slot), ptrs + stride_kv, mask=ok)
        cp.mbarrier_arrive(full.index(slot))
        mbarrier.arrive(full.index(slot), count=1)


@gluon.jit
def _ws_tile(j, q_h, k_smem, v_smem, full, empty, acc, m_i, l_i, score_mult, pos0, kv_hi,
             MASKED: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr,
             ROW0: gl.constexpr, HPP: gl.constexpr, S_LAYOUT: gl.constexpr,
             O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, turn=None, ME: gl.constexpr = 0,
             PINGPONG: gl.constexpr = False, p_s=None, P_SMEM: gl.constexpr = False):
    """One key tile of one consumer: QK^T (PINGPONG: issued in this warp group's turn, which
    then passes to the other, so one's softmax runs under the other's MMAs), the softmax, PV
    left in flight."""
    slot = j % STAGES
    mbarrier.wait(full.index(slot), (j // STAGES) & 1)
    fence_async_shared()  # the copies were generic-proxy writes; the MMAs read by the async proxy
    zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
    if PINGPONG:
        mbarrier.wait(turn.index(ME), j & 1)
    s = warpgroup_mma(q_h, k_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - ME), count=1)
    s, acc = warpgroup_mma_wait(0, deps=[s, acc])  # PV(j - 1) is done too: release its slot
    mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
    p, acc, l_i, m_i = _softmax(s, m_i, l_i, acc, score_mult, pos0, j * TILE_N, kv_hi, MASKED,
                                TILE_N, S_LAYOUT, O_LAYOUT, ROW0, HPP)
    if P_SMEM:  # P through shared memory: the A operand takes no registers during the MMA
        p_s.store(p.to(q_h.dtype))
        fence_async_shared()
        gl.thread_barrier()  # the warp group's P stores, before its MMA reads them
        acc = warpgroup_mma(p_s, v_smem.index(slot), acc, is_async=True)
    else:
        p = gl.convert_layout(p.to(q_h.dtype), P_LAYOUT)
        acc = warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)
    return acc, m_i, l_i


@gluon.jit
def _ws_tile_pipe(j, s, q_h, k_smem, v_smem, full, empty, acc, m_i, l_i, score_mult, pos0,
                  kv_hi, MASKED: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
                  HALF: gl.constexpr, ROW0: gl.constexpr, HPP: gl.constexpr,
                  S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr):
    """FlashAttention-3's intra-warpgroup pipeline: on entry S(j) and then PV(j-1) are in
    flight. S(j+1) is issued first; tile j's softmax runs while PV(j-1) and S(j+1) do; only
    then does the accumulator wait for PV(j-1), take its rescale and issue PV(j)."""
    nxt = (j + 1) % STAGES
    mbarrier.wait(full.index(nxt), ((j + 1) // STAGES) & 1)
    fence_async_shared()
    zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
    s_next = warpgroup_mma(q_h, k_smem.index(nxt).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
    s = warpgroup_mma_wait(2, deps=[s])  # S(j) done; PV(j-1) and S(j+1) may still run
    p, alpha, l_i, m_i = _softmax_stats(s, m_i, l_i, score_mult, pos0, j * TILE_N, kv_hi,
                                        MASKED, TILE_N, S_LAYOUT, ROW0, HPP)
    p = gl.convert_layout(p.to(q_h.dtype), P_LAYOUT)
    acc = warpgroup_mma_wait(1, deps=[acc])  # PV(j-1) done: tile j - 1's slot is free
    mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
    acc = warpgroup_mma(p, v_smem.index(j % STAGES), acc, is_async=True)
    return acc, m_i, l_i, s_next


@gluon.jit
def _ws_tile_fa3(j, p_prev, q_h, k_smem, v_smem, full, empty, turn, acc, m_i, l_i, score_mult,
                 pos0, kv_hi, MASKED: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
                 HALF: gl.constexpr, ROW0: gl.constexpr, HPP: gl.constexpr, ME: gl.constexpr,
                 PINGPONG: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
                 P_LAYOUT: gl.constexpr, p_s=None, P_SMEM: gl.constexpr = False):
    """FlashAttention-3's consumer step j >= 1, in its order: issue S(j) and PV(j-1) (P(j-1)
    from the step before; PINGPONG: only in this warp group's turn, then the other's), run tile
    j's softmax while PV(j-1) does, then wait for PV(j-1), free tile j-1's slot and rescale.
    P_SMEM: P(j-1) is in shared memory ``p_s`` (``p_prev`` is a placeholder, returned as is),
    so no registers hold it while PV(j-1) runs; P(j) goes there once PV(j-1) is done."""
    slot = j % STAGES
    if PINGPONG:
        mbarrier.wait(turn.index(ME), (j - 1) & 1)
    mbarrier.wait(full.index(slot), (j // STAGES) & 1)
    fence_async_shared()
    zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
    s = warpgroup_mma(q_h, k_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    if P_SMEM:
        acc = warpgroup_mma(p_s, v_smem.index((j + STAGES - 1) % STAGES), acc, is_async=True)
    else:
        acc = warpgroup_mma(p_prev, v_smem.index((j + STAGES - 1) % STAGES), acc,
                            is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - ME), count=1)
    s = warpgroup_mma_wait(1, deps=[s])  # S(j) done; PV(j-1) may still run
    p, alpha, l_i, m_i = _softmax_stats(s, m_i, l_i, score_mult, pos0, j * TILE_N, kv_hi,
                                        MASKED, TILE_N, S_LAYOUT, ROW0, HPP)
    if P_SMEM:
        p = p.to(q_h.dtype)
    else:
        p = gl.convert_layout(p.to(q_h.dtype), P_LAYOUT)
    acc = warpgroup_mma_wait(0, deps=[acc])  # PV(j-1) done: tile j - 1 is used up
    mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
    if P_SMEM:
        p_s.store(p)
        fence_async_shared()
        gl.thread_barrier()  # the warp group's P stores, before its next MMA reads them
        p = p_prev
    return acc, p, m_i, l_i


@gluon.jit
def _ws_consumer(q_h, k_smem, v_smem, full, empty, turn, out_ptr, score_mult, pos0, kv_hi,
                 n_open, n_tiles, chunk, kv_head, q_start, q_tile, q_len, seq_len, num_q_tokens,
                 stride_ot, stride_oh, ROW0: gl.constexpr, HALF: gl.constexpr,
                 HEAD: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
                 HPP: gl.constexpr, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr,
                 PIPE: gl.constexpr, FA3: gl.constexpr, PINGPONG: gl.constexpr, p_s=None,
                 P_SMEM: gl.constexpr = False):
    """One warp group: rows [ROW0, ROW0 + HALF) of the program against every key tile (PIPE:
    the next QK^T issued first, ``_ws_tile_pipe``; FA3: FlashAttention-3's order,
    ``_ws_tile_fa3``, with PINGPONG the two warp groups taking turns to issue their MMAs)."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    acc = warpgroup_mma_init(gl.zeros([HALF, HEAD], gl.float32, layout=O_LAYOUT))
    l_i = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    m_i = gl.full([HALF], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    if PIPE:
        mbarrier.wait(full.index(0), 0)
        fence_async_shared()
        zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_h, k_smem.index(0).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        for j in range(0, n_open):
            acc, m_i, l_i, s = _ws_tile_pipe(j, s, q_h, k_smem, v_smem, full, empty, acc, m_i,
                                             l_i, score_mult, pos0, kv_hi, False, TILE_N, STAGES,
                                             HALF, ROW0, HPP, S_LAYOUT, O_LAYOUT, P_LAYOUT)
        for j in range(n_open, n_tiles):
            acc, m_i, l_i, s = _ws_tile_pipe(j, s, q_h, k_smem, v_smem, full, empty, acc, m_i,
                                             l_i, score_mult, pos0, kv_hi, True, TILE_N, STAGES,
                                             HALF, ROW0, HPP, S_LAYOUT, O_LAYOUT, P_LAYOUT)
        acc, s = warpgroup_mma_wait(0, deps=[acc, s])  # the extra tile's scores are dropped
    elif FA3:
        ME: gl.constexpr = 0 if ROW0 == 0 else 1
        acc = gl.zeros([HALF, HEAD], gl.float32, layout=O_LAYOUT)  # a tensor between steps
        mbarrier.wait(full.index(0), 0)
        fence_async_shared()
        zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_h, k_smem.index(0).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        if n_open > 0:  # tile 0's softmax (the accumulator is zero: nothing to rescale)
            p, alpha, l_i, m_i = _softmax_stats(s, m_i, l_i, score_mult, pos0, 0, kv_hi, False,
                                                TILE_N, S_LAYOUT, ROW0, HPP)
        else:
            p, alpha, l_i, m_i = _softmax_stats(s, m_i, l_i, score_mult, pos0, 0, kv_hi, True,
                                                TILE_N, S_LAYOUT, ROW0, HPP)
        if P_SMEM:
            p_s.store(p.to(q_h.dtype))
            fence_async_shared()
            gl.thread_barrier()
            p = l_i  # a placeholder: P lives in p_s
        else:
            p = gl.convert_layout(p.to(q_h.dtype), P_LAYOUT)
        for j in range(1, n_open):
            acc, p, m_i, l_i = _ws_tile_fa3(j, p, q_h, k_smem, v_smem, full, empty, turn, acc,
                                            m_i, l_i, score_mult, pos0, kv_hi, False, TILE_N,
                                            STAGES, HALF, ROW0, HPP, ME, PINGPONG, S_LAYOUT,
                                            O_LAYOUT, P_LAYOUT, p_s, P_SMEM)
        for j in range(gl.maximum(n_open, 1), n_tiles):
            acc, p, m_i, l_i = _ws_tile_fa3(j, p, q_h, k_smem, v_smem, full, empty, turn, acc,
                                            m_i, l_i, score_mult, pos0, kv_hi, True, TILE_N,
                                            STAGES, HALF, ROW0, HPP, ME, PINGPONG, S_LAYOUT,
                                            O_LAYOUT, P_LAYOUT, p_s, P_SMEM)
        last = gl.maximum(n_tiles, 1) - 1
        if P_SMEM:
            acc = warpgroup_mma(p_s, v_smem.index(last % STAGES), acc, is_async=True)
        else:
            acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    else:
        ME2: gl.constexpr = 0 if ROW0 == 0 else 1
        for j in range(0, n_open):
            acc, m_i, l_i = _ws_tile(j, q_h, k_smem, v_smem, full, empty, acc, m_i, l_i,
                                     score_mult, pos0, kv_hi, False, TILE_N, STAGES, HALF, ROW0,
                                     HPP, S_LAYOUT, O_LAYOUT, P_LAYOUT, turn, ME2, PINGPONG, p_s,
                                     P_SMEM)
        for j in range(n_open, n_tiles):
            acc, m_i, l_i = _ws_tile(j, q_h, k_smem, v_smem, full, empty, acc, m_i, l_i,
                                     score_mult, pos0, kv_hi, True, TILE_N, STAGES, HALF, ROW0,
                                     HPP, S_LAYOUT, O_LAYOUT, P_LAYOUT, turn, ME2, PINGPONG, p_s,
                                     P_SMEM)
        acc = warpgroup_mma_wait(0, deps=[acc])
    r = ROW0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, O_LAYOUT))
    d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, O_LAYOUT))
    hq, tok, ok, _ = _rows(r, chunk, kv_head, q_start, q_tile, q_len, seq_len, HPP, GROUP, BLOCK_Q)
    ok = ok & (tok < num_q_tokens)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
    o = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
    gl.store(out_ptr + gl.expand_dims(tok * stride_ot + hq * stride_oh, 1) + gl.expand_dims(d, 0),
             o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(ok, 1))


@gluon.jit
def _prefill_ws_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    score_mult, num_seqs, num_tiles, num_q_tokens, num_blocks, max_context,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_kv, stride_head,
    BLOCK_SIZE: gl.constexpr, STRIDE_TOKEN: gl.constexpr, NUM_HEADS: gl.constexpr,
    HEAD: gl.constexpr, GROUP: gl.constexpr, HPP: gl.constexpr, HEAD_CHUNKS: gl.constexpr,
    BLOCK_Q: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PIPE: gl.constexpr = False,
    FA3: gl.constexpr = False, PINGPONG: gl.constexpr = False, PAGE_PRODUCER: gl.constexpr = False,
    P_SMEM: gl.constexpr = False,
):
    """Launched with 4 warps: they set up and then run consumer 0; one worker warp group runs
    consumer 1, another the producer."""
    HALF: gl.constexpr = BLOCK_Q * HPP // 2
    TPW: gl.constexpr = HEAD // 8
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW, TPW], [4, 1], [1, 0])
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD], gl.bfloat16)
    KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HEAD], gl.bfloat16)
    kv_head, chunk, seq, q_start, q_len, q_tile = _program(qsl_ptr, num_seqs, num_tiles,
                                                           NUM_HEADS, HEAD_CHUNKS, BLOCK_Q)
    if q_tile < q_len:
        seq_len, first_pos, kv_hi, n_tiles, n_open = _keys(seq_lens_ptr, seq, q_len, q_tile,
                                                           max_context, BLOCK_Q, TILE_N)
        head_off = kv_head.to(gl.int64) * stride_head
        bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bt
        q_smem = _q_to_shared(q_ptr, chunk, kv_head, q_start, q_tile, q_len, seq_len,
                              num_q_tokens, stride_qt, stride_qh, HALF, HEAD, HPP, GROUP,
                              BLOCK_Q, LOAD, Q_SMEM)
        k_smem = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD],
                                           KV_SMEM)
        v_smem = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD],
                                           KV_SMEM)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        if PINGPONG:
            mbarrier.arrive(turn.index(0), count=1)  # warp group 0 issues first
        if PIPE:
            n_fill = n_tiles + 1
        else:
            n_fill = gl.maximum(n_tiles, 1)
        fence_async_shared()
        gl.thread_barrier()
        if PAGE_PRODUCER:
            P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, TILE_N], gl.bfloat16)
            p_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2, HALF, TILE_N], P_SH)
            gl.warp_specialize([
                (_ws_consumer, (q_smem.index(0), k_smem, v_smem, full, empty, turn, out_ptr,
                                score_mult, first_pos, kv_hi, n_open, n_tiles, chunk, kv_head,
                                q_start, q_tile, q_len, seq_len, num_q_tokens, stride_ot,
                                stride_oh, 0, HALF, HEAD, TILE_N, STAGES, HPP, GROUP, BLOCK_Q,
                                PIPE, FA3, PINGPONG, p_smem.index(0), P_SMEM)),
                (_ws_consumer, (q_smem.index(1), k_smem, v_smem, full, empty, turn, out_ptr,
                                score_mult, first_pos, kv_hi, n_open, n_tiles, chunk, kv_head,
                                q_start, q_tile, q_len, seq_len, num_q_tokens, stride_ot,
                                stride_oh, HALF, HALF, HEAD, TILE_N, STAGES, HPP, GROUP, BLOCK_Q,
                                PIPE, FA3, PINGPONG, p_smem.index(1), P_SMEM)),
                (_page_producer, (k_smem, v_smem, full, empty, bt_row_ptr, cache_ptr, kv_hi,
                                     n_fill, stride_kv, stride_block, head_off, num_blocks,
                                     BLOCK_SIZE, STRIDE_TOKEN, HEAD, TILE_N, STAGES)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_ws_consumer, (q_smem.index(0), k_smem, v_smem, full, empty, turn, out_ptr, score_mult,
                                first_pos, kv_hi, n_open, n_tiles, chunk, kv_head, q_start, q_tile,
                                q_len, seq_len, num_q_tokens, stride_ot, stride_oh, 0, HALF, HEAD,
                                TILE_N, STAGES, HPP, GROUP, BLOCK_Q, PIPE, FA3, PINGPONG)),
                (_ws_consumer, (q_smem.index(1), k_smem, v_smem, full, empty, turn, out_ptr, score_mult,
                                first_pos, kv_hi, n_open, n_tiles, chunk, kv_head, q_start, q_tile,
                                q_len, seq_len, num_q_tokens, stride_ot, stride_oh, HALF, HALF, HEAD,
                                TILE_N, STAGES, HPP, GROUP, BLOCK_Q, PIPE, FA3, PINGPONG)),
                (_ws_producer, (k_smem, v_smem, full, empty, bt_row_ptr, cache_ptr, kv_hi, n_fill,
                                stride_kv, stride_block, head_off, num_blocks, BLOCK_SIZE,
                                STRIDE_TOKEN, HEAD, TILE_N, STAGES)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


#: registers of each consumer warp group and of the producer warp group (``mode="ws..."``), by
#: key tile: the producer's gather addresses grow with the tile (at 128 keys, 56 spills and
#: 184 / 104 serializes the consumers' MMAs; 200 / 80 neither, checked offline with ``--compile``)
WS_REGS = {64: (200, 56), 128: (200, 80)}


#: registers of the two 128-row consumers and the one-warp page producer (``mode="ws256..."``):
#: 2 x 128 x 240 + 32 x 128 fills the register file
WS256_REGS = {False: (224, 56), True: (240, 32)}


def _mode_consts(mode, tile_n):
    if mode.startswith("ws256"):
        p_smem = mode.endswith("-ps")
        regs = WS256_REGS[p_smem]
        return dict(CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], PIPE=False,
                    FA3=mode.startswith("ws256-fa3"),
                    PINGPONG=mode.startswith(("ws256-pp", "ws256-fa3-pp")), PAGE_PRODUCER=True,
                    P_SMEM=p_smem)
    if mode.startswith("ws"):
        regs = WS_REGS[tile_n]
        return dict(CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], PIPE=mode == "ws-pipe",
                    FA3=mode.startswith("ws-fa3"), PINGPONG=mode == "ws-fa3-pp",
                    PAGE_PRODUCER=False, P_SMEM=False)
    return dict(PIPE=mode == "pipe", SERIAL_QK=mode == "serial")


def _kernel(mode):
    """(kernel, num_warps) of a mode."""
    return (_prefill_ws_kernel, 4) if mode.startswith("ws") else (_prefill_kernel, 8)


def _args(problem, block_q=64, heads=4, tile_n=64, stages=4, mode=""):
    """The launch of ``_prefill_kernel`` for a ``fkv.bench.attention.Problem``: (grid, args,
    constexprs)."""
    from fkv.ops._spec import cache_constexprs, cache_strides

    spec, q = problem.spec, problem.q
    group = q.shape[1] // spec.num_kv_heads
    heads = min(heads, group)
    chunks = -(-group // heads)
    strides = cache_strides(spec)
    batch = problem.batch
    num_q_tokens = q.shape[0]
    num_tiles = num_q_tokens // block_q + batch
    max_context = problem.block_table.shape[1] * spec.block_size
    scale = q.shape[2] ** -0.5
    assert q.stride(2) == 1 and problem.out.stride(2) == 1
    grid = (num_tiles * spec.num_kv_heads * chunks,)
    args = (q, problem.cache, problem.block_table, problem.seq_lens, problem.query_start_loc,
            problem.out, scale * 1.4426950408889634, batch, num_tiles, num_q_tokens,
            spec.num_blocks, max_context, q.stride(0), q.stride(1), problem.out.stride(0),
            problem.out.stride(1), problem.block_table.stride(0), strides["stride_block"],
            strides["stride_kv"], strides["stride_head"])
    consts = dict(BLOCK_SIZE=spec.block_size, STRIDE_TOKEN=strides["stride_token"],
                  NUM_HEADS=spec.num_kv_heads, HEAD=spec.head_size, GROUP=group, HPP=heads,
                  HEAD_CHUNKS=chunks, BLOCK_Q=block_q, TILE_N=tile_n, STAGES=stages,
                  **_mode_consts(mode, tile_n))
    assert not cache_constexprs(spec)["CACHE_FP8"] and spec.head_size in (64, 128)
    return grid, args, consts


def compile_offline(stages=4, layout="NHD", mode="", block_q=64, tile_n=64):
    """Compile for sm_90a with the Triton on the path (no GPU); registers, spills, shared."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    import fkv
    from fkv.ops._spec import cache_strides

    spec = fkv.KVCacheSpec(layout=layout, num_blocks=1024, block_size=16, num_kv_heads=8,
                           head_size=128, dtype="bfloat16")
    st = cache_strides(spec)
    consts = dict(BLOCK_SIZE=16, STRIDE_TOKEN=st["stride_token"], NUM_HEADS=8, HEAD=128,
                  GROUP=4, HPP=4, HEAD_CHUNKS=1, BLOCK_Q=block_q, TILE_N=tile_n, STAGES=stages,
                  **_mode_consts(mode, tile_n))
    from compile_gluon_prefill import ptxas  # bench/experiments/

    from fkv.ops._attention_gluon import offline_signature

    kernel, warps = _kernel(mode)
    sig, attrs = offline_signature(kernel, consts)
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    import collections
    import re

    ptx = ck.asm["ptx"]
    waits = collections.Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))
    return {"shared": ck.metadata.shared, "ptxas": ptxas(ptx),
            "wgmma_waits": dict(sorted(waits.items()))}


def run(problem, stages=4, mode="", block_q=64, tile_n=64):
    grid, args, consts = _args(problem, block_q=block_q, tile_n=tile_n, stages=stages, mode=mode)
    kernel, warps = _kernel(mode)
    kernel[grid](*args, **consts, num_warps=warps)
    return problem.out


#: (stages, mode, block_q, tile_n) of the GPU run: "" (half b's QK^T in flight), "serial" (each
#: QK^T waited for at once, as Triton compiles the default), "pipe" (each half's QK^T half a tile
#: ahead), "ws" (a producer warp group and two consumer warp groups of block_q * 4 / 2 rows),
#: "ws-pipe" (the same, each consumer's next QK^T issued first; needs 3 slots or more),
#: "ws-fa3" (each consumer in FlashAttention-3's order), "ws-fa3-pp" (and the two consumers
#: taking turns to issue their MMAs, FA3's ping-pong)
VARIANTS = ((4, "ws", 32, 64), (4, "ws-pipe", 32, 64), (4, "ws-fa3", 32, 64),
            (4, "ws-fa3-pp", 32, 64), (5, "ws-fa3-pp", 32, 64), (3, "serial", 64, 64),
            # FlashAttention-3's causal tile for head size 128: 128 x 128, 2 or 3 slots
            (2, "ws-fa3", 32, 128), (2, "ws-fa3-pp", 32, 128), (3, "ws-fa3", 32, 128),
            (3, "ws-fa3-pp", 32, 128),
            # the default's 256-row tile: two consumers of 128 rows, a one-warp page producer;
            # -pp: ping-pong of the QK^T issue; -ps: P through shared memory
            (4, "ws256", 64, 64), (4, "ws256-pp", 64, 64), (4, "ws256-pp-ps", 64, 64),
            (3, "ws256-pp-ps", 64, 64), (4, "ws256-ps", 64, 64),
            # and FA3's order, P(j-1) in shared memory while PV(j-1) runs under tile j's softmax
            (4, "ws256-fa3-ps", 64, 64), (4, "ws256-fa3-pp-ps", 64, 64))


def _chosen():
    """VARIANTS, or only the one ``--only=K`` names (so that one that hangs costs only itself:
    ``for k in 0 1 2 3 4 5; do timeout 90 python prefill_gluon.py --only=$k; done``)."""
    only = [int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--only=")]
    return [VARIANTS[k] for k in only] if only else list(VARIANTS)


def main() -> None:
    if "--compile" in sys.argv:
        for stages, mode, bq, tn in VARIANTS:
            for layout in ("NHD", "HND"):
                try:
                    print(stages, mode, bq, tn, layout, compile_offline(stages, layout, mode, bq, tn),
                          flush=True)
                except Exception as e:  # noqa: BLE001 - an experiment: say what failed
                    print(stages, layout, f"{type(e).__name__}: {str(e)[:3000]}", flush=True)
        return
    import torch

    import _record  # bench/experiments/_record.py

    from fkv.bench.attention import Problem, Shape

    rows = []
    for layout in ("NHD", "HND"):
        for batch, n, q_len in ((1, 256, 256), (2, 1000, 300), (3, 777, 777), (4, 4096, 4096)):
            p = Problem(Shape(), layout, batch, n, q_len, "cuda")
            ref = p.kernel().clone()
            # SDPA's causal mask is top-left aligned: only comparable when q_len == seq_len
            want = p.sdpa().transpose(1, 2).reshape(ref.shape) if q_len == n else ref
            for stages, mode, bq, tn in _chosen():
                row = {"layout": layout, "batch": batch, "seq": n, "q_len": q_len,
                       "variant": f"gluon {mode + ' ' if mode else ''}s{stages} bq{bq} n{tn}"}
                try:
                    p.out.zero_()
                    _kernel(mode)[0].device_caches.clear()
                    out = run(p, stages, mode, bq, tn).clone()
                    row["max_diff_vs_default"] = (out.float() - ref.float()).abs().max().item()
                    row["max_diff_vs_sdpa"] = (out.float() - want.float()).abs().max().item()
                    row["default_vs_sdpa"] = (ref.float() - want.float()).abs().max().item()
                    if batch == 4:
                        row["ms"] = triton.testing.do_bench(lambda: run(p, stages, mode, bq, tn), rep=200,
                                                            return_mode="median")
                    try:
                        row.update(_record.compiled(_kernel(mode)[0]))
                    except Exception as e:  # noqa: BLE001 - registers are a side note
                        row["compiled_error"] = _record.error(e)
                except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                    row["error"] = _record.error(e)
                rows.append(row)
                print(row, flush=True)
            if batch == 4:
                ms = triton.testing.do_bench(lambda: p.kernel(), rep=200, return_mode="median")
                rows.append({"layout": layout, "variant": "default", "ms": ms})
                print(rows[-1], flush=True)
                rows.append(_record.cudnn_row(p, layout, 200))
            del p
            torch.cuda.empty_cache()
    only = [a for a in sys.argv if a.startswith("--only=")]
    _record.write(f"prefill-gluon{only[0][6:].replace('=', '-')}-exp.json" if only
                  else "prefill-gluon-exp.json", "prefill in Gluon: QK^T of half b in flight", rows)


if __name__ == "__main__":
    main()
