"""The 256-row prefill tile as a warp-specialized Gluon kernel (Hopper, sm_90).

Triton compiles ``_paged_attention_kernel``'s 256-row prefill tile (row halves, 64-key tiles, 8
warps) with every warp loading K/V pages, running QK^T, the softmax and PV in turn, both warp
groups held together by a barrier per key tile. This kernel computes the same rows with the same
arithmetic (the same base-2 online softmax, P rounded to the input dtype, the same MMA
instructions in the same order: the same bytes, checked on the GPU), arranged as
FlashAttention-3 arranges a tile:

- a producer of one warp gathers each key tile page by page (``cp.async``, masked past the keys
  the tile sees) into a ring of shared-memory slots, each guarded by a ``full`` and an ``empty``
  mbarrier;
- two consumer warp groups own 128 rows each. Each issues tile j's QK^T together with tile
  j - 1's PV, runs tile j's softmax while that PV runs, then rescales the accumulator and leaves
  P(j) in shared memory for the next PV (in shared memory no registers hold it, which is what
  lets 128 rows fit beside the accumulator);
- the two consumers take turns to issue their MMAs (two mbarriers pass the turn), so one's
  softmax runs under the other's tensor-core work.

Measured on an H200 (B=4 x 4096 causal,
bench/results/raw/prefill-gluon-ws16-exp-20261202T0500.json): 1.218-1.228 ms against the Triton
tile's 1.249-1.259 ms in the same run. Used by :func:`fkv.ops.attention.paged_attention` when
the launch qualifies (:func:`eligible`); any failure to compile falls back to the Triton kernel.
The CPU interpreter does not run Gluon, so this path is tested on the GPU only.
"""

from __future__ import annotations

from typing import Any

try:  # Gluon ships with Triton >= 3.5; its Hopper module is what this kernel needs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except Exception:  # noqa: BLE001 - any Triton without it simply keeps the Triton kernel
    gluon = None
else:
    # the CTA (in a warp-specialized partition: the partition's warps) barrier: named
    # ``thread_barrier`` in Triton 3.6, ``barrier`` in later releases
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # cp.async into shared memory: ``async_copy_global_to_shared`` in 3.6, ``async_load`` later
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared

#: rows per program (query tokens x heads), keys per tile, ring slots, and the registers of
#: each consumer warp group and of the producer warp (2 x 128 x 240 + 32 x 32 fit the register
#: file; ptxas serializes the MMAs with less for the consumers, bench/NOTES.md)
ROWS = 256
TILE_N = 64
STAGES = 4
CONSUMER_REGS = 240
PRODUCER_REGS = 32
HEAD_SIZES = (128,)


def available() -> bool:
    return gluon is not None


if gluon is not None:

    @gluon.jit
    def _rows(r, chunk, kv_head, q_start, q_tile, q_len, HPP: gl.constexpr, GROUP: gl.constexpr,
              BLOCK_Q: gl.constexpr):
        """Row r of the tile: (query head, token, in range)."""
        qi = r // HPP
        hh = chunk * HPP + r % HPP
        hq = kv_head * GROUP + hh
        tok = (q_start + q_tile + qi).to(gl.int64)
        ok = (r < BLOCK_Q * HPP) & (q_tile + qi < q_len) & (hh < GROUP)
        return hq, tok, ok

    @gluon.jit
    def _program(qsl_ptr, num_seqs, num_tiles, NUM_HEADS: gl.constexpr,
                 HEAD_CHUNKS: gl.constexpr, BLOCK_Q: gl.constexpr):
        """(kv_head, head chunk, sequence, first query token, query count, tile's first query)
        in ``_paged_attention_kernel``'s order (heads of a query tile are neighbours, longest
        query tiles first)."""
        pid = gl.program_id(0)
        hc = pid % (NUM_HEADS * HEAD_CHUNKS)
        tile = num_tiles - 1 - pid // (NUM_HEADS * HEAD_CHUNKS)
        lo = tile * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = gl.load(qsl_ptr + mid).to(gl.int32) // BLOCK_Q + mid <= tile
            lo = gl.where(ok, mid, lo)
            hi = gl.where(ok, hi, mid)
        q_start = gl.load(qsl_ptr + lo).to(gl.int32)
        q_len = gl.load(qsl_ptr + lo + 1).to(gl.int32) - q_start
        q_tile = (tile - (q_start // BLOCK_Q + lo)) * BLOCK_Q
        return hc // HEAD_CHUNKS, hc % HEAD_CHUNKS, lo, q_start, q_len, q_tile

    @gluon.jit
    def _softmax(s, m_i, l_i, score_mult, pos0, t0, hi, MASKED: gl.constexpr,
                 TILE_N: gl.constexpr, S_LAYOUT: gl.constexpr, ROW0: gl.constexpr,
                 HPP: gl.constexpr):
        """One online-softmax step: (P, alpha, l, m). Masked tiles hide keys past each row's
        position and past the keys the tile sees."""
        if MASKED:
            r = ROW0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, S_LAYOUT))
            q_pos = pos0 + r // HPP
            t = t0 + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, S_LAYOUT))
            visible = ((gl.expand_dims(t, 0) <= gl.expand_dims(q_pos, 1))
                       & gl.expand_dims(t < hi, 0))
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * score_mult)
        p = gl.exp2(s * score_mult - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, l_i * alpha + gl.sum(p, 1), m_new

    @gluon.jit
    def _producer(k_smem, v_smem, full, empty, bt_row_ptr, cache_ptr, kv_hi, n_fill, stride_kv,
                  stride_block, head_off, num_blocks, BLOCK_SIZE: gl.constexpr,
                  STRIDE_TOKEN: gl.constexpr, HEAD: gl.constexpr, TILE_N: gl.constexpr,
                  STAGES: gl.constexpr):
        """One warp: key tile j into slot j % STAGES once both consumers released it, page by
        page, 8 tokens a copy; keys past ``kv_hi`` are zeros; block ids outside the cache read
        block 0 (as the Triton kernel does)."""
        TPW: gl.constexpr = HEAD // 8
        ROWS8: gl.constexpr = 8
        PAGE: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW, TPW], [1, 1], [1, 0])
        r = gl.arange(0, ROWS8, layout=gl.SliceLayout(1, PAGE))
        d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, PAGE))
        inner = gl.expand_dims(r * STRIDE_TOKEN, 1) + gl.expand_dims(d, 0)
        for j in range(0, n_fill):
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
            for pg in gl.static_range(TILE_N // BLOCK_SIZE):
                t0 = j * TILE_N + pg * BLOCK_SIZE
                blk = gl.load(bt_row_ptr + t0 // BLOCK_SIZE, mask=t0 < kv_hi, other=0)
                blk = gl.where((blk >= 0) & (blk < num_blocks), blk, 0)
                page = cache_ptr + (blk.to(gl.int64) * stride_block + head_off)
                for part in gl.static_range(BLOCK_SIZE // ROWS8):
                    ptrs = page + part * ROWS8 * STRIDE_TOKEN + inner
                    ok = (gl.expand_dims(t0 + part * ROWS8 + r < kv_hi, 1)
                          & gl.expand_dims(d < HEAD, 0))
                    _async_load(
                        k_smem.index(slot).slice(pg * BLOCK_SIZE + part * ROWS8, ROWS8), ptrs,
                        mask=ok)
                    _async_load(
                        v_smem.index(slot).slice(pg * BLOCK_SIZE + part * ROWS8, ROWS8),
                        ptrs + stride_kv, mask=ok)
            cp.mbarrier_arrive(full.index(slot))
            mbarrier.arrive(full.index(slot), count=1)

    @gluon.jit
    def _step(j, q_h, p_s, k_smem, v_smem, full, empty, turn, acc, m_i, l_i, score_mult, pos0,
              kv_hi, MASKED: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
              HALF: gl.constexpr, ROW0: gl.constexpr, HPP: gl.constexpr, ME: gl.constexpr,
              S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr):
        """Key tile j >= 1 of one consumer: in its turn, issue S(j) and PV(j - 1) (P(j - 1) in
        ``p_s``), pass the turn, run tile j's softmax under PV(j - 1), then free tile j - 1's
        slot, rescale and leave P(j) in ``p_s``."""
        slot = j % STAGES
        mbarrier.wait(turn.index(ME), (j - 1) & 1)
        mbarrier.wait(full.index(slot), (j // STAGES) & 1)
        fence_async_shared()  # the copies were generic-proxy writes; the MMAs read async
        zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_h, k_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p_s, v_smem.index((j + STAGES - 1) % STAGES), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - ME), count=1)
        s = warpgroup_mma_wait(1, deps=[s])  # S(j) done; PV(j - 1) may still run
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score_mult, pos0, j * TILE_N, kv_hi, MASKED,
                                      TILE_N, S_LAYOUT, ROW0, HPP)
        p = p.to(q_h.dtype)
        acc = warpgroup_mma_wait(0, deps=[acc])  # PV(j - 1) done: tile j - 1 is used up
        mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
        p_s.store(p)
        fence_async_shared()
        _barrier()  # this warp group's P stores, before its next MMA reads them
        return acc, m_i, l_i

    @gluon.jit
    def _consumer(q_h, p_s, k_smem, v_smem, full, empty, turn, out_ptr, score_mult, pos0, kv_hi,
                  n_open, n_tiles, chunk, kv_head, q_start, q_tile, q_len, num_q_tokens,
                  stride_ot, stride_oh, ROW0: gl.constexpr, HALF: gl.constexpr,
                  HEAD: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
                  HPP: gl.constexpr, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr):
        """One warp group: rows [ROW0, ROW0 + HALF) against every key tile, then the output."""
        ME: gl.constexpr = 0 if ROW0 == 0 else 1
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, TILE_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD, 16])
        acc = gl.zeros([HALF, HEAD], gl.float32, layout=O_LAYOUT)
        l_i = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        m_i = gl.full([HALF], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        # tile 0 (the accumulator is zero: nothing to rescale)
        mbarrier.wait(full.index(0), 0)
        fence_async_shared()
        zero = gl.zeros([HALF, TILE_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_h, k_smem.index(0).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        if n_open > 0:
            p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score_mult, pos0, 0, kv_hi, False,
                                          TILE_N, S_LAYOUT, ROW0, HPP)
        else:
            p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score_mult, pos0, 0, kv_hi, True,
                                          TILE_N, S_LAYOUT, ROW0, HPP)
        p_s.store(p.to(q_h.dtype))
        fence_async_shared()
        _barrier()
        for j in range(1, n_open):
            acc, m_i, l_i = _step(j, q_h, p_s, k_smem, v_smem, full, empty, turn, acc, m_i, l_i,
                                  score_mult, pos0, kv_hi, False, TILE_N, STAGES, HALF, ROW0,
                                  HPP, ME, S_LAYOUT, O_LAYOUT)
        for j in range(gl.maximum(n_open, 1), n_tiles):
            acc, m_i, l_i = _step(j, q_h, p_s, k_smem, v_smem, full, empty, turn, acc, m_i, l_i,
                                  score_mult, pos0, kv_hi, True, TILE_N, STAGES, HALF, ROW0,
                                  HPP, ME, S_LAYOUT, O_LAYOUT)
        last = gl.maximum(n_tiles, 1) - 1
        acc = warpgroup_mma(p_s, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        r = ROW0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, O_LAYOUT))
        d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, O_LAYOUT))
        hq, tok, ok = _rows(r, chunk, kv_head, q_start, q_tile, q_len, HPP, GROUP, BLOCK_Q)
        ok = ok & (tok < num_q_tokens)
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
        o = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
        gl.store(out_ptr + gl.expand_dims(tok * stride_ot + hq * stride_oh, 1)
                 + gl.expand_dims(d, 0), o.to(out_ptr.dtype.element_ty),
                 mask=gl.expand_dims(ok, 1))

    # per-batch values are not specialized on (as in _paged_attention_kernel): a new batch size
    # or token count never compiles another variant
    @gluon.jit(do_not_specialize=["num_seqs", "num_tiles", "num_q_tokens", "num_blocks",
                                  "max_context"])
    def _prefill_ws_kernel(
        q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
        score_mult, num_seqs, num_tiles, num_q_tokens, num_blocks, max_context,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_kv,
        stride_head,
        BLOCK_SIZE: gl.constexpr, STRIDE_TOKEN: gl.constexpr, NUM_HEADS: gl.constexpr,
        HEAD: gl.constexpr, GROUP: gl.constexpr, HPP: gl.constexpr, HEAD_CHUNKS: gl.constexpr,
        BLOCK_Q: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """Launched with 4 warps: they load Q, then run consumer 0; a worker warp group runs
        consumer 1, a worker warp the producer."""
        HALF: gl.constexpr = BLOCK_Q * HPP // 2
        TPW: gl.constexpr = HEAD // 8
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW, TPW], [4, 1], [1, 0])
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD], gl.bfloat16)
        KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HEAD],
                                                                     gl.bfloat16)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, TILE_N], gl.bfloat16)
        kv_head, chunk, seq, q_start, q_len, q_tile = _program(qsl_ptr, num_seqs, num_tiles,
                                                               NUM_HEADS, HEAD_CHUNKS, BLOCK_Q)
        if q_tile < q_len:
            # Unvalidated values cannot fault: seq_len is clamped to the block table's capacity
            # (as in the Triton kernel), block ids outside the cache read block 0, rows outside
            # [0, num_q_tokens) are masked.
            seq_len = gl.minimum(gl.maximum(gl.load(seq_lens_ptr + seq).to(gl.int32), 0),
                                 max_context)
            pos0 = seq_len - q_len + q_tile  # position of the program's first query
            kv_hi = gl.minimum(pos0 + BLOCK_Q - 1, seq_len - 1) + 1
            n_open = gl.maximum(gl.minimum(pos0 + 1, kv_hi) // TILE_N, 0)
            n_tiles = gl.cdiv(kv_hi, TILE_N)
            head_off = kv_head.to(gl.int64) * stride_head
            bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bt
            q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2, HALF, HEAD], Q_SMEM)
            d_l = gl.arange(0, HEAD, layout=gl.SliceLayout(0, LOAD))
            for h in gl.static_range(2):
                r = h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, LOAD))
                hq, tok, ok = _rows(r, chunk, kv_head, q_start, q_tile, q_len, HPP, GROUP,
                                    BLOCK_Q)
                ok = ok & (tok < num_q_tokens)
                qv = gl.load(q_ptr + gl.expand_dims(tok * stride_qt + hq * stride_qh, 1)
                             + gl.expand_dims(d_l, 0), mask=gl.expand_dims(ok, 1), other=0.0)
                q_smem.index(h).store(qv)
            k_smem = gl.allocate_shared_memory(cache_ptr.dtype.element_ty,
                                               [STAGES, TILE_N, HEAD], KV_SMEM)
            v_smem = gl.allocate_shared_memory(cache_ptr.dtype.element_ty,
                                               [STAGES, TILE_N, HEAD], KV_SMEM)
            p_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2, HALF, TILE_N],
                                               P_SMEM)
            full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(full.index(i), count=1)
                mbarrier.init(empty.index(i), count=2)
            for i in gl.static_range(2):
                mbarrier.init(turn.index(i), count=1)
            mbarrier.arrive(turn.index(0), count=1)  # consumer 0 issues first
            n_fill = gl.maximum(n_tiles, 1)
            fence_async_shared()
            _barrier()
            gl.warp_specialize([
                (_consumer, (q_smem.index(0), p_smem.index(0), k_smem, v_smem, full, empty, turn,
                             out_ptr, score_mult, pos0, kv_hi, n_open, n_tiles, chunk, kv_head,
                             q_start, q_tile, q_len, num_q_tokens, stride_ot, stride_oh, 0, HALF,
                             HEAD, TILE_N, STAGES, HPP, GROUP, BLOCK_Q)),
                (_consumer, (q_smem.index(1), p_smem.index(1), k_smem, v_smem, full, empty, turn,
                             out_ptr, score_mult, pos0, kv_hi, n_open, n_tiles, chunk, kv_head,
                             q_start, q_tile, q_len, num_q_tokens, stride_ot, stride_oh, HALF,
                             HALF, HEAD, TILE_N, STAGES, HPP, GROUP, BLOCK_Q)),
                (_producer, (k_smem, v_smem, full, empty, bt_row_ptr, cache_ptr, kv_hi, n_fill,
                             stride_kv, stride_block, head_off, num_blocks, BLOCK_SIZE,
                             STRIDE_TOKEN, HEAD, TILE_N, STAGES)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


#: compile signatures whose Gluon compile or launch failed: they keep the Triton kernel
_FAILED: set[tuple[Any, ...]] = set()
_launched = 0


def launches() -> int:
    """How many launches this process made with this kernel (tests and benchmarks check that
    the path they time or test is this one, not the Triton fallback)."""
    return _launched


def launch(q: Any, cache: Any, block_table: Any, seq_lens: Any, query_start_loc: Any, out: Any,
           *, score_mult: float, num_seqs: int, num_tiles: int, num_q_tokens: int,
           num_blocks: int, max_context: int, strides: dict[str, int], block_size: int,
           num_kv_heads: int, head_size: int, group: int, heads: int, chunks: int,
           block_q: int) -> bool:
    """Launch the kernel; False (nothing launched) where it does not compile or launch here."""
    key = (q.device, q.dtype, cache.dtype, strides["stride_token"], block_size, num_kv_heads,
           head_size, group, heads, chunks, block_q)
    if gluon is None or key in _FAILED:
        return False
    grid = (num_tiles * num_kv_heads * chunks,)
    try:
        _prefill_ws_kernel[grid](
            q, cache, block_table, seq_lens, query_start_loc, out,
            score_mult, num_seqs, num_tiles, num_q_tokens, num_blocks, max_context,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
            strides["stride_block"], strides["stride_kv"], strides["stride_head"],
            BLOCK_SIZE=block_size, STRIDE_TOKEN=strides["stride_token"], NUM_HEADS=num_kv_heads,
            HEAD=head_size, GROUP=group, HPP=heads, HEAD_CHUNKS=chunks, BLOCK_Q=block_q,
            TILE_N=TILE_N, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
            PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
        )
    except Exception:  # noqa: BLE001 - a Triton whose Gluon cannot build this keeps Triton's
        _FAILED.add(key)
        return False
    global _launched
    _launched += 1
    return True


# -- building without a GPU (the check that this Triton still builds the kernel) -----------------

_POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
             "qsl_ptr": "*i32", "out_ptr": "*bf16"}


def offline_signature(kernel: Any, consts: dict[str, Any]) -> tuple[dict[str, str], dict]:
    """(signature, attributes) of a prefill Gluon kernel (this one or an experiment's with the
    same argument names) for an offline compile: bf16 data, int32 tables, pointers and strides
    16-divisible, as a launch on aligned tensors specializes them."""
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            sig[name] = _POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "score_mult":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name != "stride_bt":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_sm90(*, block_size: int, stride_token: int, group: int, block_q: int,
                 num_kv_heads: int = 8) -> Any:
    """This kernel built for sm_90a by the installed Triton, without a GPU (bf16, head size 128,
    one head chunk): the compiled kernel (``.asm["ptx"]``, ``.metadata.shared``). A Triton that
    cannot build it makes ``paged_attention`` fall back to the Triton kernel without a word; the
    CPU test suite builds it so that such a release shows. Not under ``TRITON_INTERPRET=1``:
    the interpreter turns the ``triton.language`` helpers the kernel inlines into Python
    functions, and the build fails (a warm Triton cache hides it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if gluon is None:
        raise RuntimeError("this Triton has no Gluon")
    consts = dict(BLOCK_SIZE=block_size, STRIDE_TOKEN=stride_token, NUM_HEADS=num_kv_heads,
                  HEAD=128, GROUP=group, HPP=group, HEAD_CHUNKS=1, BLOCK_Q=block_q,
                  TILE_N=TILE_N, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS)
    sig, attrs = offline_signature(_prefill_ws_kernel, consts)
    src = GluonASTSource(fn=_prefill_ws_kernel, signature=sig, constexprs=consts, attrs=attrs)
    # fp fusion on, as a launch compiles (stated: Triton 3.9 warns when it is left to default)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "enable_fp_fusion": True})


def ptxas_report(ptx: str) -> tuple[int, str]:
    """Assemble an sm_90a PTX with the installed Triton's ``ptxas -v``: (exit status, its
    output: registers, spills, and the C7512 warning when it serialized warpgroup MMAs for want
    of registers)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia import compiler as nv

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([nv.get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True)
    return res.returncode, res.stdout + res.stderr
