"""fkv.ops.paged_attention against a float64 reference, over layouts, backends, dtypes and options.

Caches are filled with random values through their logical views (every layout), block tables are
random non-contiguous permutations with garbage in the unused entries, sequence lengths are not
multiples of the block size, and outputs are poisoned with NaN first so an unwritten element shows.
Shapes are tiny: the kernels run in the Triton interpreter on CPU (``device`` fixture), or on a
GPU under the ``gpu`` marker.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
from typing import Any

import attrs
import pytest
import torch

import fkv
from fkv import FkvError, KVCacheSpec
from fkv.ops import paged_attention
from fkv.ops import reference as R
from fkv.ops import attention as A
from fkv.ops.attention import AttentionConfig, attention_config

RA = importlib.import_module("fkv.ops.reference._attention")

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}


class Case:
    """A cache filled with random values, a block table, seq lens and queries for one call."""

    def __init__(self, device: str, *, backend: str = "triton", layout: str = "NHD",
                 cross_layer: bool = False, dtype: str = "bfloat16", q_dtype: Any = None,
                 hq: int = 4, hkv: int = 2, head_size: int = 32, block_size: int = 4,
                 seq_lens: tuple[int, ...] = (1, 7, 13, 4), q_lens: tuple[int, ...] | None = None,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        n = block_size
        need = [-(-s // n) for s in seq_lens]
        max_blocks = max(need) + 1  # one more column than needed: capacity is not the length
        num_blocks = sum(need) + 3
        if backend == "mla":
            hkv = 1
        self.spec = KVCacheSpec(backend=backend, layout=layout, cross_layer=cross_layer,
                                num_layers=2, num_blocks=num_blocks, block_size=n,
                                num_kv_heads=hkv, head_size=head_size, dtype=dtype)
        caches = fkv.allocate(self.spec, device=device)
        for c in caches:  # every layer random: a wrong layer offset reads the other layer's values
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
        self.cache = caches[1]
        perm = torch.randperm(num_blocks, generator=g).tolist()
        table = torch.randint(-5, 1 << 20, (len(seq_lens), max_blocks), generator=g)  # garbage
        for b, k in enumerate(need):
            table[b, :k] = torch.tensor(perm[:k], dtype=torch.int64)
            perm = perm[k:]
        self.block_table = table.to(torch.int32).to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        qd = q_dtype or (torch.bfloat16 if self.spec.is_fp8 else getattr(torch, dtype))
        total = len(seq_lens) if q_lens is None else sum(q_lens)
        self.q = torch.randn(total, hq, head_size, generator=g).to(qd).to(device)
        self.query_start_loc = None
        if q_lens is not None:
            offsets = [0]
            for ql in q_lens:
                offsets.append(offsets[-1] + ql)
            self.query_start_loc = torch.tensor(offsets, dtype=torch.int32, device=device)
        self.kw: dict[str, Any] = {}
        if self.spec.is_fp8:
            self.kw["k_scale"] = torch.tensor([0.75], device=device)
            self.kw["v_scale"] = torch.tensor([1.5], device=device)

    def args(self) -> tuple[Any, ...]:
        return self.q, self.cache, self.spec, self.block_table, self.seq_lens

    def run(self, **kw: Any) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        res = paged_attention(*self.args(), query_start_loc=self.query_start_loc, out=out,
                              **self.kw, **kw)
        assert res is out
        return out

    def expected(self, **kw: Any) -> torch.Tensor:
        kw.pop("config", None)
        return RA.attend(*self.args(), query_start_loc=self.query_start_loc, **self.kw, **kw,
                         acc_dtype=torch.float64)

    def check(self, **kw: Any) -> None:
        got = self.run(**kw).double().cpu()
        want = self.expected(**kw).cpu()
        assert not got.isnan().any(), "unwritten (NaN-poisoned) output elements"
        tol = TOL[self.q.dtype] * (float(self.kw["v_scale"]) if self.kw else 1.0)
        err = (got - want).abs().max().item()
        assert torch.allclose(got, want, atol=tol, rtol=tol), f"max abs error {err}"


LAYOUTS = [(b, lay, x) for b in ("triton", "flash_attn") for lay in ("NHD", "HND") for x in (False, True)]


def _id(p: tuple[str, str, bool]) -> str:
    return f"{p[0]}-{p[1]}{'-xl' if p[2] else ''}"


@pytest.mark.parametrize("where", LAYOUTS + [("flashinfer", "HND", False)], ids=_id)
def test_decode_every_layout(device: str, where: tuple[str, str, bool]) -> None:
    backend, layout, cross = where
    Case(device, backend=backend, layout=layout, cross_layer=cross).check()


@pytest.mark.parametrize("where", LAYOUTS, ids=_id)
def test_varlen_prefill_every_layout(device: str, where: tuple[str, str, bool]) -> None:
    backend, layout, cross = where
    # Full prefill (q_len == seq_len), chunked prefill with context, an empty query, a decode row.
    Case(device, backend=backend, layout=layout, cross_layer=cross, seq_lens=(6, 9, 3, 13),
         q_lens=(6, 4, 0, 1)).check()


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (6, 2), (8, 1)], ids=["MHA", "GQA3", "MQA"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gqa_mqa(device: str, hq: int, hkv: int, mode: str) -> None:
    q_lens = None if mode == "decode" else (2, 5, 1, 4)
    Case(device, hq=hq, hkv=hkv, seq_lens=(3, 7, 13, 4), q_lens=q_lens, seed=hq).check()


# Loop structure: tiles of 16 keys over sequences of up to 70 tokens, so the unmasked middle loop,
# both masked loops, window bounds inside a tile and flash-decoding splits all run.
LONG = dict(block_size=4, seq_lens=(70, 33, 17, 48))
SMALL_TILES = AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=1)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 5}, {"sliding_window": 21, "softcap": 3.0},
                                  {"softcap": 1.5}], ids=["causal", "window5", "window21-softcap", "softcap"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_tiles_window_softcap_splits(device: str, mode: str, opts: dict[str, Any], splits: int) -> None:
    q_lens = None if mode == "decode" else (9, 33, 2, 20)
    case = Case(device, q_lens=q_lens, layout="HND", seed=splits, **LONG)
    cfg = AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=splits)
    case.check(config=cfg, **opts)


def _alibi_sinks(device: str, hq: int, which: str) -> dict[str, torch.Tensor]:
    """ALiBi slopes as engines make them (2^-8i/Hq) and sinks of both signs, per query head."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
    sinks = torch.linspace(-2.0, 3.0, hq, dtype=torch.float32)
    kw = {"alibi_slopes": slopes.to(device), "sinks": sinks.to(device)}
    return {k: v for k, v in kw.items() if k.split("_")[0] in which}


@pytest.mark.parametrize("cfg", [
    AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=1),
    AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=3),
    AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=3, fused_merge=True),
    AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=1, lazy_rescale=True),
], ids=["one-split", "splits", "fused-merge", "lazy"])
@pytest.mark.parametrize(("which", "opts"), [
    ("alibi", {}), ("sinks", {}), ("alibi sinks", {"sliding_window": 21, "softcap": 3.0})],
    ids=["alibi", "sinks", "both-window-softcap"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_alibi_and_sinks(device: str, mode: str, which: str, opts: dict[str, Any],
                         cfg: AttentionConfig) -> None:
    """ALiBi slopes and attention sinks (the spec's read path) against the reference, through
    every loop of the kernel: masked and unmasked tiles, splits merged by a second kernel or in
    the same launch (a sink counted once), and the lazy-rescale knob (off under ALiBi)."""
    q_lens = None if mode == "decode" else (9, 33, 2, 20)
    case = Case(device, q_lens=q_lens, layout="HND", seed=8, **LONG)
    case.check(config=cfg, **opts, **_alibi_sinks(device, case.q.shape[1], which))
    if cfg.fused_merge:
        assert _merge_counters_zero()


@pytest.mark.parametrize("shape", ["mla", "head-chunks"])
def test_alibi_and_sinks_per_query_head(device: str, shape: str) -> None:
    """Each query head takes its own slope and sink wherever its row sits: MLA (every query head
    over the one latent) and a GQA group split over programs (heads_per_program < Hq / Hkv)."""
    if shape == "mla":
        case = Case(device, backend="mla", hq=8, head_size=40, q_lens=(1, 7, 2, 4), seed=10)
        cfg = AttentionConfig(block_q=2, heads_per_program=4, tile_n=16, num_splits=2)
    else:
        case = Case(device, hq=12, hkv=2, q_lens=(3, 7, 1, 2), seq_lens=(3, 30, 17, 4), seed=11)
        cfg = AttentionConfig(block_q=2, heads_per_program=4, tile_n=16, num_splits=2)
    case.check(config=cfg, **_alibi_sinks(device, case.q.shape[1], "alibi sinks"))


def test_alibi_and_sinks_in_row_halves(device: str) -> None:
    """The two-half prefill tile adds the same bias and starts from the same sink: the bits of
    one tile (16-bit queries, in the interpreter; the reference's values on the GPU)."""
    case = Case(device, q_lens=(9, 33, 2, 20), layout="NHD", seed=9, **LONG)
    kw = _alibi_sinks(device, case.q.shape[1], "alibi sinks")
    cfg = AttentionConfig(block_q=16, heads_per_program=2, tile_n=16)
    base = case.run(config=cfg, **kw)
    got = case.run(config=attrs.evolve(cfg, row_halves=True), **kw)
    if device == "cpu":
        assert torch.equal(got, base)
    case.check(config=attrs.evolve(cfg, row_halves=True), **kw)


def test_alibi_and_sinks_by_hand() -> None:
    """An oracle that is not the reference: one decode query over three keys, in float64 by
    hand: scores q.k * scale + slope * (j - 2) (the query sits at position 2), and the sink's
    logit in the denominator only."""
    case = Case("cpu", dtype="float32", seq_lens=(3,), hq=2, hkv=1, head_size=8, block_size=4)
    slopes, sinks = torch.tensor([0.5, 0.125]), torch.tensor([1.0, -0.75])
    got = case.run(alibi_slopes=slopes, sinks=sinks).double()
    ref = RA.attend(*case.args(), alibi_slopes=slopes, sinks=sinks, acc_dtype=torch.float64)
    blk = int(case.block_table[0, 0])
    k = case.cache[blk, 0, :3, 0].double()  # [3 keys, D] of KV head 0
    v = case.cache[blk, 1, :3, 0].double()
    for h in range(2):
        s = (case.q[0, h].double() @ k.T) / math.sqrt(8) + slopes[h].double() * (
            torch.arange(3, dtype=torch.float64) - 2)
        w = torch.exp(s) / (torch.exp(s).sum() + math.exp(float(sinks[h])))
        assert torch.allclose(ref[0, h], w @ v, atol=1e-12)
        assert torch.allclose(got[0, h], w @ v, atol=1e-5)


def test_alibi_and_sinks_bad_inputs() -> None:
    """Shape, dtype, device and (with ``validate``) finite values, each named; nothing written."""
    case = Case("cpu", dtype="float32", seq_lens=(3, 5), hq=4, hkv=2, head_size=8)
    out = torch.full_like(case.q, 7.0)
    for name in ("alibi_slopes", "sinks"):
        for bad, shown in ((torch.zeros(3), "(3,) torch.float32"),
                           (torch.zeros(5), "(5,) torch.float32"),
                           (torch.zeros(4, dtype=torch.float64), "(4,) torch.float64"),
                           (torch.zeros(1, 4), "(1, 4) torch.float32"), ([0.0] * 4, "list")):
            with pytest.raises(FkvError) as e:
                paged_attention(*case.args(), out=out, **{name: bad})
            assert str(e.value) == (f"{name!r} must be a float32 tensor of shape (4,): one value "
                                    f"per query head (got {shown!r}); convert with .float()")
        with pytest.raises(FkvError) as e:
            paged_attention(*case.args(), out=out, **{name: torch.zeros(4, device="meta")})
        assert str(e.value) == f"{name!r} is on meta but 'q' is on cpu"
        nan = torch.tensor([0.0, 1.0, float("nan"), 2.0])
        message = f"'{name}[2]' is nan; every query head's value must be finite"
        with pytest.raises(FkvError) as e:
            paged_attention(*case.args(), out=out, **{name: nan})
        assert str(e.value) == message
        with pytest.raises(FkvError) as e:  # the reference checks whatever validate says
            R.paged_attention(*case.args(), **{name: nan}, validate=False)
        assert str(e.value) == message
    assert bool((out == 7.0).all())


def test_alibi_and_sinks_keep_a_launch_off_the_gluon_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch tells the Gluon tile's gate about slopes and sinks (the tile computes
    neither): on a GPU where it would run, such a launch goes to the Triton kernel. Here the gate
    is recorded and the device made to look like an sm_90."""
    seen = []

    def gate(*args: Any, **kw: Any) -> str:
        seen.append((kw["alibi"], kw["sinks"]))
        return "recorded"

    monkeypatch.setattr(A, "_gluon_device", lambda device: True)
    monkeypatch.setattr(A, "gluon_prefill_refusal", gate)
    case = Case("cpu", q_lens=(3, 5), seq_lens=(3, 5), hq=4, hkv=2)
    cfg = AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, warp_specialized=True)
    for which, want in (("", (False, False)), ("alibi", (True, False)), ("sinks", (False, True)),
                        ("alibi sinks", (True, True))):
        case.check(config=cfg, **_alibi_sinks("cpu", 4, which))
        assert seen.pop() == want


@pytest.mark.parametrize(("fma", "heads_first"), [(False, True), (True, False)])
def test_kernel_knobs(device: str, fma: bool, heads_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's tuning knobs other than the defaults (timed by the bench's sweep)."""
    monkeypatch.setattr(A, "_FMA_SCORES", fma)
    monkeypatch.setattr(A, "_HEADS_FIRST", heads_first)
    case = Case(device, q_lens=(9, 33, 2, 20), layout="HND", hq=4, hkv=2, **LONG)
    case.check(config=AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=3),
               sliding_window=21)


def test_split_heads_into_chunks(device: str) -> None:
    """heads_per_program < Hq/Hkv: the query group is split over programs (and padded: 6 = 4 + 2)."""
    case = Case(device, hq=12, hkv=2, q_lens=(3, 7, 1, 2), seq_lens=(3, 30, 17, 4))
    case.check(config=AttentionConfig(block_q=2, heads_per_program=4, tile_n=16, num_splits=2))


def test_default_config_runs_splits(device: str) -> None:
    """The default configuration, with a block-table capacity large enough to split."""
    case = Case(device, seq_lens=(1100, 5), head_size=16, block_size=32, hq=2, hkv=1)
    cfg = attention_config(num_seqs=2, num_q_tokens=2, num_q_heads=2, num_kv_heads=1, head_size=16,
                           max_context=case.block_table.shape[1] * 32, itemsize=2,
                           num_sms=1 if device == "cpu" else
                           torch.cuda.get_device_properties(0).multi_processor_count, varlen=False)
    assert cfg.num_splits > 1
    case.check()


# -- round-4 candidates of the GPU sweep (bench/gpu_kernels_sweep.py): selectable, pinned here ----

def _merge_counters_zero() -> bool:
    return all(int(c.abs().sum()) == 0 for c in A._MERGE_COUNTERS.values())


@pytest.mark.parametrize("opts", [{}, {"sliding_window": 21, "softcap": 3.0}],
                         ids=["causal", "window21-softcap"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_fused_merge(device: str, mode: str, opts: dict[str, Any]) -> None:
    """Splits merged in the kernel by the last split of each group to finish: the reference's
    result, the second kernel's result up to float rounding, and every ticket counter back at 0
    (the next launch, here with another split count, starts from clean counters)."""
    q_lens = None if mode == "decode" else (9, 33, 2, 20)
    case = Case(device, q_lens=q_lens, layout="NHD", seed=7, **LONG)
    for splits in (2, 5):
        cfg = AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=splits,
                              fused_merge=True)
        case.check(config=cfg, **opts)
        assert _merge_counters_zero()
        fused = case.run(config=cfg, **opts)
        second = case.run(config=attrs.evolve(cfg, fused_merge=False), **opts)
        assert torch.allclose(fused.float(), second.float(), atol=1e-2, rtol=0)
        assert torch.equal(fused, case.run(config=cfg, **opts))  # deterministic merge order


def test_fused_merge_empty_splits_and_head_chunks(device: str) -> None:
    """More splits than a short sequence has tiles (empty splits still take their ticket), GQA
    head chunks, and a fused merge without splits (nothing to merge: the plain kernel)."""
    case = Case(device, seq_lens=(70, 3, 17), head_size=16, block_size=4, hq=8, hkv=2, seed=5)
    need = case.block_table.shape[1]
    table = torch.randint(-5, 1 << 20, (3, 4 * need), dtype=torch.int32).to(device)
    table[:, :need] = case.block_table
    case.block_table = table
    for heads, splits in ((4, 5), (2, 3), (1, 2), (2, 1)):
        case.check(config=AttentionConfig(block_q=1, heads_per_program=heads, tile_n=16,
                                          num_splits=splits, fused_merge=True))
        assert _merge_counters_zero()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_range_stages_change_no_bit(device: str, mode: str) -> None:
    """tl.range pipelining of the key loop: the same arithmetic, bit for bit."""
    q_lens = None if mode == "decode" else (9, 33, 2, 20)
    case = Case(device, q_lens=q_lens, layout="HND", seed=2, **LONG)
    cfg = AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=2)
    base = case.run(config=cfg, sliding_window=21)
    for r in (2, 4):
        assert torch.equal(case.run(config=attrs.evolve(cfg, range_stages=r),
                                    sliding_window=21), base)
    case.check(config=attrs.evolve(cfg, range_stages=3, fused_merge=True))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pdl_changes_no_bit(device: str, mode: str, layout: str) -> None:
    """``pdl=True`` (programmatic dependent launch on sm_90+, ignored elsewhere): the same bits,
    split or not, fused merge or not."""
    q_lens = None if mode == "decode" else (9, 33, 2, 20)
    case = Case(device, q_lens=q_lens, layout=layout, seed=4, **LONG)
    for cfg in (AttentionConfig(block_q=4, heads_per_program=2, tile_n=16),
                AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=3),
                AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=3,
                                fused_merge=True)):
        base = case.run(config=cfg, sliding_window=21)
        assert torch.equal(case.run(config=cfg, sliding_window=21, pdl=True), base)
    assert torch.equal(case.run(pdl=True), case.run())  # the default config too


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("dtype", "opts"), [("bfloat16", {}), ("bfloat16", {"sliding_window": 21}),
                                             ("bfloat16", {"softcap": 5.0}), ("fp8", {}),
                                             ("float32", {})])
def test_row_halves_change_no_bit(device: str, layout: str, dtype: str, opts: dict[str, Any]) -> None:
    """``row_halves``: the reference's values for every tile; the same bits as one tile for 16-bit
    queries (masked and unmasked key tiles, GQA rows, window, softcap, fp8) in the interpreter
    and, on the GPU, for the 256-row prefill tile (both halves and the whole then run the same
    warpgroup MMA per 64 rows). Smaller GPU tiles may round differently: the 128-row mid tile on
    4 warps gave the same bytes on the bench's shape but not on this one (H200).
    Ignored for split launches and tiles of < 32 rows."""
    case = Case(device, q_lens=(9, 33, 2, 20), layout=layout, dtype=dtype, seed=6, **LONG)
    for cfg, exact_on_gpu in (
            (AttentionConfig(block_q=8, heads_per_program=2, tile_n=16), True),   # 16 rows: off
            (AttentionConfig(block_q=16, heads_per_program=2, tile_n=16), False),  # halves of 16
            (AttentionConfig(block_q=32, heads_per_program=2, tile_n=32), False),  # halves of 32
            (AttentionConfig(block_q=16, heads_per_program=2, tile_n=16, num_splits=3), True),
            (AttentionConfig(block_q=128, heads_per_program=2, tile_n=64, num_warps=8,
                             num_stages=5), True)):                                # halves of 128
        base = case.run(config=cfg, **opts)
        halves = attrs.evolve(cfg, row_halves=True)
        got = case.run(config=halves, **opts)
        if dtype == "float32" or (device == "cuda" and not exact_on_gpu):
            torch.testing.assert_close(got, base, rtol=TOL[case.q.dtype], atol=TOL[case.q.dtype])
        else:
            assert torch.equal(got, base), cfg
        case.check(config=halves, **opts)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("dtype", "opts"), [("bfloat16", {}), ("bfloat16", {"softcap": 4.0}),
                                             ("bfloat16", {"sliding_window": 19}), ("fp8", {})])
def test_mid_tile_halves_default(device: str, layout: str, dtype: str, opts: dict[str, Any]) -> None:
    """The default 128-row mid tile of chunked prefill (32 queries x 4 heads of 64, no split)
    runs in halves: the reference's values, and the whole tile's (bit for bit in the
    interpreter; within rounding on the GPU, where 64-row halves may round otherwise)."""
    cfg = attention_config(num_seqs=64, num_q_tokens=64 * 32, num_q_heads=32, num_kv_heads=8,
                           head_size=64, max_context=4096, itemsize=2, num_sms=132, varlen=True)
    assert (cfg.block_q, cfg.heads_per_program, cfg.num_splits, cfg.num_warps, cfg.row_halves) \
        == (32, 4, 1, 4, True)
    case = Case(device, hq=8, hkv=2, head_size=64, layout=layout, dtype=dtype, block_size=4,
                seq_lens=(77, 40), q_lens=(32, 27), seed=12)
    got = case.run(config=cfg, **opts)
    whole = case.run(config=attrs.evolve(cfg, row_halves=False), **opts)
    if device == "cuda":
        torch.testing.assert_close(got, whole, rtol=TOL[case.q.dtype], atol=TOL[case.q.dtype])
    else:
        assert torch.equal(got, whole)
    case.check(config=cfg, **opts)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("group", "q_len"), [(2, 32), (4, 16), (4, 32)])
def test_small_head_mid_tiles(device: str, layout: str, group: int, q_len: int) -> None:
    """Head size 32, the default mid tiles of chunked prefill (64 and 128 rows, no split): the
    values of the reference. On the GPU this is also the compile check: Triton 3.6's ptxas
    crashed (SIGSEGV) on these tiles with 3 stages, which the default then took."""
    cfg = attention_config(num_seqs=64, num_q_tokens=64 * q_len, num_q_heads=8 * group,
                           num_kv_heads=8, head_size=32, max_context=4096, itemsize=2,
                           num_sms=132, varlen=True)
    assert (cfg.block_q, cfg.heads_per_program, cfg.tile_n, cfg.num_splits, cfg.num_warps,
            cfg.num_stages) == (q_len, group, 64, 1, 4, 2)
    case = Case(device, hq=2 * group, hkv=2, head_size=32, layout=layout, block_size=4,
                seq_lens=(q_len + 45, q_len + 6), q_lens=(q_len, q_len - 5), seed=11)
    for opts in ({}, {"softcap": 4.0}, {"sliding_window": 19}):
        case.check(config=cfg, **opts)


def test_row_halves_config() -> None:
    """The H200 prefill tile and the 128-row mid tile run in halves (the mid tile not for heads
    of <= 32); 64-row tiles, decode tiles, split prefill launches, 32-bit and large heads do not;
    the knob refuses the loop variants it does not run."""
    pre = attention_config(num_seqs=4, num_q_tokens=4 * 4096, max_context=4096, varlen=True,
                           **H200)
    assert pre.row_halves and pre.num_splits == 1
    small = attention_config(num_seqs=4, num_q_tokens=4 * 300, max_context=4096, varlen=True,
                             **H200)
    assert small.num_splits > 1 and not small.row_halves
    mid = attention_config(num_seqs=64, num_q_tokens=64 * 32, max_context=4096, varlen=True,
                           **H200)   # chunked prefill, 32 queries x 4 heads = 128 rows
    assert (mid.block_q, mid.heads_per_program, mid.num_splits, mid.row_halves) == (32, 4, 1, True)
    small = attention_config(num_seqs=64, num_q_tokens=64 * 32, max_context=4096, varlen=True,
                             **{**H200, "head_size": 32})  # head size <= 32: 256-row tiles only
    assert (small.block_q, small.num_splits, small.row_halves) == (32, 1, False)
    narrow = attention_config(num_seqs=64, num_q_tokens=64 * 16, max_context=4096, varlen=True,
                              **H200)  # 64 rows: halves of 32 lose on the H200
    assert (narrow.block_q, narrow.num_splits, narrow.row_halves) == (16, 1, False)
    dec = attention_config(num_seqs=64, num_q_tokens=64, max_context=8192, varlen=False, **H200)
    assert not dec.row_halves
    f32 = attention_config(num_seqs=4, num_q_tokens=4 * 4096, max_context=4096, varlen=True,
                           **{**H200, "itemsize": 4})
    assert not f32.row_halves
    for bad in ({"lazy_rescale": True}, {"range_stages": 3}):
        with pytest.raises(FkvError, match=r"'row_halves' runs the plain key loop: it takes "
                                           r"neither 'lazy_rescale' nor 'range_stages'"):
            AttentionConfig(block_q=64, heads_per_program=4, tile_n=64, row_halves=True, **bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_pdl_must_be_a_bool(bad: Any) -> None:
    case = Case("cpu")
    with pytest.raises(FkvError, match=rf"'pdl' must be True or False \(got {bad!r}\)"):
        case.run(pdl=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_pdl_waits_for_the_kernel_before_it(splits: int, slow_copy: Any) -> None:
    """A producer that lets its dependents launch at once and writes the queries ~0.1 ms later:
    ``paged_attention(pdl=True)`` right after it reads the producer's queries (in a CUDA graph
    too)."""
    case = Case("cuda", hq=8, hkv=2, head_size=128, block_size=16, seq_lens=(300, 1000, 17, 64),
                seed=5)
    cfg = AttentionConfig(block_q=1, heads_per_program=4, tile_n=64, num_splits=splits)
    src = case.q.clone().flatten()
    want = case.run(config=cfg)
    out = torch.empty_like(case.q)
    paged_attention(*case.args(), out=out, config=cfg, pdl=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slow_copy[(src.numel() // 1024,)](case.q, src, 100000, BLOCK=1024)
        paged_attention(*case.args(), out=out, config=cfg, pdl=True)
    for _ in range(3):
        case.q.zero_()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


# the sweep's prefill candidates scaled down: rows = block_q x heads_per_program of a group of 4
# (one head of 8 queries, 2 heads of 4, 4 heads of 2), key tiles of 16 and 32 (one, two pages).
PREFILL_VARIANTS = [(8, 1, 16, 2), (8, 1, 32, 3), (4, 2, 32, 2), (4, 2, 16, 0), (2, 4, 16, 2),
                    (16, 1, 16, 0)]


@pytest.mark.parametrize(("block_q", "heads", "tile_n", "range_stages"), PREFILL_VARIANTS)
def test_prefill_tile_variants(device: str, block_q: int, heads: int, tile_n: int,
                               range_stages: int) -> None:
    """Chunked and full prefill over every rows / heads / key-tile split of the sweep's prefill
    candidates (diagonal tiles narrower and wider than the query tile)."""
    case = Case(device, hq=8, hkv=2, head_size=32, block_size=4, seq_lens=(70, 33, 17, 48),
                q_lens=(70, 9, 17, 20), seed=block_q + heads)
    cfg = AttentionConfig(block_q=block_q, heads_per_program=heads, tile_n=tile_n,
                          range_stages=range_stages)
    case.check(config=cfg)
    case.check(config=cfg, sliding_window=13)


@pytest.mark.parametrize("row_halves", [False, True])
def test_unmasked_tile_bounds_at_tile_edges(device: str, row_halves: bool) -> None:
    """The unmasked key range of a 32-query tile ends exactly at its edges: the last row's window
    starts one key past a tile start (81 keys, window 48: key 32 is out for the last row, in for
    the first; a tile visible to every row starts at 48, not 32), and the first row's last key
    is a tile's second-to-last (46 keys, first row at 14: key 15 is the next tile's, masked)."""
    case = Case(device, hq=2, hkv=1, head_size=16, block_size=4, seq_lens=(81, 46),
                q_lens=(32, 32), seed=13)
    cfg = AttentionConfig(block_q=32, heads_per_program=1, tile_n=16, row_halves=row_halves)
    case.check(config=cfg, sliding_window=48)
    case.check(config=cfg)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_dead_cache_slots_are_never_read(device: str, layout: str) -> None:
    """Slots past each sequence's length and blocks outside its table may hold anything (an
    engine's stale or never-written memory): poisoned with NaN, nothing changes. A key tile's
    loads stop at the split's end (masked scores times NaN values would be NaN; keys past it read
    block 0, dead here) and a padded head (80 of 128) loads no column past the head size (in HND
    that is the next slot)."""
    case = Case(device, hq=4, hkv=2, head_size=80, layout=layout, block_size=4,
                seq_lens=(70, 33, 17, 48), q_lens=(9, 33, 2, 20), seed=14)
    keys, values = RA._keys_values(case.cache, case.spec)
    used = case.block_table[:, :-1]  # the last column is past every sequence's blocks
    free = sorted(set(range(case.spec.num_blocks)) - set(used.flatten().tolist()))[0]
    keys[free], values[free] = keys[0], values[0]
    used[used == 0] = free  # block 0 (where an out-of-range or masked-off id reads) is dead too
    live = torch.zeros(keys.shape[:2], dtype=torch.bool, device=device)
    for b, length in enumerate(case.seq_lens.tolist()):
        for t in range(length):
            live[case.block_table[b, t // 4].long(), t % 4] = True
    keys[~live] = float("nan")
    values[~live] = float("nan")
    assert case.cache.isnan().any()
    for cfg in (AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=3),
                AttentionConfig(block_q=16, heads_per_program=2, tile_n=16, row_halves=True)):
        case.check(config=cfg, sliding_window=21)
        case.check(config=cfg)


@pytest.mark.parametrize("splits", [1, 2])
def test_window_starts_at_a_tile_last_key(device: str, splits: int) -> None:
    """Decode whose window starts at the last key of a key tile (20, 36 and 52 keys, windows 5
    and 21: key 15, 31 or 47 is the first visible): that tile is still read, masked."""
    case = Case(device, hq=4, hkv=2, head_size=16, block_size=4, seq_lens=(20, 36, 52), seed=16)
    cfg = AttentionConfig(block_q=1, heads_per_program=2, tile_n=16, num_splits=splits)
    for window in (5, 21):
        case.check(config=cfg, sliding_window=window)


def test_row_halves_of_one_query_token(device: str) -> None:
    """Decode of a 32-head group in row halves (one query token, 16 heads a half): the second
    half's rows are heads 16..31 and take their own ALiBi slopes and sinks."""
    case = Case(device, hq=32, hkv=1, head_size=16, block_size=4, seq_lens=(23, 9), seed=17)
    kw = _alibi_sinks(device, 32, "alibi sinks")
    case.check(config=AttentionConfig(block_q=1, heads_per_program=32, tile_n=16,
                                      row_halves=True), **kw)


@pytest.mark.parametrize("q_scale", [1.0, 12.0])
@pytest.mark.parametrize(("dtype", "mode"), [("float32", "prefill"), ("bfloat16", "prefill"),
                                             ("bfloat16", "decode")])
def test_lazy_rescale(device: str, dtype: str, mode: str, q_scale: float) -> None:
    """Unmasked tiles keep a stale row max while no row's max grew by more than 8 (base 2): the
    reference's result, with small scores (the max settles: stale path) and large ones (maxima
    jump by more than 8: rescaled), with splits and a window (masked tiles after lazy ones)."""
    q_lens = None if mode == "decode" else (70, 9, 17, 20)
    case = Case(device, q_lens=q_lens, dtype=dtype, hq=4, hkv=2, head_size=32, block_size=4,
                seq_lens=(70, 33, 17, 48), seed=int(q_scale))
    case.q.mul_(q_scale)
    for cfg in (AttentionConfig(block_q=8, heads_per_program=1, tile_n=16, lazy_rescale=True),
                AttentionConfig(block_q=4, heads_per_program=2, tile_n=16, num_splits=3,
                                lazy_rescale=True)):
        case.check(config=cfg)
        case.check(config=cfg, sliding_window=29)
        case.check(config=cfg, softcap=5.0)  # softcapped scores: the eager path


def test_lazy_rescale_keeps_float16_probabilities_finite(device: str) -> None:
    """A stale row max is kept only while the scores stay within 2**8 of it: P rounded to
    float16 (max 65504 = 2**16) stays finite. Large scores whose tile maxima jump by 16..100
    (base 2) would overflow P to inf under a looser bound."""
    case = Case(device, dtype="float16", hq=2, hkv=1, head_size=32, block_size=4,
                seq_lens=(70,), q_lens=(70,), seed=15)
    case.q.mul_(12.0)
    case.check(config=AttentionConfig(block_q=8, heads_per_program=1, tile_n=16,
                                      lazy_rescale=True))


def test_config_override(device: str) -> None:
    """_set_config_override: a dict of fields applied to the default, or a function of the default
    and the shapes; None restores the default. Results equal passing ``config=`` explicitly."""
    case = Case(device, seq_lens=(1100, 5), head_size=16, block_size=32, hq=2, hkv=1)
    forced = AttentionConfig(block_q=1, heads_per_program=1, tile_n=32, num_splits=3,
                             fused_merge=True)
    seen = []

    def pick(default: AttentionConfig, **shapes: Any) -> AttentionConfig:
        seen.append((default, shapes))
        return forced
    try:
        A._set_config_override(pick)
        got = case.run()
        assert seen and seen[0][1]["num_seqs"] == 2 and seen[0][1]["varlen"] is False
        assert torch.equal(got, case.run(config=forced))
        A._set_config_override({"fused_merge": True, "range_stages": 2})
        default = seen[0][0]
        assert default.num_splits > 1
        assert torch.equal(case.run(), case.run(config=attrs.evolve(default, fused_merge=True,
                                                                    range_stages=2)))
        with pytest.raises(TypeError):
            A._set_config_override({"no_such_field": 1})
        with pytest.raises(FkvError, match="override"):
            A._set_config_override(3)
    finally:
        A._set_config_override(None)
    assert A._CONFIG_OVERRIDE is None
    case.check()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_fp8_cache(device: str, dtype: str, mode: str) -> None:
    q_lens = None if mode == "decode" else (1, 7, 2, 4)
    Case(device, dtype=dtype, q_lens=q_lens, layout="HND").check()


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_fp8_cache_other_query_dtypes(device: str, q_dtype: torch.dtype) -> None:
    Case(device, dtype="float8_e4m3fn", q_dtype=q_dtype, q_lens=(1, 7, 2, 4)).check()


def test_fp8_scales_as_floats_and_write_kv_round_trip(device: str) -> None:
    """Written by fkv.ops.reference.write_kv with scales, read back with the same scales: the
    attention matches attention over the unquantized values within fp8 precision."""
    g = torch.Generator().manual_seed(5)
    spec = KVCacheSpec(layout="HND", num_blocks=6, block_size=4, num_kv_heads=2, head_size=32,
                       dtype="float8_e4m3fn")
    dense = spec.evolve(dtype="bfloat16")
    (c8,), (c16,) = fkv.allocate(spec, device=device), fkv.allocate(dense, device=device)
    k = (torch.randn(20, 2, 32, generator=g) * 3).to(torch.bfloat16).to(device)
    v = (torch.randn(20, 2, 32, generator=g) * 3).to(torch.bfloat16).to(device)
    slots = torch.arange(20, device=device)
    ks, vs = torch.tensor([0.05], device=device), torch.tensor([0.02], device=device)
    R.write_kv(k, v, c8, slots, spec, k_scale=ks, v_scale=vs)
    R.write_kv(k, v, c16, slots, dense)
    bt = torch.tensor([[4, 3, 2, 1, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([17], dtype=torch.int32, device=device)
    q = torch.randn(1, 4, 32, generator=g).to(torch.bfloat16).to(device)
    got = paged_attention(q, c8, spec, bt, lens, k_scale=0.05, v_scale=0.02).double().cpu()
    # Exact convention: the same attention over the dequantized values (stored * scale).
    deq = spec.evolve(dtype="float32")
    (c32,) = fkv.allocate(deq, device=device)
    c32[:, 0] = c8[:, 0].float() * 0.05          # triton logical (NB, 2, N, H, D): K then V
    c32[:, 1] = c8[:, 1].float() * 0.02
    want = RA.attend(q.float(), c32, deq, bt, lens, acc_dtype=torch.float64).cpu()
    assert torch.allclose(got, want, atol=3e-2, rtol=2e-2)
    # And close to attention over the unquantized values (fp8 keeps ~2 significant digits).
    exact = RA.attend(q, c16, dense, bt, lens, acc_dtype=torch.float64).cpu()
    assert (got - exact).norm() / exact.norm() < 0.1


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_float_dtypes(device: str, dtype: str) -> None:
    Case(device, dtype=dtype, q_lens=(1, 7, 2, 4), layout="HND").check()
    Case(device, dtype=dtype).check()


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_head_sizes(device: str, head_size: int) -> None:
    Case(device, head_size=head_size, hq=2, hkv=1, seq_lens=(9, 3), q_lens=(3, 1),
         seed=head_size).check()


@pytest.mark.parametrize("cross", [False, True])
def test_mla_is_mqa_over_the_latent(device: str, cross: bool) -> None:
    """MLA: every query head attends to the one latent row per token, which is key and value."""
    case = Case(device, backend="mla", cross_layer=cross, hq=4, head_size=40, q_lens=(1, 7, 2, 4))
    case.check(scale=0.1)
    # The value part equals softmax(q . latent) @ latent[:, :d_v] computed by hand for one token.
    got = case.run(scale=0.1)
    lat = case.cache[case.block_table[0, 0].item(), 0].double()          # sequence 0: one token
    assert torch.allclose(got[0].double(), lat.expand(4, -1), atol=2e-2, rtol=2e-2)


def _cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """FlashMLA's accuracy measure: ``1 - 2 sum(xy) / sum(x^2 + y^2)`` (0 when equal)."""
    x, y = x.double(), y.double()
    return 1.0 - 2.0 * (x * y).sum().item() / max((x * x + y * y).sum().item(), 1e-12)


def _mla_decode(device: str, seq_lens: tuple[int, ...], hq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 MLA decode (DeepSeek geometry: latent 512 + rope 64, block 64, scale 576**-0.5) over
    randn values: the kernel's bf16 output and the fp32 reference's, value part ([..., :512])."""
    g = torch.Generator().manual_seed(seed)
    d, dv, n = 576, 512, 64
    need = [-(-s // n) for s in seq_lens]
    spec = KVCacheSpec(backend="mla", num_blocks=sum(need) + 3, block_size=n, num_kv_heads=1,
                       head_size=d)
    (cache,) = fkv.allocate(spec, device=device)
    cache.copy_(torch.randn(cache.shape, generator=g).bfloat16())
    perm = torch.randperm(spec.num_blocks, generator=g).tolist()
    table = torch.randint(-5, 1 << 20, (len(seq_lens), max(need) + 1), generator=g)
    for b, k in enumerate(need):
        table[b, :k] = torch.tensor(perm[:k])
        perm = perm[k:]
    bt = table.to(torch.int32).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), hq, d, generator=g).bfloat16().to(device)
    out = paged_attention(q, cache, spec, bt, lens, scale=d ** -0.5)
    ref = RA.attend(q, cache, spec, bt, lens, scale=d ** -0.5, acc_dtype=torch.float32)
    return out[..., :dv].cpu(), ref[..., :dv].cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("hq", [16, 128])
def test_mla_decode_bf16_meets_the_flashmla_bound(hq: int) -> None:
    """bf16 MLA decode on the GPU: cosine difference < 1e-5 against the fp32 reference, the
    bound FlashMLA's tests (and the engine) hold its kernels to."""
    g = torch.Generator().manual_seed(hq)
    lens = tuple(int(x) for x in torch.randint(1, 4097, (8,), generator=g))
    out, ref = _mla_decode("cuda", lens + (4096, 1), hq, seed=hq)
    assert _cos_diff(out, ref) < 1e-5


@pytest.mark.interpreter
def test_mla_decode_bf16_accuracy_in_the_interpreter() -> None:
    """The CPU twin of the FlashMLA bound. The interpreter's fp32 -> bf16 cast truncates instead
    of rounding to nearest (the kernel casts P before the PV product and casts the output): a
    truncation error is uniform in [0, ulp) instead of [-ulp/2, ulp/2), four times the mean
    squared error, so the cosine difference (a relative squared error) gets 4x the GPU's bound:
    < 4e-5 (measured 1.4e-5 here; rounding the same fp32 output to nearest alone gives 1.4e-6,
    truncating it 5.3e-6)."""
    out, ref = _mla_decode("cpu", (300, 257), 16, seed=0)
    diff = _cos_diff(out, ref)
    assert diff < 4e-5
    assert _cos_diff(ref.bfloat16(), ref) < 1e-5  # the GPU's rounding meets the bound


def test_noncontiguous_q_and_out(device: str) -> None:
    case = Case(device, q_lens=(1, 7, 2, 4))
    big = torch.randn(case.q.shape[0], case.q.shape[1] * 2, 48).to(case.q.dtype).to(device)
    big[:, ::2, 8:40] = case.q
    q = big[:, ::2, 8:40]
    out = torch.full((case.q.shape[0], 48, case.q.shape[1] * 3), float("nan"),
                     dtype=case.q.dtype, device=device).transpose(1, 2)[:, 1::3, :32]
    res = paged_attention(q, case.cache, case.spec, case.block_table, case.seq_lens,
                          query_start_loc=case.query_start_loc, out=out)
    assert res is out
    assert torch.allclose(out.double().cpu(), case.expected().cpu(), atol=2e-2, rtol=2e-2)


def test_noncontiguous_q_and_out_with_splits(device: str) -> None:
    """Strided head dims (q every other element, out transposed) through split launches: the
    partial outputs merged by the second kernel and in the same launch."""
    case = Case(device, q_lens=(1, 7, 2, 4), seq_lens=(1, 30, 13, 4), seed=18)
    big = torch.randn(*case.q.shape[:2], 64).to(case.q.dtype).to(device)
    big[:, :, ::2] = case.q
    q = big[:, :, ::2]
    want = case.expected().cpu()
    for fused in (False, True):
        out = torch.full((case.q.shape[0], 48, case.q.shape[1] * 3), float("nan"),
                         dtype=case.q.dtype, device=device).transpose(1, 2)[:, 1::3, :32]
        cfg = AttentionConfig(block_q=2, heads_per_program=2, tile_n=16, num_splits=2,
                              fused_merge=fused)
        paged_attention(q, case.cache, case.spec, case.block_table, case.seq_lens,
                        query_start_loc=case.query_start_loc, out=out, config=cfg)
        assert torch.allclose(out.double().cpu(), want, atol=2e-2, rtol=2e-2)


def test_reference_float32_matches_float64(device: str) -> None:
    case = Case(device, dtype="float32", q_lens=(1, 7, 2, 4))
    got = R.paged_attention(*case.args(), query_start_loc=case.query_start_loc, sliding_window=4)
    want = RA.attend(*case.args(), query_start_loc=case.query_start_loc, sliding_window=4,
                     acc_dtype=torch.float64)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    out = torch.full_like(case.q, float("nan"))
    assert R.paged_attention(*case.args(), query_start_loc=case.query_start_loc, out=out) is out
    assert not out.isnan().any()


def test_single_key_gives_its_value() -> None:
    """Independent oracle: a sequence of one token attends only to itself: output = its V row."""
    case = Case("cpu", dtype="float32", seq_lens=(1, 5), hq=4, hkv=2)
    ref = RA.attend(*case.args(), acc_dtype=torch.float64)
    blk = case.block_table[0, 0].item()
    v0 = case.cache[blk, 1, 0].double()                                 # [Hkv, D] at token 0
    assert torch.allclose(ref[0], v0.repeat_interleave(2, dim=0))


# -- the pure configuration --------------------------------------------------------------------

H200 = dict(num_q_heads=32, num_kv_heads=8, head_size=128, itemsize=2, num_sms=132)


@pytest.mark.parametrize(("batch", "ctx"), [(64, 8192), (256, 2048), (8, 32768), (16, 4096)])
def test_decode_config_fills_the_gpu(batch: int, ctx: int) -> None:
    from fkv.ops.attention import decode_residency

    cfg = attention_config(num_seqs=batch, num_q_tokens=batch, max_context=ctx, varlen=False, **H200)
    assert (cfg.block_q, cfg.heads_per_program) == (1, 4)   # all 4 query heads of a KV head
    programs = batch * 8 * cfg.num_splits
    resident = decode_residency(cfg.tile_n, cfg.num_warps, cfg.num_stages)[cfg.num_splits > 1]
    assert programs >= 0.9 * resident * 132                # fills the resident slots
    assert ctx / cfg.num_splits >= 512                     # each split streams >= 512 keys


# H200 sweep winners (issue 14, Triton 3.6, padded tables): grids of >= 132 programs before
# splitting take 64-key tiles on 2 warps, 3 stages, unsplit (round 2); smaller grids 128-key
# tiles on 4 warps, 5 stages (double-buffered K/V), split to one program per SM (round 4).
DECODE_WINNERS = {(64, 8192): (64, 2, 3, 1), (256, 2048): (64, 2, 3, 1),
                  (8, 32768): (128, 4, 5, 2), (16, 4096): (128, 4, 5, 1)}



def test_the_small_grid_tile_stops_at_one_program_per_sm() -> None:
    """DECODE_WINNERS' rule at its bound: 131 programs before splitting (one query head group
    per sequence, 132 SMs) take the small-grid tile, 132 programs the 64-key one."""
    tiles = [attention_config(num_seqs=b, num_q_tokens=b, num_q_heads=4, num_kv_heads=1,
                              head_size=128, max_context=8192, itemsize=2, num_sms=132,
                              varlen=False) for b in (131, 132)]
    assert [(c.tile_n, c.num_warps, c.num_stages) for c in tiles] == [(128, 4, 5), (64, 2, 3)]

@pytest.mark.parametrize(("batch", "ctx"), list(DECODE_WINNERS))
def test_decode_config_ignores_padding_columns(batch: int, ctx: int) -> None:
    """Engines allocate block tables with spare columns: the configuration (split count, hence
    the grid) is the same with 0 to 7 spare columns of 16 tokens (issue: one spare column took
    B=8 x 32768 from 16 splits to 18 ragged ones, 3990 -> 3472 GB/s)."""
    base = attention_config(num_seqs=batch, num_q_tokens=batch, max_context=ctx, varlen=False,
                            **H200)
    assert (base.tile_n, base.num_warps, base.num_stages, base.num_splits) == \
        DECODE_WINNERS[(batch, ctx)]
    for spare in range(1, 8):
        assert attention_config(num_seqs=batch, num_q_tokens=batch, max_context=ctx + 16 * spare,
                                varlen=False, **H200) == base



def test_no_decode_config_depends_on_padding_columns() -> None:
    """Across batch sizes 1..256 and contexts 1K..128K, 1 to 7 spare columns of 16 tokens never
    change the configuration (without the context rounding 112 of these 504 cases would)."""
    for batch, ctx in itertools.product((1, 2, 4, 8, 16, 32, 64, 128, 256),
                                        (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)):
        base = attention_config(num_seqs=batch, num_q_tokens=batch, max_context=ctx,
                                varlen=False, **H200)
        for spare in range(1, 8):
            assert attention_config(num_seqs=batch, num_q_tokens=batch,
                                    max_context=ctx + 16 * spare, varlen=False,
                                    **H200) == base, (batch, ctx, spare)

# H200 sweeps (issue 14, Triton 3.6): decode ms by split count for the default tile of each
# shape (mean of NHD and HND; padded block tables): (64, 2, 3) for B=64 and 256 (round 2),
# (128, 4, 5) for B=8 and 16 (round 4, bench/results/kernels-sweep-20261201T052909Z.json). The
# split model must pick a count within 2 % of the fastest and rank a clearly slow count (>= 10 %
# slower) behind its choice.
SWEEP_SPLIT_MS = {
    (64, 8192): {1: 0.486, 2: 0.494, 3: 0.497, 4: 0.501},
    (256, 2048): {1: 0.485, 2: 0.510, 3: 0.537, 4: 0.545},
    (8, 32768): {2: 0.2548, 4: 0.2629, 8: 0.2725},
    (16, 4096): {1: 0.0787, 2: 0.0892, 4: 0.1009},
}


@pytest.mark.parametrize(("batch", "ctx"), list(SWEEP_SPLIT_MS))
def test_split_model_follows_the_h200_sweep(batch: int, ctx: int) -> None:
    from fkv.ops.attention import _split_cost, decode_residency

    measured = SWEEP_SPLIT_MS[(batch, ctx)]
    cfg = attention_config(num_seqs=batch, num_q_tokens=batch, max_context=ctx + 16, varlen=False,
                           **H200)
    assert measured[cfg.num_splits] <= 1.02 * min(measured.values())
    resident = decode_residency(cfg.tile_n, cfg.num_warps, cfg.num_stages)
    chosen = _split_cost(cfg.num_splits, batch * 8, ctx, cfg.tile_n, 132, resident)
    for n, ms in measured.items():
        if ms >= 1.10 * measured[cfg.num_splits]:
            assert _split_cost(n, batch * 8, ctx, cfg.tile_n, 132, resident) > chosen, n


class GridRecorder:
    """Stands in for the attention kernel: records each launch's grid and num_splits, then runs
    the real kernel."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.launches = kernel, []
        self.arg_names, self.params = kernel.arg_names, getattr(kernel, "params", ())

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches.append((tuple(grid), args[self.arg_names.index("num_splits")]))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_repeated_launches_skip_the_binder_with_the_same_bits(device: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention kernel launches through ``fkv.ops._launch``: the first call of a shape
    compiles through Triton's binder, the next ones (new block tables, lengths and queries of the
    same shapes) call the compiled variant directly on the GPU (the interpreter always launches
    normally); every output equals a normal launch's bits (``FKV_FAST_LAUNCH`` off)."""
    monkeypatch.setattr(A, "_SITES", {})
    case = Case(device, seq_lens=(70, 33, 17), head_size=16, block_size=4, hq=4, hkv=2, seed=5)
    outs = []
    for _ in range(3):
        out = torch.full_like(case.q, float("nan"))
        paged_attention(case.q, case.cache, case.spec, case.block_table, case.seq_lens, out=out)
        outs.append(out)
    (site,) = A._SITES.values()
    assert site.direct_launches == (2 if device == "cuda" else 0)
    monkeypatch.setattr(importlib.import_module("fkv.ops._launch"), "ENABLED", False)
    normal = torch.full_like(case.q, float("nan"))
    paged_attention(case.q, case.cache, case.spec, case.block_table, case.seq_lens, out=normal)
    assert all(torch.equal(o, normal) for o in outs)
    case.check()


def test_a_launch_site_never_serves_other_dtypes(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two specs and inputs equal in every fixed argument but their dtypes (bf16 and fp16 caches
    and queries; an int32 and an int64 block table): each call gets a site of its own, so the
    direct launch never runs a variant compiled for other pointer types, and each output is the
    reference's."""
    monkeypatch.setattr(A, "_SITES", {})
    for dtype, table_dtype in (("bfloat16", torch.int32), ("float16", torch.int32),
                               ("bfloat16", torch.int64), ("bfloat16", torch.int32)):
        case = Case(device, dtype=dtype, seq_lens=(9, 5), head_size=16, block_size=4, hq=4,
                    hkv=2, seed=2)
        case.block_table = case.block_table.to(table_dtype)
        for _ in range(2):  # the second call of each takes the direct launch on the GPU
            case.check()
    assert len(A._SITES) == 3


def test_launch_options_get_their_own_site_and_splits_stop_at_the_tiles(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs that differ only in ``num_warps`` or ``num_stages`` launch from sites of their
    own (a site launches with its options); a forced split count above the block table's tiles
    of capacity launches one split per tile (16 tokens of capacity, tile_n=16: one)."""
    K = importlib.import_module("fkv.ops._attention_kernels")
    recorder = GridRecorder(K._paged_attention_kernel)
    monkeypatch.setattr(K, "_paged_attention_kernel", recorder)
    monkeypatch.setattr(A, "_SITES", {})
    case = Case(device, seq_lens=(9, 5), head_size=16, block_size=4, hq=4, hkv=2, seed=2)
    assert case.block_table.shape[1] * 4 == 16
    base = dict(block_q=1, heads_per_program=2, tile_n=16)
    for extra in ({}, {"num_warps": 2}, {"num_stages": 3}, {"num_splits": 5}):
        case.check(config=AttentionConfig(**base, **extra))
    options = sorted((s.options["num_warps"], s.options["num_stages"]) for s in A._SITES.values())
    assert options == [(2, 2), (4, 2), (4, 3)]
    assert [(grid[1], splits) for grid, splits in recorder.launches] == [(1, 1)] * 4


def test_padding_columns_change_neither_grid_nor_bits(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sequences with 0, 1 and 5 spare block-table columns (garbage in them): the same
    grid and split count are launched and the outputs are bit-identical, because each split is
    cut from the sequence's real length, not from the table's capacity."""
    K = importlib.import_module("fkv.ops._attention_kernels")
    recorder = GridRecorder(K._paged_attention_kernel)
    monkeypatch.setattr(K, "_paged_attention_kernel", recorder)
    case = Case(device, seq_lens=(1100, 1030), head_size=16, block_size=32, hq=2, hkv=1, seed=3)
    need = -(-1100 // 32)
    outs = []
    for spare in (0, 1, 5):
        table = torch.randint(-5, 1 << 20, (2, need + spare), dtype=torch.int32).to(device)
        table[:, :need] = case.block_table[:, :need]
        out = torch.full_like(case.q, float("nan"))
        paged_attention(case.q, case.cache, case.spec, table, case.seq_lens, out=out)
        outs.append(out)
    grids = {g for g, _ in recorder.launches}
    assert len(recorder.launches) == 3 and len(grids) == 1, recorder.launches
    assert recorder.launches[0][1] > 1  # flash-decoding splits ran
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    case.check()


def test_splits_follow_the_real_length_under_heavy_padding(device: str) -> None:
    """A forced split count over a block table 4x longer than the sequences (an engine's fixed
    max_model_len table): every split still gets keys, and the result is the reference's."""
    case = Case(device, seq_lens=(70, 33, 17), head_size=16, block_size=4, hq=4, hkv=2, seed=5)
    need = case.block_table.shape[1]
    table = torch.randint(-5, 1 << 20, (3, 4 * need), dtype=torch.int32).to(device)
    table[:, :need] = case.block_table
    case.block_table = table
    for splits in (2, 3, 5):
        case.check(config=AttentionConfig(block_q=1, heads_per_program=2, tile_n=16,
                                          num_splits=splits))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_zero_softcap_and_window_mean_off(device: str, mode: str) -> None:
    """Engines pass softcap=0 and sliding_window=0 for "off": bit-identical to None, kernel and
    reference."""
    q_lens = None if mode == "decode" else (9, 33, 2, 20)
    case = Case(device, q_lens=q_lens, layout="HND", seed=4, **LONG)
    off = case.run()
    assert torch.equal(case.run(softcap=0, sliding_window=0), off)
    assert torch.equal(case.run(softcap=0.0, sliding_window=None), off)
    assert torch.equal(case.run(softcap=None, sliding_window=0), off)
    ref = R.paged_attention(*case.args(), query_start_loc=case.query_start_loc)
    assert torch.equal(R.paged_attention(*case.args(), query_start_loc=case.query_start_loc,
                                         softcap=0, sliding_window=0), ref)
    # and 0 is really "off", not a window of zero keys or a zero cap: the reference agrees
    case.check(softcap=0, sliding_window=0)
    assert not torch.equal(case.run(softcap=0, sliding_window=5), off)


def test_prefill_config() -> None:
    cfg = attention_config(num_seqs=4, num_q_tokens=4 * 4096, max_context=4096, varlen=True, **H200)
    assert (cfg.block_q, cfg.heads_per_program, cfg.num_splits) == (64, 4, 1)
    assert (cfg.tile_n, cfg.num_warps, cfg.num_stages) == (64, 8, 5)        # 256 rows: 8 warps
    mid = attention_config(num_seqs=4, num_q_tokens=4 * 20, max_context=4096, varlen=True, **H200)
    assert (mid.block_q * mid.heads_per_program, mid.num_warps) == (128, 4)  # 128 rows: 4 warps
    assert not cfg.lazy_rescale and not cfg.range_stages  # round 4: both lost or tied


def test_default_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """_FUSED_MERGE and _LAZY_RESCALE turn the knobs on where they apply (split launches; tiles
    of more than 16 rows)."""
    monkeypatch.setattr(A, "_FUSED_MERGE", True)
    monkeypatch.setattr(A, "_LAZY_RESCALE", True)
    A.attention_config.cache_clear()
    try:
        small = attention_config(num_seqs=8, num_q_tokens=8, max_context=32768, varlen=False,
                                 **H200)
        big = attention_config(num_seqs=64, num_q_tokens=64, max_context=8192, varlen=False,
                               **H200)
        pre = attention_config(num_seqs=4, num_q_tokens=4 * 4096, max_context=4096, varlen=True,
                               **H200)
        assert small.num_splits > 1 and small.fused_merge and not small.lazy_rescale
        assert big.num_splits == 1 and not big.fused_merge
        assert pre.lazy_rescale and not pre.fused_merge
    finally:
        A.attention_config.cache_clear()


def test_config_validation() -> None:
    with pytest.raises(FkvError, match=r"'tile_n' must be a power of two >= 16 \(got 48\)"):
        AttentionConfig(block_q=1, heads_per_program=1, tile_n=48)
    with pytest.raises(ValueError):
        AttentionConfig(block_q=1, heads_per_program=1, tile_n=16, range_stages=-1)
    with pytest.raises(TypeError):
        AttentionConfig(block_q=1, heads_per_program=1, tile_n=16, fused_merge=1)
    cfg = attention_config(num_seqs=16, num_q_tokens=16, max_context=4096, varlen=False,
                           num_q_heads=32, num_kv_heads=8, head_size=128, itemsize=2, num_sms=132)
    assert (cfg.fused_merge, cfg.range_stages) == (False, 0)  # defaults unchanged until measured
    case = Case("cpu")
    with pytest.raises(FkvError, match=r"'config' must be an AttentionConfig or None"):
        paged_attention(*case.args(), config={"tile_n": 16})


# -- bad inputs: FkvError before anything launches -----------------------------------------------

def _bad(case: Case, **changes: Any) -> dict[str, Any]:
    kw = dict(q=case.q, cache=case.cache, spec=case.spec, block_table=case.block_table,
              seq_lens=case.seq_lens, query_start_loc=case.query_start_loc, **case.kw)
    kw.update(changes)
    return kw


def _call(fn: Any, kw: dict[str, Any]) -> Any:
    kw = dict(kw)
    args = [kw.pop(k) for k in ("q", "cache", "spec", "block_table", "seq_lens")]
    return fn(*args, **kw)


def _bt(case: Case, b: int, j: int, value: int) -> torch.Tensor:
    t = case.block_table.clone()
    t[b, j] = value
    return t


BAD = {
    "hq-not-multiple": (lambda c: _bad(c, q=torch.randn(4, 3, 32).bfloat16()),
                        r"'q' has 3 query heads, which must be a positive multiple of the cache's 2 KV heads"),
    "q-rank": (lambda c: _bad(c, q=torch.randn(4, 64).bfloat16()),
               r"'q' must have shape \[total_q_tokens, Hq, 32\]"),
    "q-head-size": (lambda c: _bad(c, q=torch.randn(4, 4, 16).bfloat16()),
                    r"'q' must have shape \[total_q_tokens, Hq, 32\].*\(got \(4, 4, 16\)\)"),
    "q-dtype": (lambda c: _bad(c, q=c.q.half()),
                r"'q.dtype' is torch.float16 but the cache holds 'bfloat16'"),
    "q-int": (lambda c: _bad(c, q=c.q.to(torch.int32)), r"'q.dtype' must be torch.bfloat16, "),
    "cache-layout": (lambda c: _bad(c, spec=c.spec.evolve(layout="HND")),
                     r"'cache' has strides .* the tensor's real layout differs"),
    "block-table-dtype": (lambda c: _bad(c, block_table=c.block_table.float()),
                          r"'block_table.dtype' must be torch.int32 or torch.int64"),
    "block-table-rows": (lambda c: _bad(c, block_table=c.block_table[:3]),
                         r"'seq_lens' has 4 entries but 'block_table' has 3 rows"),
    "block-id-beyond-cache": (lambda c: _bad(c, block_table=_bt(c, 2, 1, 10_000)),
                              r"'block_table\[2, 1\]' is 10000, outside the cache's \[0, 11\) blocks"),
    "block-table-no-columns": (lambda c: _bad(c, block_table=c.block_table[:, :0]),
                               r"'block_table' must have at least one column \(got shape \(4, 0\)\)"),
    "block-id-num-blocks": (lambda c: _bad(c, block_table=_bt(c, 2, 3, 11)),
                            r"'block_table\[2, 3\]' is 11, outside the cache's \[0, 11\) blocks"),
    "block-id-negative": (lambda c: _bad(c, block_table=_bt(c, 1, 0, -1)),
                          r"'block_table\[1, 0\]' is -1, outside"),
    "seq-len-beyond-table": (lambda c: _bad(c, seq_lens=torch.tensor([1, 7, 21, 4], dtype=torch.int32)),
                             r"'seq_lens\[2\]' is 21 tokens but the block table holds 5 blocks of 4 = 20"),
    "seq-len-negative": (lambda c: _bad(c, seq_lens=torch.tensor([1, -7, 2, 4], dtype=torch.int32)),
                         r"'seq_lens\[1\]' must be a non-negative token count \(got -7\)"),
    "decode-empty-seq": (lambda c: _bad(c, seq_lens=torch.tensor([1, 0, 2, 4], dtype=torch.int32)),
                         r"'seq_lens\[1\]' must be >= 1 in decode"),
    "decode-token-count": (lambda c: _bad(c, q=c.q[:3]),
                           r"decode \(query_start_loc=None\) takes one query per sequence: 'q' has 3"),
    "fp8-no-scale": (lambda c: _bad(c, spec=c.spec.evolve(dtype="float8_e4m3fn"),
                                    cache=c.cache.to(torch.float8_e4m3fn)),
                     r"'k_scale' is required for an fp8 cache"),
    "fp8-empty-scale": (lambda c: _bad(c, spec=c.spec.evolve(dtype="float8_e4m3fn"),
                                       cache=c.cache.to(torch.float8_e4m3fn),
                                       k_scale=torch.ones(0), v_scale=torch.ones(1)),
                        r"'k_scale' must be a float or a float32 tensor of one element \(got "
                        r"'tensor \(0,\) torch.float32'\)"),
    "scale-on-bf16": (lambda c: _bad(c, k_scale=torch.ones(1)),
                      r"'k_scale'/'v_scale' apply only to fp8 caches"),
    "window": (lambda c: _bad(c, sliding_window=-1),
               r"'sliding_window' must be a positive int, or 0 / None for no window \(got -1\)"),
    "window-float": (lambda c: _bad(c, sliding_window=4.0), r"'sliding_window' must be a positive int"),
    "softcap": (lambda c: _bad(c, softcap=-1.0),
                r"'softcap' must be a positive finite float, or 0 / None for no softcap \(got -1.0\)"),
    "softcap-inf": (lambda c: _bad(c, softcap=math.inf), r"'softcap' must be a positive finite float"),
    "scale": (lambda c: _bad(c, scale=math.inf), r"'scale' must be a positive finite float"),
    "out-shape": (lambda c: _bad(c, out=torch.empty(4, 4, 16, dtype=torch.bfloat16)),
                  r"'out' must be a tensor of q's shape \(4, 4, 32\) and dtype torch.bfloat16"),
    "out-dtype": (lambda c: _bad(c, out=torch.empty(4, 4, 32)),
                  r"'out' must be a tensor of q's shape \(4, 4, 32\) and dtype torch.bfloat16 "
                  r"\(got '\(4, 4, 32\) torch.float32'\)"),
    "seq-lens-2d": (lambda c: _bad(c, seq_lens=c.seq_lens[None]), r"'seq_lens' must have 1 dim"),
}

BAD_VARLEN = {
    "qsl-length": (lambda c: _bad(c, query_start_loc=c.query_start_loc[:-1]),
                   r"'query_start_loc' must have num_seqs \+ 1 = 5 cumulative offsets \(got 4\)"),
    "qsl-too-long": (lambda c: _bad(c, query_start_loc=torch.tensor([0, 1, 4, 5, 9, 9],
                                                                   dtype=torch.int32)),
                     r"'query_start_loc' must have num_seqs \+ 1 = 5 cumulative offsets \(got 6\)"),
    "qsl-start": (lambda c: _bad(c, query_start_loc=torch.tensor([1, 2, 5, 6, 9], dtype=torch.int32)),
                  r"'query_start_loc' must run from 0 to total_q_tokens=9 \(got 1 ... 9\)"),
    "qsl-end": (lambda c: _bad(c, query_start_loc=torch.tensor([0, 1, 2, 3, 5], dtype=torch.int32)),
                r"'query_start_loc' must run from 0 to total_q_tokens=9 \(got 0 ... 5\)"),
    "qsl-decreasing": (lambda c: _bad(c, query_start_loc=torch.tensor([0, 3, 2, 5, 9], dtype=torch.int32)),
                       r"'query_start_loc' decreases at sequence 1 \(3 -> 2\)"),
    "more-queries-than-tokens": (lambda c: _bad(c, query_start_loc=torch.tensor([0, 2, 3, 4, 9],
                                                                                dtype=torch.int32)),
                                 r"sequence 0 has 2 queries but 'seq_lens\[0\]' is 1"),
    "qsl-float": (lambda c: _bad(c, query_start_loc=c.query_start_loc.float()),
                  r"'query_start_loc.dtype' must be torch.int32 or torch.int64"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("fn", [paged_attention, R.paged_attention], ids=["kernel", "reference"])
def test_bad_inputs_decode(name: str, fn: Any) -> None:
    case = Case("cpu")
    make, match = BAD[name]
    out = torch.full_like(case.q, float("nan"))
    kw = make(case)
    kw.setdefault("out", out)
    with pytest.raises(FkvError, match=match):
        _call(fn, kw)
    assert out.isnan().all(), "nothing may be written before the error"


@pytest.mark.parametrize("name", list(BAD_VARLEN))
@pytest.mark.parametrize("fn", [paged_attention, R.paged_attention], ids=["kernel", "reference"])
def test_bad_inputs_varlen(name: str, fn: Any) -> None:
    case = Case("cpu", q_lens=(1, 3, 1, 4))
    make, match = BAD_VARLEN[name]
    with pytest.raises(FkvError, match=match):
        _call(fn, make(case))


def test_unused_block_table_entries_are_not_checked_nor_read(device: str) -> None:
    """Entries past ceil(seq_len / block_size) may hold anything (engines leave garbage there)."""
    case = Case(device)
    case.block_table[:, -1] = -7
    case.block_table[0, 1:] = 1 << 30
    case.check()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_unvalidated_bad_values_stay_in_bounds(device: str, mode: str) -> None:
    """validate=False (the CUDA default): a bad block id, a seq_len beyond the block table and
    query offsets beyond q neither fault nor write outside out; the other sequences are exact."""
    q_lens = None if mode == "decode" else (1, 3, 1, 4)
    case = Case(device, q_lens=q_lens, seed=11)
    want = case.expected().cpu()
    bt, lens = case.block_table.clone(), case.seq_lens.clone()
    bt[0, 0] = 1 << 20                                   # sequence 0: an id far outside the cache
    lens[1] = bt.shape[1] * case.spec.block_size + 50    # sequence 1: beyond the table's capacity
    qsl = case.query_start_loc
    if qsl is not None:
        qsl = qsl.clone()
        qsl[-1] = qsl[-1] + 40                           # sequence 3: queries beyond q
    total = case.q.shape[0]
    big = torch.full((total + 40, *case.q.shape[1:]), float("nan"), dtype=case.q.dtype,
                     device=device)
    out = big[:total]
    paged_attention(case.q, case.cache, case.spec, bt, lens, query_start_loc=qsl, out=out,
                    validate=False)
    got = big.double().cpu()
    assert got[total:].isnan().all(), "written outside out"
    rows = [2] if qsl is not None else [2, 3]            # untouched sequences
    for b in rows:
        lo, hi = (b, b + 1) if qsl is None else (int(qsl[b]), int(qsl[b + 1]))
        assert torch.allclose(got[lo:hi], want[lo:hi], atol=2e-2, rtol=2e-2)
    assert torch.isfinite(got[:total]).all()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_unvalidated_ids_at_the_cache_edges_read_block_0(device: str, mode: str) -> None:
    """validate=False: a block id of num_blocks (one past the end) or -1 reads block 0, not the
    memory beside the cache (NaN here): the bad sequences' results stay finite, the others are
    exact."""
    q_lens = None if mode == "decode" else (1, 3, 1, 4)
    case = Case(device, q_lens=q_lens, seed=19)
    want = case.expected().cpu()
    nb = case.spec.num_blocks
    big = torch.full((nb + 2, *case.cache.shape[1:]), float("nan"), dtype=case.cache.dtype,
                     device=device)
    big[1:nb + 1] = case.cache
    cache = big[1:nb + 1]
    bt = case.block_table.clone()
    bt[1, 0] = nb
    bt[2, 1] = -1
    out = torch.full_like(case.q, float("nan"))
    paged_attention(case.q, cache, case.spec, bt, case.seq_lens,
                    query_start_loc=case.query_start_loc, out=out, validate=False)
    got = out.double().cpu()
    assert not got.isnan().any()
    rows = [0, 3] if q_lens is None else [0, *range(5, 9)]  # sequences 0 and 3
    assert torch.allclose(got[rows], want[rows], atol=2e-2, rtol=2e-2)


def test_empty_batch() -> None:
    case = Case("cpu")
    bt, lens = case.block_table[:0], case.seq_lens[:0]
    out = paged_attention(case.q[:0], case.cache, case.spec, bt, lens)
    assert out.shape == (0, 4, 32)
    qsl = torch.zeros(1, dtype=torch.int32)
    assert R.paged_attention(case.q[:0], case.cache, case.spec, bt, lens,
                             query_start_loc=qsl).shape == (0, 4, 32)


def _spaced(t: torch.Tensor, fill: int = 99) -> torch.Tensor:
    """The values of 1-D ``t`` as a view with stride 2 (``fill`` in between)."""
    return torch.stack([t, torch.full_like(t, fill)], 1).reshape(-1)[::2]


def _strided_table(t: torch.Tensor, how: str) -> torch.Tensor:
    """The values of block table ``t`` as a view whose columns are not one element apart."""
    if how == "transposed":
        return t.t().contiguous().t()
    wide = torch.full((t.shape[0], 2 * t.shape[1]), 1 << 20, dtype=t.dtype, device=t.device)
    wide[:, ::2] = t
    return wide[:, ::2]


STRIDED = {
    "seq-lens-step-2": lambda c: {"seq_lens": _spaced(c.seq_lens)},
    # one element expanded (stride 0) from a storage whose next elements differ
    "seq-lens-expanded": lambda c: {"seq_lens": _spaced(c.seq_lens, 1)[:1].expand(
        c.seq_lens.shape[0])},
    "block-table-transposed": lambda c: {"block_table": _strided_table(c.block_table,
                                                                       "transposed")},
    "block-table-columns-step-2": lambda c: {"block_table": _strided_table(c.block_table, "step")},
    "qsl-step-2": lambda c: {"query_start_loc": _spaced(c.query_start_loc)},
}


@pytest.mark.parametrize("name", list(STRIDED))
def test_strided_index_tensors_read_their_values(device: str, name: str) -> None:
    """seq_lens, query_start_loc and block tables of any strides (a step, a transpose, an
    expanded one-element tensor) give the contiguous tensors' bytes and the reference's values,
    also after a call with contiguous ones of the same shapes."""
    lens = (6, 6, 6, 6) if name == "seq-lens-expanded" else (6, 9, 3, 13)
    case = Case(device, dtype="float32", seq_lens=lens,
                q_lens=(6, 4, 0, 1) if name.startswith("qsl") else None)
    plain = dict(block_table=case.block_table, seq_lens=case.seq_lens,
                 query_start_loc=case.query_start_loc)
    strided = {**plain, **STRIDED[name](case)}
    changed = next(k for k in strided if strided[k] is not plain[k])
    assert not strided[changed].is_contiguous()
    assert torch.equal(strided[changed], plain[changed])
    want = paged_attention(case.q, case.cache, case.spec, **plain).cpu()
    got = paged_attention(case.q, case.cache, case.spec, **strided).cpu()
    assert torch.equal(got, want)
    ref = R.paged_attention(case.q, case.cache, case.spec, **plain).cpu()
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [math.nan, 0.0, -1.0, math.inf])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_fp8_scales_must_be_finite_and_positive(which: str, value: float) -> None:
    """A NaN, zero, negative or infinite scale would dequantize to NaN, inf or flipped signs:
    refused as a float always, as a tensor when validating (the CPU default; the reference
    always validates)."""
    case = Case("cpu", dtype="float8_e4m3fn")
    message = f"'{which}' must be a finite scale > 0 (got {value!r})"
    out = torch.full_like(case.q, float("nan"))
    for fn in (paged_attention, R.paged_attention):
        with pytest.raises(FkvError) as e:
            fn(*case.args(), **{**case.kw, which: value}, out=out)
        assert str(e.value) == message
    for fn in (paged_attention, R.paged_attention):
        with pytest.raises(FkvError) as e:
            fn(*case.args(), **{**case.kw, which: torch.tensor([value])}, out=out)
        assert str(e.value) == message
    assert out.isnan().all(), "nothing may be written before the error"


@pytest.mark.parametrize("validate", ["no", 0, 1.0])
def test_validate_must_be_a_bool_or_none(validate: Any) -> None:
    case = Case("cpu")
    with pytest.raises(FkvError) as e:
        paged_attention(*case.args(), validate=validate)
    assert str(e.value) == (f"'validate' must be True, False or None (None: the default) "
                            f"(got {validate!r})")


# -- GPU: the benchmark's shapes, scaled down, with the default configuration ---------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gpu_default_configs(layout: str, mode: str) -> None:
    q_lens = None if mode == "decode" else (300, 1, 77)
    case = Case("cuda", layout=layout, hq=32, hkv=8, head_size=128, block_size=16,
                seq_lens=(1500, 700, 2100), q_lens=q_lens)
    case.check()
    case.check(sliding_window=256, softcap=30.0)


@pytest.mark.gpu
def test_gpu_fused_merge_in_a_cuda_graph() -> None:
    """A fused merge captured after its counters exist on the capture stream replays correctly
    (counters reset by the kernel between replays); captured on a fresh stream it falls back to
    the second kernel (no allocation during capture) and is correct too."""
    case = Case("cuda", hq=32, hkv=8, head_size=128, block_size=16, seq_lens=(900, 40, 2000))
    cfg = AttentionConfig(block_q=1, heads_per_program=4, tile_n=64, num_splits=4, fused_merge=True)
    want = case.expected().cpu()
    for warm in (True, False):
        A._MERGE_COUNTERS.clear()
        out = torch.empty_like(case.q)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if warm:
                paged_attention(*case.args(), out=out, config=cfg)
            else:
                paged_attention(*case.args(), out=out, config=attrs.evolve(cfg, num_splits=1))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            paged_attention(*case.args(), out=out, config=cfg)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.allclose(out.double().cpu(), want, atol=2e-2, rtol=2e-2)
        assert _merge_counters_zero()


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay() -> None:
    """Value checks are skipped while capturing (they need a sync); the replay recomputes."""
    case = Case("cuda", hq=32, hkv=8, head_size=128, block_size=16, seq_lens=(900, 40, 2000))
    out = torch.empty_like(case.q)
    paged_attention(*case.args(), out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*case.args(), out=out)
    out.fill_(float("nan"))
    case.q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = case.expected().cpu()
    assert torch.allclose(out.double().cpu(), want, atol=2e-2, rtol=2e-2)


# -- the warp-specialized Gluon prefill tile (fkv.ops._attention_gluon) --------------------------

G = importlib.import_module("fkv.ops._attention_gluon")

#: the 256-row prefill tile as attention_config picks it on the H200, on the Triton kernel
TILE_256 = AttentionConfig(block_q=64, heads_per_program=4, tile_n=64, num_warps=8, num_stages=5,
                           row_halves=True)


def test_warp_specialized_config() -> None:
    """The default takes the Gluon tile for the H200's 256-row prefill tile of head size 128 and
    16-bit queries only."""
    pre = attention_config(num_seqs=4, num_q_tokens=4 * 4096, max_context=4096, varlen=True,
                           **H200)
    assert pre == attrs.evolve(TILE_256, warp_specialized=True)
    others = {
        "mid tile": dict(num_seqs=64, num_q_tokens=64 * 32, max_context=4096, varlen=True),
        "split": dict(num_seqs=4, num_q_tokens=4 * 300, max_context=4096, varlen=True),
        "decode": dict(num_seqs=64, num_q_tokens=64, max_context=8192, varlen=False),
    }
    for name, shape in others.items():
        assert not attention_config(**shape, **H200).warp_specialized, name
    big = dict(num_seqs=4, num_q_tokens=4 * 4096, max_context=4096, varlen=True)
    for name, change in {"head 64": {"head_size": 64}, "fp32": {"itemsize": 4},
                         "head 256": {"head_size": 256}}.items():
        assert not attention_config(**big, **{**H200, **change}).warp_specialized, name


def _refusal(spec_kw: dict[str, Any] | None = None, q_dtype: torch.dtype = torch.bfloat16,
             **kw: Any) -> str | None:
    spec = KVCacheSpec(**{"num_blocks": 8, "block_size": 16, "num_kv_heads": 2, "head_size": 128,
                          "dtype": "bfloat16", **(spec_kw or {})})
    q = torch.empty(4, 8, spec.head_size, dtype=q_dtype)
    args = dict(varlen=True, rows=256, tile_n=64, splits=1, sliding_window=None, softcap=None,
                pdl=False, cache_dtype=torch.bfloat16 if not spec.is_fp8 else torch.uint8) | kw
    return A.gluon_prefill_refusal(q, spec, q, **args)


def test_gluon_prefill_refusals() -> None:
    """Every launch the Gluon tile does not compute names why, and keeps the Triton kernel."""
    assert _refusal() is None
    assert _refusal(q_dtype=torch.float16, cache_dtype=torch.float16) is None
    assert _refusal({"block_size": 64}) is None
    assert _refusal(varlen=False) == "decode (no query_start_loc)"
    assert _refusal(rows=128) == "a 128-row tile of 64 keys (256 x 64 wanted)"
    assert _refusal(tile_n=32) == "a 256-row tile of 32 keys (256 x 64 wanted)"
    assert _refusal(splits=2) == "2 splits"
    assert _refusal(sliding_window=128) == "a sliding window"
    assert _refusal(softcap=30.0) == "a softcap"
    assert _refusal(pdl=True) == "pdl=True"
    assert _refusal(alibi=True) == "ALiBi slopes"
    assert _refusal(sinks=True) == "attention sinks"
    assert _refusal({"backend": "mla", "num_kv_heads": 1, "head_size": 128}) == "an MLA cache"
    assert _refusal({"dtype": "fp8"}) == "an fp8 cache"
    assert _refusal({"head_size": 64}) == "head size 64 (128 wanted)"
    assert _refusal({"block_size": 128}) == "block size 128 (8 to 64 wanted)"
    assert _refusal(q_dtype=torch.float16) == "torch.float16 queries on a torch.bfloat16 cache"
    assert _refusal(q_dtype=torch.float32) == "torch.float32 queries on a torch.bfloat16 cache"
    assert not A._gluon_device(torch.device("cpu"))


def test_gluon_launch_failure_falls_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that does not build here (another Triton, another GPU) makes ``launch`` answer
    False, so the Triton kernel runs, and it is not tried again for that signature."""
    tries = []

    class Broken:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kw: Any) -> None:
                tries.append(grid)
                raise RuntimeError("no sm_90 here")
            return launch

    monkeypatch.setattr(G, "gluon", object())
    monkeypatch.setattr(G, "_prefill_ws_kernel", Broken(), raising=False)
    monkeypatch.setattr(G, "_FAILED", set())
    q = torch.zeros(8, 8, 128, dtype=torch.bfloat16)
    strides = {"stride_token": 128, "stride_block": 4096, "stride_kv": 2048, "stride_head": 2048}
    kw = dict(score_mult=0.1, num_seqs=1, num_tiles=2, num_q_tokens=8, num_blocks=4,
              max_context=64, strides=strides, block_size=16, num_kv_heads=2, head_size=128,
              group=4, heads=4, chunks=1, block_q=64)
    before = G.launches()
    for _ in range(3):
        assert G.launch(q, q, q, q, q, q, **kw) is False
    assert tries == [(4,)] and len(G._FAILED) == 1 and G.launches() == before


#: (layout, backend, cross_layer, dtype, block size, query heads per KV head, rows' query tokens)
WS_CASES = [
    ("NHD", "triton", False, "bfloat16", 16, 4, 64),
    ("HND", "triton", False, "bfloat16", 16, 4, 64),
    ("NHD", "triton", False, "float16", 16, 4, 64),
    ("HND", "triton", False, "float16", 16, 4, 64),
    ("NHD", "triton", False, "bfloat16", 8, 4, 64),
    ("HND", "triton", False, "bfloat16", 32, 4, 64),
    ("NHD", "triton", False, "bfloat16", 64, 4, 64),
    ("HND", "flash_attn", True, "bfloat16", 16, 4, 64),
    ("HND", "triton", False, "bfloat16", 16, 8, 32),
    ("NHD", "triton", False, "bfloat16", 16, 1, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "backend", "cross", "dtype", "block_size", "group", "block_q"),
                         WS_CASES)
def test_gpu_warp_specialized_prefill_same_bytes(layout: str, backend: str, cross: bool,
                                                 dtype: str, block_size: int, group: int,
                                                 block_q: int) -> None:
    """On an sm_90 GPU the Gluon tile runs (counted) and writes the Triton tile's bytes: whole
    and chunked prefill, a query tile cut by the sequence's end, a one-query sequence, garbage
    in the block table's padding column; and the reference's values."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon tile is built for sm_90 only; elsewhere the Triton kernel runs")
    case = Case("cuda", backend=backend, layout=layout, cross_layer=cross, dtype=dtype,
                hq=2 * group, hkv=2, head_size=128, block_size=block_size,
                seq_lens=(300, 77, 1000, 64), q_lens=(300, 77, 500, 1), seed=21)
    triton_tile = attrs.evolve(TILE_256, block_q=block_q, heads_per_program=group)
    before = G.launches()
    got = case.run(config=attrs.evolve(triton_tile, warp_specialized=True))
    assert G.launches() == before + 1
    want = case.run(config=triton_tile)
    assert G.launches() == before + 1
    assert torch.equal(got, want)
    case.check(config=attrs.evolve(triton_tile, warp_specialized=True))


@pytest.mark.gpu
def test_gpu_warp_specialized_prefill_default_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default config of an H200-sized prefill takes the Gluon tile; a Gluon kernel that
    fails to build leaves the Triton kernel's bytes."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon tile is built for sm_90 only; elsewhere the Triton kernel runs")
    case = Case("cuda", hq=32, hkv=8, head_size=128, block_size=16, seq_lens=(2048, 2048),
                q_lens=(2048, 2048), seed=22)
    before = G.launches()
    got = case.run()
    assert G.launches() == before + 1
    want = case.run(config=attrs.evolve(TILE_256, num_splits=1))
    assert torch.equal(got, want)

    class Broken:
        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError("no Gluon here")

    monkeypatch.setattr(G, "_prefill_ws_kernel", Broken())
    monkeypatch.setattr(G, "_FAILED", set())
    assert torch.equal(case.run(), want)
    assert G.launches() == before + 1 and len(G._FAILED) == 1


def test_gluon_default_can_be_turned_off_from_the_environment() -> None:
    """``FKV_ATTENTION_GLUON=0`` at import: the default config never asks for the Gluon tile."""
    import subprocess
    import sys

    code = ("from fkv.ops.attention import attention_config as c; print(c(num_seqs=4, "
            "num_q_tokens=16384, max_context=4096, varlen=True, num_q_heads=32, num_kv_heads=8, "
            "head_size=128, itemsize=2, num_sms=132).warp_specialized)")
    got = {flag: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**os.environ, "FKV_ATTENTION_GLUON": flag}, check=True
                                ).stdout.strip() for flag in ("0", "1")}
    assert got == {"0": "False", "1": "True"}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gluon_prefill_builds_for_sm90_with_this_triton(layout: str, tmp_path: Any) -> None:
    """The installed Triton builds the Gluon tile for sm_90a (no GPU needed), in its designed
    shape: tile j's QK^T and tile j - 1's PV in flight together (one wait leaving one MMA
    outstanding per key loop, 4 of them) and ptxas not serializing the warpgroup MMAs (its
    C7512 warning). Without this a Triton release that cannot build it would only show as a
    slower prefill: ``paged_attention`` falls back to the Triton kernel without a word.

    Built in a child process without ``TRITON_INTERPRET`` (the interpreter turns the
    ``triton.language`` helpers Gluon inlines into Python functions, and the build then fails)
    and with an empty Triton cache (a build, not a cache hit)."""
    import json
    import re
    import subprocess
    import sys

    from fkv.ops._spec import cache_strides

    assert G.available()
    spec = KVCacheSpec(layout=layout, num_blocks=64, block_size=16, num_kv_heads=8,
                       head_size=128, dtype="bfloat16")
    code = ("import json, sys; from fkv.ops import _attention_gluon as G; "
            f"ck = G.compile_sm90(block_size=16, stride_token={cache_strides(spec)['stride_token']}, "
            "group=4, block_q=64); status, report = G.ptxas_report(ck.asm['ptx']); "
            "json.dump({'ptx': ck.asm['ptx'], 'shared': ck.metadata.shared, 'status': status, "
            "'report': report}, sys.stdout)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout)
    waits = sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", built["ptx"]))
    assert waits.count("1") == 4 and set(waits) == {"0", "1"}, waits
    assert built["shared"] <= 232448  # sm_90's shared memory per block
    assert built["status"] == 0, built["report"][-2000:]
    assert "C7512" not in built["report"], built["report"][-2000:]
