"""Experiment (not yet run on a GPU): prefill attention with half b one key tile behind half a.

The row-halves kernel (``fkv/ops/_attention_kernels.py``, ``ROW_HALVES``) issues both halves'
QK^T and Triton waits for each at once (``wgmma.wait_group 0``; bench/NOTES.md, fifth session):
only loop-carried dots stay in flight. Here the unmasked loop computes half b's scores of tile j
after half a's softmax of tile j, carries them to the next iteration, and runs half b's softmax
and PV of tile j - 1 there (its V loaded again, from L2). So half b's QK^T is loop-carried, which
Triton keeps in flight through half b's softmax of the previous tile, and at most two score tiles
are live at once, as now. The arithmetic of every row is unchanged: the output must be
bit-identical to the default (checked here in the interpreter with ``TRITON_INTERPRET=1``).

    TRITON_INTERPRET=1 python bench/experiments/prefill_lag_b.py     # CPU: bit-exactness only
    python bench/experiments/prefill_lag_b.py                        # GPU: B=4 x 4096 causal,
                                                                     # default vs lagged vs cuDNN
The JSON goes to ``$OUT`` (or /tmp) as ``prefill-lag-b-exp.json``.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import attrs
import torch
import triton

import _record  # bench/experiments/_record.py (the script's own folder is on sys.path)

ROOT = pathlib.Path(__file__).resolve().parents[2]

HELPER = '''
@triton.jit
def _attend_range2_lag(
    acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, lo, hi_tiles, hi,
    cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, score_mult,
    softcap_mult, BLOCK_SIZE: tl.constexpr, STRIDE_TOKEN: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, FMA_SCORES: tl.constexpr,
):
    if lo < hi_tiles:
        t, row = _tile_rows(lo, hi, bt_row_ptr, head_off, stride_block, num_blocks, BLOCK_SIZE,
                            STRIDE_TOKEN, TILE_N, False)
        k = _load_rows(cache_ptr, row, t, hi, HEAD_SIZE, HEAD_PAD, False)
        v = _load_rows(cache_ptr + stride_kv, row, t, hi, HEAD_SIZE, HEAD_PAD, False).to(q_a.dtype)
        qk_a = _qk(q_a, k, DOT_F32, PRECISION)
        acc_a, l_a, m_a = _softmax_pv(acc_a, l_a, m_a, qk_a, qk_a, v, score_mult, softcap_mult,
                                      False, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, False)
        qk_b = _qk(q_b, k, DOT_F32, PRECISION)
        for start in range(lo + TILE_N, hi_tiles, TILE_N):
            t, row = _tile_rows(start, hi, bt_row_ptr, head_off, stride_block, num_blocks,
                                BLOCK_SIZE, STRIDE_TOKEN, TILE_N, False)
            k = _load_rows(cache_ptr, row, t, hi, HEAD_SIZE, HEAD_PAD, False)
            v = _load_rows(cache_ptr + stride_kv, row, t, hi, HEAD_SIZE, HEAD_PAD,
                           False).to(q_a.dtype)
            tp, rowp = _tile_rows(start - TILE_N, hi, bt_row_ptr, head_off, stride_block,
                                  num_blocks, BLOCK_SIZE, STRIDE_TOKEN, TILE_N, False)
            vp = _load_rows(cache_ptr + stride_kv, rowp, tp, hi, HEAD_SIZE, HEAD_PAD,
                            False).to(q_a.dtype)
            qk_a = _qk(q_a, k, DOT_F32, PRECISION)
            acc_a, l_a, m_a = _softmax_pv(acc_a, l_a, m_a, qk_a, qk_a, v, score_mult,
                                          softcap_mult, False, USE_SOFTCAP, DOT_F32, PRECISION,
                                          FMA_SCORES, False)
            qk_b_next = _qk(q_b, k, DOT_F32, PRECISION)
            acc_b, l_b, m_b = _softmax_pv(acc_b, l_b, m_b, qk_b, qk_b, vp, score_mult,
                                          softcap_mult, False, USE_SOFTCAP, DOT_F32, PRECISION,
                                          FMA_SCORES, False)
            qk_b = qk_b_next
        tl_, rowl = _tile_rows(hi_tiles - TILE_N, hi, bt_row_ptr, head_off, stride_block,
                               num_blocks, BLOCK_SIZE, STRIDE_TOKEN, TILE_N, False)
        vl = _load_rows(cache_ptr + stride_kv, rowl, tl_, hi, HEAD_SIZE, HEAD_PAD,
                        False).to(q_a.dtype)
        acc_b, l_b, m_b = _softmax_pv(acc_b, l_b, m_b, qk_b, qk_b, vl, score_mult, softcap_mult,
                                      False, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES, False)
    return acc_a, l_a, m_a, acc_b, l_b, m_b


@triton.jit
def _rows('''

UNMASKED = '''        acc_a, l_a, m_a, acc_b, l_b, m_b = _attend_range2(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, q_pos_a, q_pos_b, u_lo, u_hi, kv_hi,
            cache_ptr, bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, window,
            score_mult, softcap_mult, BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N,
            False, USE_WINDOW, USE_SOFTCAP, DOT_F32, PRECISION, FMA_SCORES)
'''

LAGGED = '''        acc_a, l_a, m_a, acc_b, l_b, m_b = _attend_range2_lag(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q_a, q_b, u_lo, u_hi, kv_hi, cache_ptr,
            bt_row_ptr, head_off, stride_block, stride_kv, num_blocks, score_mult, softcap_mult,
            BLOCK_SIZE, STRIDE_TOKEN, HEAD_SIZE, HEAD_PAD, TILE_N, USE_SOFTCAP, DOT_F32,
            PRECISION, FMA_SCORES)
'''


def lagged_kernel():
    """The kernel module with the unmasked loop of the halves replaced by the lagged one."""
    src = (ROOT / "fkv/ops/_attention_kernels.py").read_text()
    if UNMASKED not in src or "\n\n@triton.jit\ndef _rows(" not in src:
        raise SystemExit("the halves kernel changed: update this experiment's text patterns")
    src = src.replace("\n\n@triton.jit\ndef _rows(", HELPER, 1).replace(UNMASKED, LAGGED, 1)
    path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "fkv_prefill_lag_b_kernels.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("fkv_prefill_lag_b_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._paged_attention_kernel


def main() -> None:
    import fkv.ops._attention_kernels as K
    from fkv.bench.attention import Problem, Shape

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    default, lagged = K._paged_attention_kernel, lagged_kernel()
    rows = []
    for layout in ("NHD", "HND"):
        # CPU: a tile of 256 rows over 4 unmasked key tiles and a masked one (slow interpreter)
        p = Problem(Shape(), layout, 4, 4096, 4096, dev) if cuda else \
            Problem(Shape(), layout, 1, 320, 320, dev)
        outs = {}
        # the lagged loop reloads the previous tile's V: 5 stages overflow shared memory (first
        # GPU run: 246784 bytes of 232448), so fewer stages are tried too
        variants = [("halves", default, None), ("halves, b lagged", lagged, None)]
        if cuda:
            from fkv.ops.attention import attention_config
            cfg = attention_config(num_seqs=p.batch, num_q_tokens=p.q.shape[0], num_q_heads=32,
                                   num_kv_heads=8, head_size=128,
                                   max_context=p.block_table.shape[1] * 16, itemsize=2,
                                   num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                                   varlen=True)
            for st in (4, 3):
                c = attrs.evolve(cfg, num_stages=st)
                variants += [(f"halves s{st}", default, c), (f"halves, b lagged s{st}", lagged, c)]
        for name, kern, cfg in variants:
            K._paged_attention_kernel = kern
            try:
                if cuda:  # only this variant's compiled kernel left to read registers from
                    kern.device_caches.clear()
                outs[name] = p.kernel(cfg).clone()
                row = {"layout": layout, "variant": name,
                       "max_diff_vs_halves": (outs[name].float()
                                              - outs["halves"].float()).abs().max().item()}
                if cuda:
                    row["ms"] = triton.testing.do_bench(lambda: p.kernel(cfg), rep=300,
                                                        return_mode="median")
                    row.update(_record.compiled(kern))
            except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                row = {"layout": layout, "variant": name, "error": _record.error(e)}
            finally:
                K._paged_attention_kernel = default
            rows.append(row)
            print(row, flush=True)
        if cuda:
            rows.append(_record.cudnn_row(p, layout, 300))
        del p
    _record.write("prefill-lag-b-exp.json", "prefill attention: half b one key tile behind",
                  rows)

if __name__ == "__main__":
    main()
