"""Exact pass/fail and messages of fkv.testing on hand-built caches (closing mutation-audit holes).

Every cache here is built by direct indexing, never through ``token_major``, so a bug in the
token/head mapping cannot make both sides agree with each other.
"""

from __future__ import annotations

import re
from collections import namedtuple

import attrs
import pytest
import torch

import fkv
from fkv import FkvError, KVCacheSpec
from fkv.testing import assert_kv_equal, snapshot_value, token_major

# NHD logical layer view: [block, two, slot, head, channel].
SPEC = KVCacheSpec(layout="NHD", num_blocks=2, block_size=4, num_kv_heads=2, head_size=4,
                   dtype="float32")  # 2*2*4*2*4 = 128 elements per layer


def _arange(spec: KVCacheSpec, start: float = 1.0) -> list[torch.Tensor]:
    """Every element distinct and nonzero."""
    caches = fkv.allocate(spec)
    for i, c in enumerate(caches):
        c.copy_(torch.arange(c.numel(), dtype=torch.float64).reshape(c.shape)
                + start + 1000 * i)
    return caches


def _fails(message: str, *args, **kwargs) -> None:
    with pytest.raises(AssertionError, match="^" + re.escape(message) + "$"):
        assert_kv_equal(*args, **kwargs)


def _geometry(message: str, *args, **kwargs) -> None:
    with pytest.raises(FkvError, match="^" + re.escape(message) + "$"):
        assert_kv_equal(*args, **kwargs)


# -- exact mode ---------------------------------------------------------------------------------

def test_exact_mode_is_bitwise_signed_zero_and_nan_payload():
    a = _arange(SPEC)
    b = [a[0].clone()]
    a[0][1, 1, 2, 0, 3] = 0.0
    b[0][1, 1, 2, 0, 3] = -0.0
    _fails("KV caches differ first at layer 0, token 6 (a: block 1 slot 2; b: block 1 slot 2), V, "
           "head 0, channel 3: a=0.0 b=-0.0 (1 of 128 elements of layer 0 differ)", a, SPEC, b, SPEC)
    b[0][1, 1, 2, 0, 3] = 0.0
    a[0][0, 0, 1, 1, 2] = b[0][0, 0, 1, 1, 2] = float("nan")
    assert_kv_equal(a, SPEC, b, SPEC)  # the same NaN bits are equal
    b[0].view(torch.int32)[0, 0, 1, 1, 2] += 1  # another NaN payload
    with pytest.raises(AssertionError, match=r"^KV caches differ first at layer 0, token 1 .*, K, "
                       r"head 1, channel 2: a=nan b=nan \(1 of 128 elements"):
        assert_kv_equal(a, SPEC, b, SPEC)


def test_count_and_first_of_several_differences():
    a = _arange(SPEC)
    b = [a[0].clone()]
    b[0][1, 0, 3, 1, 1] = -1.0
    b[0][0, 1, 2, 0, 0] = -2.0  # token 2 comes first
    b[0][0, 1, 2, 1, 3] = -3.0
    _fails("KV caches differ first at layer 0, token 2 (a: block 0 slot 2; b: block 0 slot 2), V, "
           f"head 0, channel 0: a={float(a[0][0, 1, 2, 0, 0])!r} b=-2.0 "
           "(3 of 128 elements of layer 0 differ)", a, SPEC, b, SPEC)


def test_dtype_of_a_view_must_match_its_spec():
    bf = SPEC.evolve(dtype="bfloat16")
    a = _arange(SPEC)
    _geometry("assert_kv_equal: a[0] has dtype torch.float32 but spec_a.dtype is 'bfloat16'",
              a, bf, [a[0].to(torch.bfloat16)], bf)


# -- tolerance mode -----------------------------------------------------------------------------

def test_tolerance_keeps_float32_precision():
    a = _arange(SPEC)
    b = [a[0].clone()]
    b[0][0, 0, 0, 0, 0] = 1.0 + 2 ** -20
    with pytest.raises(AssertionError, match=r"token 0 .*: a=1\.0 b=1\.0000009536743164 \(1 of 128 "
                       r"elements of layer 0 differ; max abs diff 9\.54e-07\)$"):
        assert_kv_equal(a, SPEC, b, SPEC, atol=1e-7)
    assert_kv_equal(a, SPEC, b, SPEC, atol=1e-6)


def test_atol_and_rtol_are_each_applied_as_given():
    a = _arange(SPEC)
    b = [a[0].clone()]
    a[0][1, 0, 0, 0, 0] = 100.0
    b[0][1, 0, 0, 0, 0] = 120.0  # |a - b| = 20, rtol * |b| = 120 * rtol
    assert_kv_equal(a, SPEC, b, SPEC, rtol=0.25)
    assert_kv_equal(a, SPEC, b, SPEC, atol=20.0)
    msg = ("KV caches differ first at layer 0, token 4 (a: block 1 slot 0; b: block 1 slot 0), K, "
           "head 0, channel 0: a=100.0 b=120.0 (1 of 128 elements of layer 0 differ; max abs diff 20)")
    _fails(msg, a, SPEC, b, SPEC, rtol=0.1)
    _fails(msg, a, SPEC, b, SPEC, atol=0.25)
    _fails(msg, a, SPEC, b, SPEC, atol=15.0)
    _fails(msg, a, SPEC, b, SPEC, atol=5.0, rtol=0.1)  # 20 > 5 + 12


def test_tolerance_mode_compares_v_too():
    a = _arange(SPEC)
    b = [a[0].clone()]
    b[0][0, 1, 3, 1, 2] += 0.5
    with pytest.raises(AssertionError, match=r"^KV caches differ first at layer 0, token 3 \(a: block 0 "
                       r"slot 3; b: block 0 slot 3\), V, head 1, channel 2: .*max abs diff 0\.5\)$"):
        assert_kv_equal(a, SPEC, b, SPEC, atol=1e-3)


def test_max_abs_diff_ignores_nan_on_one_side():
    a = _arange(SPEC)
    b = [a[0].clone()]
    a[0][0, 0, 0, 0, 0] = float("nan")
    b[0][1, 1, 1, 1, 1] += 0.5
    with pytest.raises(AssertionError, match=r"token 0 .*: a=nan b=1\.0 \(2 of 128 elements of "
                       r"layer 0 differ; max abs diff 0\.5\)$"):
        assert_kv_equal(a, SPEC, b, SPEC, atol=1e-3)


# -- geometry -----------------------------------------------------------------------------------

def test_geometry_mismatches_are_named():
    a = _arange(SPEC)
    pre = "assert_kv_equal: the caches differ in geometry, so their contents cannot be compared: "
    hs = SPEC.evolve(head_size=8)
    _geometry(pre + "head_size: a 4, b 8", a, SPEC, _arange(hs), hs)
    _geometry(pre + "heads: a 1, b 2", a, SPEC, a, SPEC, heads_a=(0, 1))
    two = SPEC.evolve(num_layers=2)
    _geometry(pre + "num_layers: a 2, b 1", _arange(two), two, a, SPEC)
    bs = SPEC.evolve(block_size=8)
    b = fkv.allocate(bs)
    b[0][0].copy_(a[0].permute(1, 0, 2, 3, 4).reshape(2, 8, 2, 4))  # a's 8 tokens in block 0
    _geometry(pre + "block_size: a 4, b 8", a, SPEC, b, bs)
    # ... but as a request's tokens they are equal
    assert_kv_equal(a, SPEC, b, bs, block_ids_a=[0, 1], block_ids_b=[0])
    mla = KVCacheSpec(backend="mla", num_blocks=2, block_size=4, num_kv_heads=1, head_size=8,
                      dtype="float32")
    _geometry("assert_kv_equal: cannot compare an MLA cache with a K/V cache (spec_a.backend "
              "'mla', spec_b.backend 'triton')", fkv.allocate(mla), mla, a, SPEC)


def test_block_ids_on_one_side_only():
    # a: all of its 2 blocks of 4 (8 tokens); b: the same 8 tokens in block 2 of a block_size-8 cache.
    a = _arange(SPEC)
    bs = SPEC.evolve(num_blocks=3, block_size=8)
    b = fkv.allocate(bs)
    b[0].fill_(float("nan"))
    b[0][2].copy_(a[0].permute(1, 0, 2, 3, 4).reshape(2, 8, 2, 4))
    assert_kv_equal(a, SPEC, b, bs, block_ids_b=[2])
    assert_kv_equal(b, bs, a, SPEC, block_ids_a=[2])
    b[0][2, 1, 5, 0, 1] = 0.5  # token 5: a block 1 slot 1, b block 2 slot 5
    _fails("KV caches differ first at layer 0, token 5 (a: block 1 slot 1; b: block 2 slot 5), V, "
           f"head 0, channel 1: a={float(a[0][1, 1, 1, 0, 1])!r} b=0.5 (1 of 128 elements of "
           "layer 0 differ)", a, SPEC, b, bs, block_ids_b=[2])


def test_unequal_block_lists_compare_the_tokens_both_hold():
    a = _arange(SPEC)
    b = [a[0].clone()]
    b[0][0] = -1.0  # block 0 differs, but only b's block list reaches it
    assert_kv_equal(a, SPEC, b, SPEC, block_ids_a=[1], block_ids_b=[1, 0])


# -- head ranges --------------------------------------------------------------------------------

def test_head_ranges_map_to_the_right_heads():
    four = SPEC.evolve(num_kv_heads=4)
    a = _arange(four)
    rank = fkv.allocate(SPEC)  # a decode rank holding heads 2..3
    rank[0].copy_(a[0][:, :, :, 2:4])
    assert_kv_equal(a, four, rank, SPEC, heads_a=(2, 4))
    with pytest.raises(AssertionError, match=r", K, head 0 \(a head 0, b head 0\)|, K, head 0, "):
        assert_kv_equal(a, four, rank, SPEC, heads_a=(0, 2))
    assert_kv_equal(rank, SPEC, a, four, heads_b=slice(2, 4))
    b = [a[0].clone()]
    b[0][1, 0, 3, 3, 2] = -1.0
    a2 = [a[0].clone()]
    a2[0][:, :, :, 0:2] = a[0][:, :, :, 2:4]  # a's heads 0..1 are b's heads 2..3
    _fails("KV caches differ first at layer 0, token 7 (a: block 1 slot 3; b: block 1 slot 3), K, "
           f"head 1 (a head 1, b head 3), channel 2: a={float(a[0][1, 0, 3, 3, 2])!r} b=-1.0 "
           "(1 of 128 elements of layer 0 differ)", a2, four, b, four, heads_a=(0, 2), heads_b=(2, 4))


# -- argument checks ----------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(block_ids_a=[2]), "'block_ids_a' must be a block id in [0, 2) (got 2)"),
    (dict(block_ids_b=[-1]), "'block_ids_b' must be a block id in [0, 2) (got -1)"),
    (dict(block_ids_a=b"\x00"),
     "'block_ids_a' must be a 1-D sequence or tensor of int block ids (got b'\\x00')"),
    (dict(atol=-0.5), "'atol' must be a finite number >= 0 (got -0.5)"),
    (dict(rtol=-1e-9), "'rtol' must be a finite number >= 0 (got -1e-09)"),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_more_bad_arguments(kwargs, message):
    a = _arange(SPEC)
    with pytest.raises(FkvError, match="^" + re.escape(message) + "$"):
        assert_kv_equal(a, SPEC, a, SPEC, **kwargs)


# -- snapshot_value -----------------------------------------------------------------------------

def test_snapshot_value_of_scalars_reasons_plans_and_containers():
    from fkv.connector.handshake import EngineDesc, Reason, Reject, handshake

    assert snapshot_value(1.5) == 1.5 and snapshot_value([0.25, None, True]) == [0.25, None, True]
    r1 = Reason(code="head_size", path="remote.spec.head_size", local=64, remote=128,
                message="m", fix="f")
    r0 = Reason(code="cache_dtype", path="remote.spec.dtype", local="float16", remote="bfloat16",
                message="m", fix="f")
    assert snapshot_value(r0) == "cache_dtype remote.spec.dtype: local='float16' remote='bfloat16'"
    assert snapshot_value(Reject(reasons=(r1, r0))) == {"decision": "reject", "reasons": [
        "head_size remote.spec.head_size: local=64 remote=128",
        "cache_dtype remote.spec.dtype: local='float16' remote='bfloat16'"]}
    spec = KVCacheSpec(layout="HND", num_blocks=8, block_size=16, num_kv_heads=8, head_size=128)
    desc = EngineDesc(engine_id="x", tp_size=1, tp_rank=0, total_num_kv_heads=8)
    plan = handshake((desc, spec), (desc, spec.evolve(layout="NHD"))).plan
    assert snapshot_value(plan) == plan.describe()
    keyed = snapshot_value({SPEC: 1})
    assert keyed == {repr(SPEC): 1} and type(next(iter(keyed))) is str

    @attrs.define
    class Holder:
        spec: KVCacheSpec
        shape: tuple

    assert snapshot_value(Holder(SPEC, (1, 2))) == {"spec": repr(SPEC), "shape": (1, 2)}
    assert type(snapshot_value(Holder(SPEC, (1, 2)))["spec"]) is str
    Point = namedtuple("Point", "spec n")
    value = snapshot_value(Point(SPEC, 3))
    assert type(value) is tuple and value == (repr(SPEC), 3)


def test_same_nonzero_head_offset_names_the_real_head():
    # Comparing heads 2..3 of two 4-head caches: a difference in head 3 must not be reported as
    # plain "head 1" (head 1 holds no difference in either cache).
    four = SPEC.evolve(num_kv_heads=4)
    a = _arange(four)
    b = [a[0].clone()]
    b[0][1, 0, 3, 3, 2] = -1.0
    _fails("KV caches differ first at layer 0, token 7 (a: block 1 slot 3; b: block 1 slot 3), K, "
           f"head 1 (a head 3, b head 3), channel 2: a={float(a[0][1, 0, 3, 3, 2])!r} b=-1.0 "
           "(1 of 128 elements of layer 0 differ)", a, four, b, four, heads_a=(2, 4), heads_b=(2, 4))
    # With whole-cache ranges on both sides the head is named once.
    with pytest.raises(AssertionError, match=r", K, head 3, channel 2: "):
        assert_kv_equal(a, four, b, four)


# -- holes found by mutation (fkv.testing audit) ------------------------------------------------

def test_specs_are_checked_and_layer_counts_match_both_ways():
    a = _arange(SPEC)
    with pytest.raises(FkvError, match=r"^'spec_a' must be a KVCacheSpec \(got 'NHD'\)$"):
        assert_kv_equal(a, "NHD", a, SPEC)
    with pytest.raises(FkvError, match=r"^'spec_b' must be a KVCacheSpec \(got None\)$"):
        assert_kv_equal(a, SPEC, a, None)
    two = SPEC.evolve(num_layers=2)
    _geometry("assert_kv_equal: 'a' has 1 layer view(s) but spec_a has num_layers=2; pass the list "
              "fkv.allocate(spec) returns", a, two, _arange(two), two)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(block_ids_a=[0, 5, 7]), "'block_ids_a' must be a block id in [0, 2) (got 5)"),
    (dict(atol=True), "'atol' must be a finite number >= 0 (got True)"),
    (dict(rtol=False), "'rtol' must be a finite number >= 0 (got False)"),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_first_bad_id_and_bool_tolerances_are_refused(kwargs, message):
    a = _arange(SPEC)
    with pytest.raises(FkvError, match="^" + re.escape(message) + "$"):
        assert_kv_equal(a, SPEC, a, SPEC, **kwargs)


def test_tolerance_compares_in_float64_with_rtol_relative_to_b():
    a = _arange(SPEC)
    b = [a[0].clone()]
    a[0][0, 0, 0, 0, 0] = 0.0
    b[0][0, 0, 0, 0, 0] = 0.1  # float32(0.1) = 0.10000000149..., just above atol=0.1 in float64
    _fails("KV caches differ first at layer 0, token 0 (a: block 0 slot 0; b: block 0 slot 0), K, "
           "head 0, channel 0: a=0.0 b=0.10000000149011612 (1 of 128 elements of layer 0 differ; "
           "max abs diff 0.1)", a, SPEC, b, SPEC, atol=0.1)
    assert_kv_equal(a, SPEC, b, SPEC, atol=0.11)
    # rtol scales |b|, as torch.isclose(a, b) does: |100 - 120| = 20 <= 0.18 * 120, > 0.18 * 100.
    a[0][0, 0, 0, 0, 0], b[0][0, 0, 0, 0, 0] = 100.0, 120.0
    assert_kv_equal(a, SPEC, b, SPEC, rtol=0.18)
    _fails("KV caches differ first at layer 0, token 0 (a: block 0 slot 0; b: block 0 slot 0), K, "
           "head 0, channel 0: a=120.0 b=100.0 (1 of 128 elements of layer 0 differ; max abs diff "
           "20)", b, SPEC, a, SPEC, rtol=0.18)


def test_tolerance_message_when_no_pair_is_finite():
    a = _arange(SPEC)
    a[0].fill_(float("inf"))
    b = [a[0].clone()]
    b[0][0, 1, 0, 1, 3] = 1.0
    _fails("KV caches differ first at layer 0, token 0 (a: block 0 slot 0; b: block 0 slot 0), V, "
           "head 1, channel 3: a=inf b=1.0 (1 of 128 elements of layer 0 differ)",
           a, SPEC, b, SPEC, atol=1e-3)


def test_token_major_checks_its_arguments_and_maps_tokens_exactly():
    a = _arange(SPEC)
    with pytest.raises(FkvError, match=r"^'spec' must be a KVCacheSpec \(got 'NHD'\)$"):
        token_major(a[0], "NHD")
    with pytest.raises(FkvError, match=r"^'layer' must be a torch.Tensor \(one layer's view from "
                       r"fkv.allocate\) \(got 'list'\)$"):
        token_major(a, SPEC)
    # A view of another geometry is refused, never sliced into a wrong answer (or a RuntimeError).
    for shape in [(128,), (2, 2, 4, 3, 4), (3, 2, 4, 2, 4)]:
        with pytest.raises(FkvError) as e:
            token_major(torch.zeros(shape), SPEC)
        assert str(e.value) == (f"'layer' must be one layer's view of shape (2, 2, 4, 2, 4) (the "
                                f"logical_shape of spec {SPEC!r}) (got 'shape {shape}')")
    t = token_major(a[0], SPEC, [1], heads=(1, 2), num_tokens=3)
    assert tuple(t.shape) == (3, 2, 1, 4)
    assert torch.equal(t[2, 1, 0], a[0][1, 1, 2, 1])  # token 2 = block 1 slot 2, V, head 1


def test_snapshot_value_returns_plain_python_values():
    import enum

    import numpy as np

    from fkv.connector.handshake import EngineDesc

    class Color(enum.StrEnum):
        RED = "red"

    for value, plain in [(Color.RED, "red"), (fkv.Layout.HND, "HND"), (np.float32(0.5), 0.5),
                         (np.int64(3), 3)]:
        assert snapshot_value(value) == plain and type(snapshot_value(value)) is type(plain)
    flat = snapshot_value(np.arange(3))
    assert flat == [0, 1, 2] and [type(x) for x in flat] == [int] * 3
    rows = snapshot_value(np.arange(4).reshape(2, 2))
    assert rows == [(0, 1), (2, 3)] and type(rows[0][0]) is int
    assert snapshot_value(np.zeros((1, 2, 2), dtype=np.int64)) == [[[0, 0], [0, 0]]]
    with pytest.raises(FkvError) as e:
        snapshot_value(b"x")
    assert str(e.value) == ("snapshot_value: no plain form for a 'bytes' (b'x'); pass a spec, "
                            "layout, handshake result, plan, numpy array, attrs value or a "
                            "container of them")
    # A dict keyed by an attrs value: its plain form (a dict) cannot be a key.
    desc = EngineDesc(engine_id="x", tp_size=1, tp_rank=0, total_num_kv_heads=8)
    with pytest.raises(FkvError) as e:
        snapshot_value({desc: 1})
    assert str(e.value) == (f"snapshot_value: the dict key {desc!r} has no hashable plain form "
                            f"({snapshot_value(desc)!r}); key the dict by specs, layouts, strings "
                            f"or numbers")
