"""fkv.testing: spec/engine-pair strategies, assert_kv_equal, snapshot_value."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from inline_snapshot import snapshot

import fkv
from fkv import FkvError, KVCacheSpec
from fkv.testing import assert_kv_equal, engine_pairs, heads_per_rank, snapshot_value, specs, token_major


def _filled(spec: KVCacheSpec, seed: int = 0) -> list[torch.Tensor]:
    """A cache whose every element is distinct-ish random data (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    caches = fkv.allocate(spec)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    return caches


def _copy_logical(src: list[torch.Tensor], src_spec: KVCacheSpec, dst_spec: KVCacheSpec):
    """Copy logical contents into another layout/backend (flash_attn swaps the K/V and block dims)."""
    dst = fkv.allocate(dst_spec)
    for s, d in zip(src, dst):
        d.copy_(s if src_spec.logical_axes == dst_spec.logical_axes else s.transpose(0, 1))
    return dst


# -- specs() ------------------------------------------------------------------------------------

@settings(max_examples=60)
@given(specs())
def test_specs_are_valid_and_small(spec):
    assert isinstance(spec, KVCacheSpec)
    assert spec.region_bytes * spec.num_regions <= 1 << 20
    if spec.is_mla:
        assert spec.num_kv_heads == 1


@settings(max_examples=30)
@given(specs(backend="flash_attn", layout=("HND", "LBHNC"), dtype="float16",
             num_blocks=st.integers(3, 4), cross_layer=True, max_bytes=None))
def test_specs_honor_constraints(spec):
    assert (spec.backend, spec.layout, spec.dtype, spec.cross_layer) == (
        "flash_attn", fkv.Layout.HND, "float16", True)
    assert spec.num_blocks in (3, 4)


def test_specs_reject_unknown_or_empty_constraints():
    with pytest.raises(FkvError, match=r"specs: unknown constraint\(s\) \['heads'\]"):
        specs(heads=4)
    with pytest.raises(FkvError, match="'layout' must be a value, a non-empty collection"):
        specs(layout=())


# -- engine_pairs() -----------------------------------------------------------------------------

@settings(max_examples=60)
@given(engine_pairs())
def test_engine_pairs_follow_spec_section_4(pair):
    (p_engine, p_spec), (d_engine, d_spec) = pair
    assert pair.prefill == (p_engine, p_spec) and pair.decode == (d_engine, d_spec)
    for engine, spec in pair:
        assert spec.num_kv_heads == (1 if spec.is_mla else
                                     max(1, engine.total_num_kv_heads // engine.tp_size))
        assert 0 <= engine.tp_rank < engine.tp_size
    assert p_engine.tp_rank == 0
    big, small = max(p_engine.tp_size, d_engine.tp_size), min(p_engine.tp_size, d_engine.tp_size)
    assert big % small == 0
    # The hashed model facts agree; the per-side ones may not.
    for field in ("backend", "head_size", "dtype", "num_layers"):
        assert getattr(p_spec, field) == getattr(d_spec, field)
    for field in ("total_num_kv_heads", "model", "model_dtype", "protocol"):
        assert getattr(p_engine, field) == getattr(d_engine, field)


@settings(max_examples=20)
@given(engine_pairs(backend="triton", total_num_kv_heads=8, prefill_tp=1, decode_tp=2,
                    prefill_layout="HND", decode_layout="NHD", block_size=16, cross_layer=False))
def test_engine_pairs_honor_constraints(pair):
    (p_engine, p_spec), (d_engine, d_spec) = pair
    assert (p_engine.tp_size, d_engine.tp_size) == (1, 2)
    assert (p_spec.num_kv_heads, d_spec.num_kv_heads) == (8, 4)
    assert (p_spec.layout, d_spec.layout) == (fkv.Layout.HND, fkv.Layout.NHD)


def test_heads_per_rank():
    assert [heads_per_rank(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]


# -- assert_kv_equal ----------------------------------------------------------------------------

@settings(max_examples=25)
@given(specs(backend=("triton", "flashinfer", "flash_attn"), dtype=("bfloat16", "float32"),
             max_bytes=1 << 16),
       st.sampled_from(["triton", "flashinfer", "flash_attn"]), st.sampled_from(["NHD", "HND"]),
       st.booleans())
def test_equal_contents_in_any_layout_compare_equal(spec, backend, layout, cross):
    other = spec.evolve(backend=backend, layout=layout, cross_layer=cross)
    a = _filled(spec)
    assert_kv_equal(a, spec, _copy_logical(a, spec, other), other)


@settings(max_examples=25)
@given(specs(backend=("triton", "flash_attn"), dtype=("bfloat16", "float8_e4m3fn"),
             num_kv_heads=(2, 4), max_bytes=1 << 15), st.data())
def test_first_difference_is_located_exactly(spec, data):
    other = spec.evolve(layout="HND" if spec.layout == "NHD" else "NHD")
    a = _filled(spec, seed=1)
    b = _copy_logical(a, spec, other)
    layer = data.draw(st.integers(0, spec.num_layers - 1))
    blk = data.draw(st.integers(0, spec.num_blocks - 1))
    kv = data.draw(st.integers(0, 1))
    slot = data.draw(st.integers(0, spec.block_size - 1))
    head = data.draw(st.integers(0, spec.num_kv_heads - 1))
    ch = data.draw(st.integers(0, spec.head_size - 1))
    index = (kv, blk) if spec.backend == "flash_attn" else (blk, kv)
    view = b[layer][index][slot, head]
    view[ch] = torch.tensor(-3.0 if float(view[ch].float()) > 0 else 3.0).to(view.dtype)
    token = blk * spec.block_size + slot
    with pytest.raises(AssertionError, match=(
            rf"^KV caches differ first at layer {layer}, token {token} \(a: block {blk} slot {slot}; "
            rf"b: block {blk} slot {slot}\), {'KV'[kv]}, head {head}, channel {ch}: a=\S+ "
            rf"b={'-3.0' if float(view[ch].float()) < 0 else '3.0'} \(1 of \d+ elements of "
            rf"layer {layer} differ\)$")):
        assert_kv_equal(a, spec, b, other)


def test_request_tokens_across_block_sizes_and_head_slices():
    # A prefill cache (HND, N=4, 8 heads) and a decode rank's cache (NHD, N=8, heads 4..7 only):
    # the request's 12 tokens live in blocks [5, 2, 0] on one side and [1, 3] on the other.
    p_spec = KVCacheSpec(layout="HND", num_blocks=6, block_size=4, num_kv_heads=8, head_size=16,
                         dtype="float32", num_layers=2)
    d_spec = KVCacheSpec(layout="NHD", num_blocks=4, block_size=8, num_kv_heads=4, head_size=16,
                         dtype="float32", num_layers=2)
    p = _filled(p_spec, seed=2)
    d = fkv.allocate(d_spec)
    for pl, dl in zip(p, d):
        dl.fill_(float("nan"))
        tokens = token_major(pl, p_spec, [5, 2, 0], heads=(4, 8))  # [12, 2, 4, 16]
        for i in range(12):
            dl[[1, 3][i // 8], :, i % 8] = tokens[i]
    assert_kv_equal(p, p_spec, d, d_spec, block_ids_a=[5, 2, 0], block_ids_b=[1, 3],
                    num_tokens=12, heads_a=(4, 8))
    d[1][3, 1, 2, 0, 9] += 1.0  # token 10 = decode block 3 slot 2 = prefill block 0 slot 2, V
    with pytest.raises(AssertionError, match=(
            r"layer 1, token 10 \(a: block 0 slot 2; b: block 3 slot 2\), V, head 0 "
            r"\(a head 4, b head 0\), channel 9: a=\S+ b=\S+ \(1 of 1536 elements")):
        assert_kv_equal(p, p_spec, d, d_spec, block_ids_a=[5, 2, 0], block_ids_b=[1, 3],
                        num_tokens=12, heads_a=(4, 8))
    # Only the request's tokens count: the NaN-poisoned rest of the decode cache is not compared.
    assert_kv_equal(p, p_spec, d, d_spec, block_ids_a=[5, 2, 0], block_ids_b=[1, 3],
                    num_tokens=10, heads_a=(4, 8))


def test_tolerance_mode_and_nan_poison():
    spec = KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    a = _filled(spec, seed=3)
    b = [a[0].clone()]
    b[0][1, 0, 0, 0, 0] += 1e-4
    with pytest.raises(AssertionError, match=r"token 4 .*, K, head 0, channel 0"):
        assert_kv_equal(a, spec, b, spec)
    assert_kv_equal(a, spec, b, spec, atol=1e-3)
    with pytest.raises(AssertionError, match=r"max abs diff 0\.0001"):
        assert_kv_equal(a, spec, b, spec, atol=1e-6)
    a[0][0, 1].fill_(float("nan"))
    b[0][0, 1].fill_(float("nan"))
    assert_kv_equal(a, spec, b, spec, atol=1e-3)  # NaN poison matches itself in both modes
    bf = spec.evolve(dtype="bfloat16")
    c = [a[0].to(torch.bfloat16)]
    assert_kv_equal(a, spec, c, bf, atol=1e-2, rtol=1e-2)


def test_mla_caches_compare_by_token():
    spec = KVCacheSpec(backend="mla", num_blocks=3, block_size=4, num_kv_heads=1, head_size=24,
                       dtype="bfloat16", num_layers=2, cross_layer=True)
    flat = spec.evolve(cross_layer=False)
    a = _filled(spec, seed=4)
    b = _copy_logical(a, spec, flat)
    assert_kv_equal(a, spec, b, flat)
    b[1][2, 3, 7] += 1
    with pytest.raises(AssertionError, match=r"^KV caches differ first at layer 1, token 11 "
                       r"\(a: block 2 slot 3; b: block 2 slot 3\), channel 7: "):
        assert_kv_equal(a, spec, b, flat)


def test_bad_inputs_name_the_field():
    spec = KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    a = _filled(spec)
    with pytest.raises(FkvError, match=r"differ in geometry, .*num_blocks: a 2, b 3"):
        assert_kv_equal(a, spec, _filled(spec.evolve(num_blocks=3)), spec.evolve(num_blocks=3))
    with pytest.raises(FkvError, match=r"dtype: a 'float32', b 'bfloat16'; pass atol/rtol"):
        bf = spec.evolve(dtype="bfloat16")
        assert_kv_equal(a, spec, _filled(bf), bf)
    with pytest.raises(FkvError, match=r"'b' has 2 layer view\(s\) but spec_b has num_layers=1"):
        assert_kv_equal(a, spec, a + a, spec)
    with pytest.raises(FkvError, match=r"b\[0\] has shape \(2, 2, 4, 2, 8\) but spec_b .* logical "
                       r"shape \(2, 2, 4, 4, 8\)"):
        assert_kv_equal(a, spec, a, spec.evolve(num_kv_heads=4))
    with pytest.raises(FkvError, match=r"'block_ids_b' must be a block id in \[0, 2\) \(got 7\)"):
        assert_kv_equal(a, spec, a, spec, block_ids_a=[0], block_ids_b=[7])
    with pytest.raises(FkvError, match=r"'heads_a' must be a slice\(start, stop\) or a \(start, "
                       r"stop\) pair of ints with 0 <= start < stop <= 2 .*\(got \(1, 3\)\)"):
        assert_kv_equal(a, spec, a, spec, heads_a=(1, 3))
    with pytest.raises(FkvError, match=r"'num_tokens' must be at most 4"):
        assert_kv_equal(a, spec, a, spec, block_ids_a=[0], block_ids_b=[1], num_tokens=5)
    # A single layer view is accepted for a one-layer spec.
    assert_kv_equal(a[0], spec, a, spec)


_HEADS = ("slice(start, stop) or a (start, stop) pair of ints with 0 <= start < stop <= 2 (a "
          "contiguous range of this rank's 2 heads)")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(a=None), "'a' must be a list of layer views (as fkv.allocate returns) or one "
                   "torch.Tensor when num_layers == 1 (got 'NoneType')"),
    (dict(a=5), "'a' must be a list of layer views (as fkv.allocate returns) or one "
                "torch.Tensor when num_layers == 1 (got 'int')"),
    (dict(b=[[1]]), "'b[0]' must be a torch.Tensor (one layer's view from fkv.allocate) "
                    "(got 'list'); convert it with torch.as_tensor"),
    (dict(block_ids_a=1), "'block_ids_a' must be a 1-D sequence or tensor of int block ids (got 1)"),
    (dict(block_ids_a=[[1]]),
     "'block_ids_a' must be a 1-D sequence or tensor of int block ids (got [[1]])"),
    (dict(block_ids_a=[1.7]),
     "'block_ids_a' must be a 1-D sequence or tensor of int block ids (got [1.7])"),
    (dict(block_ids_b=[True]),
     "'block_ids_b' must be a 1-D sequence or tensor of int block ids (got [True])"),
    (dict(block_ids_a="1"), "'block_ids_a' must be a 1-D sequence or tensor of int block ids "
                            "(got '1')"),
    (dict(heads_a=(0, 1, 2)), f"'heads_a' must be a {_HEADS} (got (0, 1, 2))"),
    (dict(heads_a=(0.5, 1.5)), f"'heads_a' must be a {_HEADS} (got (0.5, 1.5))"),
    (dict(heads_b=1), f"'heads_b' must be a {_HEADS} (got 1)"),
    (dict(heads_a=slice(0, 2, 2)), f"'heads_a' must be a {_HEADS} (got slice(0, 2, 2)); heads "
                                   f"are one contiguous range: drop the step (e.g. slice(0, 2))"),
    (dict(num_tokens=2.9), "'num_tokens' must be a non-negative int (got 2.9)"),
    (dict(num_tokens="2"), "'num_tokens' must be a non-negative int (got '2')"),
    (dict(num_tokens=-1), "'num_tokens' must be a non-negative int (got -1)"),
    (dict(atol=float("nan")), "'atol' must be a finite number >= 0 (got nan)"),
    (dict(atol=-1.0), "'atol' must be a finite number >= 0 (got -1.0)"),
    (dict(atol="0.1"), "'atol' must be a finite number >= 0 (got '0.1')"),
    (dict(atol=None), "'atol' must be a finite number >= 0 (got None)"),
    (dict(rtol=float("inf")), "'rtol' must be a finite number >= 0 (got inf)"),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_bad_arguments_are_fkv_errors_naming_the_argument(kwargs, message):
    import re

    spec = KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    a = _filled(spec)
    args = {"a": a, "b": [a[0].clone()], "block_ids_a": [0], "block_ids_b": [0]} | kwargs
    with pytest.raises(FkvError, match="^" + re.escape(message) + "$"):
        assert_kv_equal(args.pop("a"), spec, args.pop("b"), spec, **args)


def test_caches_must_hold_values_as_torch_tensors():
    spec = KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    a = _filled(spec)
    with pytest.raises(FkvError, match=r"^'a\[0\]' must be a torch.Tensor \(one layer's view from "
                       r"fkv.allocate\) \(got 'ndarray'\); convert it with torch.as_tensor$"):
        assert_kv_equal([a[0].numpy()], spec, a, spec)
    with pytest.raises(FkvError, match=r"^'b\[0\]' must be a tensor with values \(on cpu or cuda\) "
                       r"\(got 'a tensor on meta'\); a meta tensor holds no contents to compare$"):
        assert_kv_equal(a, spec, [a[0].to("meta")], spec)


def test_a_head_slice_is_taken_as_the_ops_take_it():
    spec = KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=4, head_size=8, dtype="float32")
    a = _filled(spec)
    b = [a[0].clone()]
    b[0][:, :, :, 3] += 1  # head 3 differs
    assert_kv_equal(a, spec, b, spec, heads_a=slice(0, 3), heads_b=slice(None, 3))
    assert_kv_equal(a, spec, b, spec, heads_a=(0, 3), heads_b=slice(0, 3, 1))
    with pytest.raises(AssertionError, match=r", head 3, channel 0: "):
        assert_kv_equal(a, spec, b, spec, heads_a=slice(0, None), heads_b=slice(0, 4))
    # numpy ints and id tensors are ints too
    import numpy as np

    assert_kv_equal(a, spec, b, spec, block_ids_a=np.array([1, 0]), block_ids_b=torch.tensor([1, 0]),
                    num_tokens=np.int64(5), heads_a=(np.int64(0), 3), heads_b=(0, 3))


# -- snapshot_value -----------------------------------------------------------------------------

def test_snapshot_value_of_specs_and_patterns():
    spec = KVCacheSpec(layout="LBHNC", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128,
                       num_layers=2)
    assert snapshot_value({"spec": spec, "layout": spec.layout,
                           "pattern": fkv.rearrange_pattern(spec, spec.evolve(layout="NHD")),
                           "shapes": [spec.logical_shape, spec.physical_shape]}) == snapshot(
        {
            "spec": "KVCacheSpec(backend='triton', layout='HND', num_blocks=4, block_size=16, "
            "num_kv_heads=8, head_size=128, dtype='bfloat16', num_layers=2)",
            "layout": "HND",
            "pattern": "L B two H N C -> L B two N H C",
            "shapes": [(4, 2, 16, 8, 128), (4, 2, 8, 16, 128)],
        }
    )
    import numpy as np

    assert snapshot_value(np.arange(6, dtype=np.int64).reshape(2, 3)) == [(0, 1, 2), (3, 4, 5)]
    with pytest.raises(FkvError, match=r"snapshot_value: no plain form for a 'object'"):
        snapshot_value(object())


@settings(max_examples=100)
@given(engine_pairs())
def test_every_consistent_divisible_pair_is_accepted(pair):
    # fkv goes further than the engine (docs/handshake.md): layouts, block sizes, NHD head slices and
    # cross-layer buffers are all planned, so a consistent pair with divisible TP sizes connects.
    from fkv.connector.handshake import handshake

    result = handshake(pair.decode, pair.prefill)
    assert result.ok, str(result)


def test_snapshot_value_of_handshake_outcomes():
    from fkv.connector.handshake import EngineDesc, handshake

    spec = KVCacheSpec(layout="HND", num_blocks=8, block_size=16, num_kv_heads=8, head_size=128)
    prefill = (EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=8), spec)
    decode = (EngineDesc(engine_id="d", tp_size=2, tp_rank=1, total_num_kv_heads=8),
              spec.evolve(num_kv_heads=4))
    accept = handshake(decode, prefill)
    assert snapshot_value(accept) == {"decision": "accept", "plan": accept.plan.describe()}
    assert snapshot_value(accept.plan.segments([3], [5])) == snapshot(
        [(0, 0, 344064, 0, 98304, 16384), (0, 0, 376832, 0, 114688, 16384)])
    reject = handshake((decode[0], decode[1].evolve(head_size=64, block_size=32)),
                       (prefill[0], spec.evolve(dtype="float16")))
    assert snapshot_value(reject) == snapshot(
        {
            "decision": "reject",
            "reasons": [
                "cache_dtype remote.spec.dtype: local='bfloat16' remote='float16'",
                "head_size remote.spec.head_size: local=64 remote=128",
            ],
        }
    )
    assert snapshot_value(prefill[0]) == snapshot(
        {"engine_id": "p", "tp_size": 1, "tp_rank": 0, "total_num_kv_heads": 8, "model": "",
         "model_dtype": "", "protocol": 1})



@pytest.mark.parametrize(("alias", "cross"), [("BLNHC", True), ("BHLNC", True), ("LBNHC", False)])
def test_specs_take_cross_layer_from_an_alias_that_names_it(alias, cross):
    @settings(max_examples=20)
    @given(specs(backend="triton", layout=alias, cross_layer=False))
    def check(spec):
        assert spec.cross_layer is cross
        assert spec.layout is fkv.Layout.parse(alias)

    check()


# -- holes found by mutation (fkv.testing audit) ------------------------------------------------

def _find(strategy, condition=lambda value: True):
    """The first value of ``strategy`` that meets ``condition`` (hypothesis.find)."""
    from hypothesis import find

    return find(strategy, condition, settings=settings(max_examples=2000, database=None))


@pytest.mark.parametrize(("field", "value"), [
    ("num_blocks", 1), ("num_blocks", 8), ("block_size", 1), ("block_size", 16),
    ("num_kv_heads", 8), ("head_size", 1), ("head_size", 128), ("num_layers", 3),
    ("cross_layer", True), ("backend", "mla"), ("dtype", "float8_e5m2"),
])
def test_unconstrained_specs_reach_each_end_of_their_defaults(field, value):
    assert getattr(_find(specs(), lambda s: getattr(s, field) == value), field) == value


@settings(max_examples=60)
@given(specs())
def test_unconstrained_specs_stay_within_their_defaults(spec):
    assert 1 <= spec.num_blocks <= 8 and 1 <= spec.num_layers <= 3
    assert spec.block_size in (1, 2, 4, 8, 16) and spec.num_kv_heads in (1, 2, 4, 8)
    assert spec.head_size in (1, 2, 8, 16, 64, 128)


def test_max_bytes_bounds_every_region_inclusively():
    fixed = dict(backend="triton", layout="NHD", num_blocks=2, block_size=4, num_kv_heads=2,
                 head_size=8, dtype="float32", num_layers=2, cross_layer=False)
    spec = KVCacheSpec(**fixed)
    assert (spec.region_bytes, spec.num_regions) == (1024, 2)
    assert _find(specs(max_bytes=2048, **fixed)) == spec
    from hypothesis.errors import Unsatisfiable

    with pytest.raises(Unsatisfiable):
        _find(specs(max_bytes=2047, **fixed))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: heads_per_rank(8, 0), "'tp_size' must be a positive int (got 0)"),
    (lambda: heads_per_rank(8, True), "'tp_size' must be a positive int (got True)"),
    (lambda: heads_per_rank("8", 2), "'total_num_kv_heads' must be a positive int (got '8')"),
    (lambda: heads_per_rank(-8, 2), "'total_num_kv_heads' must be a positive int (got -8)"),
    (lambda: specs(max_bytes="1MiB"), "'max_bytes' must be a positive int (got '1MiB')"),
    (lambda: specs(max_bytes=0), "'max_bytes' must be a positive int (got 0)"),
    (lambda: _find(engine_pairs(prefill_tp=0)), "'prefill_tp' must be a positive int (got 0)"),
    (lambda: _find(engine_pairs(decode_tp="2")), "'decode_tp' must be a positive int (got '2')"),
    (lambda: _find(engine_pairs(decode_tp=-1, divisible=False)),
     "'decode_tp' must be a positive int (got -1)"),
], ids=lambda v: None if callable(v) else v)
def test_bad_strategy_arguments_are_fkv_errors(make, message):
    with pytest.raises(FkvError) as e:
        make()
    assert str(e.value) == message  # (hypothesis adds a note when the error comes from a draw)


def test_heads_per_rank_is_an_int_floor():
    import numpy as np

    assert [heads_per_rank(6, tp) for tp in (1, 2, 4, 8)] == [6, 3, 1, 1]
    assert all(type(heads_per_rank(6, tp)) is int for tp in (1, 4))
    assert heads_per_rank(np.int64(8), np.int64(2)) == 4


def test_engine_pairs_name_the_engines_the_model_and_every_decode_rank():
    from fkv.connector.handshake import EngineDesc

    pair = _find(engine_pairs(backend="triton", dtype="float8_e4m3fn", model="llama",
                              total_num_kv_heads=8, prefill_tp=1, decode_tp=4),
                 lambda p: p.decode[0].tp_rank == 3)
    (p_engine, p_spec), (d_engine, d_spec) = pair
    assert p_engine == EngineDesc(engine_id="prefill-engine", tp_size=1, tp_rank=0,
                                  total_num_kv_heads=8, model="llama", model_dtype="bfloat16")
    assert d_engine == EngineDesc(engine_id="decode-engine", tp_size=4, tp_rank=3,
                                  total_num_kv_heads=8, model="llama", model_dtype="bfloat16")
    assert (p_spec.num_kv_heads, d_spec.num_kv_heads, d_spec.dtype) == (8, 2, "float8_e4m3fn")
    assert _find(engine_pairs(dtype="float16")).prefill[0].model_dtype == "float16"


def test_engine_pairs_take_per_side_block_sizes_and_cross_layer_choices():
    pairs = engine_pairs(backend="triton", block_size=16, prefill_block_size=4,
                         decode_block_size=8, cross_layer=(False, True))
    pair = _find(pairs, lambda p: p.decode[1].cross_layer and not p.prefill[1].cross_layer)
    assert (pair.prefill[1].block_size, pair.decode[1].block_size) == (4, 8)
    _find(pairs, lambda p: p.prefill[1].cross_layer and not p.decode[1].cross_layer)
    alias = _find(engine_pairs(backend="triton", layout="BLNHC", cross_layer=False))
    assert alias.prefill[1].cross_layer and alias.decode[1].cross_layer


@settings(max_examples=30)
@given(engine_pairs(prefill_tp=(2, 3), decode_tp=(2, 3)))
def test_divisible_pairs_have_tp_sizes_that_divide(pair):
    assert pair.prefill[0].tp_size == pair.decode[0].tp_size  # 2 and 3 divide only themselves


def test_divisible_false_draws_any_tp_sizes():
    pair = _find(engine_pairs(prefill_tp=(2, 3), decode_tp=(2, 3), divisible=False),
                 lambda p: p.prefill[0].tp_size != p.decode[0].tp_size)
    assert {pair.prefill[0].tp_size, pair.decode[0].tp_size} == {2, 3}
