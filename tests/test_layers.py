"""``fkv.ops.layers.LayerMove``: every layer in one launch, bit-exact against the per-layer
reference move (layouts, backends, cross-layer sides, head ranges, re-chunking)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fkv
from fkv.errors import FkvError
from fkv.ops.layers import LayerMove


BASE = fkv.KVCacheSpec(layout="NHD", num_blocks=6, block_size=4, num_kv_heads=4, head_size=8,
                       num_layers=3)
CASES = {
    "NHD-HND": (BASE, BASE.evolve(layout="HND")),
    "HND-NHD-rechunk": (BASE.evolve(layout="HND"), BASE.evolve(block_size=8, num_blocks=3)),
    "cross-src": (BASE.evolve(backend="flash_attn", cross_layer=True), BASE.evolve(layout="HND")),
    "cross-dst": (BASE, BASE.evolve(backend="flashinfer", layout="HND", cross_layer=True)),
    "mla": (BASE.evolve(backend="mla", num_kv_heads=1), BASE.evolve(backend="mla", num_kv_heads=1,
                                                                    block_size=8, num_blocks=3)),
}


def _sides(a: fkv.KVCacheSpec, b: fkv.KVCacheSpec, device: str, seed: int) -> tuple[list, ...]:
    """``(host, src, dst, ref)``: random source layers (on the host and on ``device``) and NaN
    destinations (on ``device``, and the reference's on the host)."""
    host, src = fkv.allocate(a), fkv.allocate(a, device)
    dst, ref = fkv.allocate(b, device), fkv.allocate(b)
    g = torch.Generator().manual_seed(seed)
    for h, v in zip(host, src, strict=True):
        h.copy_(torch.randn(h.shape, generator=g))
        v.copy_(h)
    for v in dst + ref:
        v.fill_(float("nan"))
    return host, src, dst, ref


@pytest.mark.parametrize("case", list(CASES))
def test_layer_move_equals_the_reference_per_layer(case: str, device: str) -> None:
    a, b = CASES[case]
    heads = (None, None) if a.is_mla else ((2, 4), (0, 2))
    host, src, dst, ref = _sides(a, b, device, 3)
    src_ids, dst_ids, tokens = [5, 1, 3], [2, 0] if b.block_size == 8 else [4, 0, 2], 11
    LayerMove(src, a, dst, b, src_heads=heads[0], dst_heads=heads[1])(src_ids, dst_ids, tokens)
    for layer in range(a.num_layers):
        fkv.ops.reference.move(host[layer], a, src_ids, ref[layer], b, dst_ids,
                               src_heads=heads[0], dst_heads=heads[1], num_tokens=tokens)
        assert torch.equal(dst[layer].cpu().nan_to_num(7.0), ref[layer].nan_to_num(7.0)), layer


def test_layer_move_of_a_layer_range_leaves_the_others(device: str) -> None:
    a, b = CASES["NHD-HND"]
    host, src, dst, ref = _sides(a, b, device, 4)
    LayerMove(src, a, dst, b)([5, 1], [2, 0], 8, layers=(1, 3))
    fkv.ops.reference.move(host[1], a, [5, 1], ref[1], b, [2, 0], num_tokens=8)
    fkv.ops.reference.move(host[2], a, [5, 1], ref[2], b, [2, 0], num_tokens=8)
    for layer in range(3):
        assert torch.equal(dst[layer].cpu().nan_to_num(7.0), ref[layer].nan_to_num(7.0)), layer
    with pytest.raises(FkvError, match=r"'layers' must be \(start, stop\) ints with 0 <= start <= "
                                       r"stop <= 3 \(got \(2, 4\)\)"):
        LayerMove(src, a, dst, b)([5], [2], layers=(2, 4))


def test_layer_move_refuses_mismatched_sides() -> None:
    (a, b), src = CASES["NHD-HND"], fkv.allocate(CASES["NHD-HND"][0])
    with pytest.raises(FkvError, match="'src' holds 3 layers but 'dst' 2; pass the same layers"):
        LayerMove(src, a, fkv.allocate(b)[:2], b)
    with pytest.raises(FkvError, match=r"'src_heads' \(0, 2\) selects 2 heads but 'dst_heads' "
                                       r"\(0, 4\) selects 4"):
        LayerMove(src, a, fkv.allocate(b), b, src_heads=(0, 2))
    with pytest.raises(FkvError, match="LayerMove: src and dst must agree on head_size"):
        LayerMove(src, a, fkv.allocate(b.evolve(head_size=16)), b.evolve(head_size=16))


@pytest.mark.parametrize("layers", [(0.5, 1), (1,), "ab", 1, (False, True), (0, 1, 2), (2, 1),
                                    (-1, 2)])
def test_layer_move_refuses_a_bad_layer_range(layers: object) -> None:
    a, b = CASES["NHD-HND"]
    dst = fkv.allocate(b)
    before = [d.clone() for d in dst]
    with pytest.raises(FkvError) as e:
        LayerMove(fkv.allocate(a), a, dst, b)([5], [2], layers=layers)
    assert str(e.value) == (f"'layers' must be (start, stop) ints with 0 <= start <= stop <= 3 "
                            f"(got {layers!r})")
    assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(dst, before))


def test_layer_move_refuses_repeated_and_aliased_destination_blocks() -> None:
    """A destination block listed twice, or (when a dst view is a src view itself, heads
    overlapping) one that is also a source block, is refused when validating; other heads of the
    same blocks of one cache may move."""
    a, b = CASES["NHD-HND"]
    src, dst = fkv.allocate(a), fkv.allocate(b)
    for v in src:
        v.copy_(torch.randn(v.shape))
    dst_before = [d.clone() for d in dst]
    with pytest.raises(FkvError) as e:
        LayerMove(src, a, dst, b)([3, 1], [0, 0])
    assert str(e.value) == ("'dst_block_ids' repeats block 0: two tokens would land in one slot "
                            "(the last write wins); pass each destination block once")
    assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(dst, dst_before))
    src_before = [v.clone() for v in src]
    with pytest.raises(FkvError) as e:
        LayerMove(src, a, src, a)([1, 2], [2, 3])
    assert str(e.value) == ("'dst_block_ids' holds block 2, which 'src_block_ids' also holds, and "
                            "'dst' is 'src' itself: the move would overwrite tokens it still "
                            "reads; move into blocks that are not sources (or through a separate "
                            "buffer)")
    assert all(torch.equal(x, y) for x, y in zip(src, src_before))
    LayerMove(src, a, src, a, src_heads=(0, 2), dst_heads=(2, 4))([1, 2], [2, 1])
    for layer in range(a.num_layers):
        expected = src_before[layer].clone()
        fkv.ops.reference.move(src_before[layer], a, [1, 2], expected, a, [2, 1],
                               src_heads=(0, 2), dst_heads=(2, 4))
        assert torch.equal(src[layer], expected), layer


def test_layer_move_validate_must_be_a_bool_or_none() -> None:
    a, b = CASES["NHD-HND"]
    with pytest.raises(FkvError) as e:
        LayerMove(fkv.allocate(a), a, fkv.allocate(b), b)([5], [2], validate="no")
    assert str(e.value) == "'validate' must be True, False or None (None: the default) (got 'no')"


@pytest.mark.parametrize("case", ["NHD-HND", "HND-NHD-rechunk", "cross-dst"])
def test_a_prepared_move_moves_each_layer_range_as_a_call_does(case: str, device: str) -> None:
    """A streaming read prepares one request's move and calls it once per layer range: the bytes
    equal the reference's per layer, ranges repeat (a kept launch), layers not asked for stay."""
    a, b = CASES[case]
    host, src, dst, ref = _sides(a, b, device, 5)
    src_ids, dst_ids, tokens = [5, 1, 3], [2, 0] if b.block_size == 8 else [4, 0, 2], 11
    moves = LayerMove(src, a, dst, b, src_heads=(2, 4), dst_heads=(0, 2))
    prepared = moves.prepare(torch.tensor(src_ids, device=device),
                             torch.tensor(dst_ids, device=device), tokens, validate=False)

    def same(layer: int) -> bool:
        return torch.equal(dst[layer].cpu().nan_to_num(7.0), ref[layer].nan_to_num(7.0))

    for layers in [(1, 2), (1, 2), (0, 1)]:
        prepared(layers)
        for layer in range(*layers):
            fkv.ops.reference.move(host[layer], a, src_ids, ref[layer], b, dst_ids,
                                   src_heads=(2, 4), dst_heads=(0, 2), num_tokens=tokens)
        assert all(same(layer) for layer in range(3))
    assert torch.isnan(dst[2].cpu()).all()  # layer 2 was never asked for
    prepared()  # every layer
    fkv.ops.reference.move(host[2], a, src_ids, ref[2], b, dst_ids, src_heads=(2, 4),
                           dst_heads=(0, 2), num_tokens=tokens)
    assert all(same(layer) for layer in range(3))
    prepared((3, 3))  # an empty range moves nothing


def test_a_prepared_move_checks_its_ids_once_and_each_layer_range() -> None:
    """``prepare`` refuses what a call refuses, before anything moves; a layer range is checked
    on every call, and one of bools never passes as the ints it equals."""
    a, b = CASES["NHD-HND"]
    src, dst = fkv.allocate(a), fkv.allocate(b)
    for v in src:
        v.copy_(torch.randn(v.shape))
    before = [d.clone() for d in dst]
    moves = LayerMove(src, a, dst, b)
    with pytest.raises(FkvError) as e:
        moves.prepare([3, 1], [0, 0])
    assert str(e.value) == ("'dst_block_ids' repeats block 0: two tokens would land in one slot "
                            "(the last write wins); pass each destination block once")
    with pytest.raises(FkvError) as e:
        moves.prepare([3, 9], [0, 1])
    assert str(e.value) == ("'src_block_ids' holds block id 9 but the cache has num_blocks=6 "
                            "(valid ids: 0..5)")
    with pytest.raises(FkvError) as e:
        moves.prepare([3], [0], 5)
    assert str(e.value) == ("'num_tokens' is 5 but the 1 src_block_ids hold only 4 tokens; pass "
                            "more block ids or fewer tokens")
    with pytest.raises(FkvError) as e:
        moves.prepare([3], [0], layers=(0, 4))
    assert str(e.value) == ("'layers' must be (start, stop) ints with 0 <= start <= stop <= 3 "
                            "(got (0, 4))")
    prepared = moves.prepare([3], [0])
    prepared((1, 2))
    prepared([1, 2])  # a list, as a call takes it
    for layers in [(True, 2), (0, 4), (1,), (2, 1)]:
        with pytest.raises(FkvError) as e:
            prepared(layers)
        assert str(e.value) == (f"'layers' must be (start, stop) ints with 0 <= start <= stop <= "
                                f"3 (got {layers!r})")
    assert torch.equal(dst[0].nan_to_num(7.0), before[0].nan_to_num(7.0))
    assert torch.equal(dst[2].nan_to_num(7.0), before[2].nan_to_num(7.0))


def test_launch_move_with_layers_at_a_fixed_stride_on_both_sides(device: str) -> None:
    """The kernel's stride mode (a packed read's staging side): layer ``l`` of each side at
    ``ptr + l * stride`` elements, not a table. Every layer lands where the per-layer reference
    puts it (each layer's own source, the gaps between layers untouched)."""
    from fkv.ops._move_kernel import launch_move

    a, b = CASES["HND-NHD-rechunk"]
    one_a, one_b = a.evolve(num_layers=1), b.evolve(num_layers=1)
    step_a = one_a.region_bytes // one_a.itemsize + 8  # a gap after each layer
    step_b = one_b.region_bytes // one_b.itemsize + 8
    g = torch.Generator().manual_seed(6)
    src_buf = torch.randn(a.num_layers * step_a, generator=g).to(torch.bfloat16)
    dst_buf = torch.full((a.num_layers * step_b,), float("nan"), dtype=torch.bfloat16)
    ref_buf = dst_buf.clone()

    def layer(buf: torch.Tensor, spec: fkv.KVCacheSpec, step: int, i: int) -> torch.Tensor:
        return buf.as_strided(spec.logical_shape, spec.element_strides, i * step)

    src_ids, dst_ids, tokens = [5, 1, 3], [2, 0], 11
    src_dev, dst_dev = src_buf.to(device), dst_buf.to(device)
    launch_move(layer(src_dev, one_a, step_a, 0), one_a, torch.tensor(src_ids, device=device), 2,
                layer(dst_dev, one_b, step_b, 0), one_b, torch.tensor(dst_ids, device=device), 0,
                2, tokens, layers=(a.num_layers, step_a, step_b))
    for i in range(a.num_layers):
        fkv.ops.reference.move(layer(src_buf, one_a, step_a, i), one_a, src_ids,
                               layer(ref_buf, one_b, step_b, i), one_b, dst_ids,
                               src_heads=(2, 4), dst_heads=(0, 2), num_tokens=tokens)
    assert torch.equal(dst_dev.cpu().view(torch.int16), ref_buf.view(torch.int16))
    assert not ref_buf[:step_b].isnan().all() and ref_buf[-8:].isnan().all()


@pytest.mark.gpu
def test_a_prepared_move_launches_a_repeated_range_directly() -> None:
    """On a GPU the second call of a layer range goes straight to the compiled launcher (the
    addresses read once), with the bytes of the first."""
    a, b = CASES["NHD-HND"]
    src, dst = fkv.allocate(a, "cuda"), fkv.allocate(b, "cuda")
    for v in src:
        v.copy_(torch.randn(v.shape, device="cuda"))
    prepared = LayerMove(src, a, dst, b).prepare(torch.tensor([5, 1], device="cuda"),
                                                 torch.tensor([2, 0], device="cuda"), 8)
    prepared((1, 2))
    prepared((1, 2))  # a fresh process's first launches go through Triton's binder (kept then)
    site = prepared._launches[(1, 2)][0]
    before = site.direct_launches
    for v in dst:
        v.zero_()
    prepared((1, 2))
    assert site.direct_launches == before + 1
    ref = [v.zero_() for v in fkv.allocate(b)]  # allocate does not clear
    fkv.ops.reference.move(src[1].cpu(), a, [5, 1], ref[1], b, [2, 0], num_tokens=8)
    assert torch.equal(dst[1].cpu(), ref[1])
    assert not dst[0].any() and not dst[2].any()


@settings(max_examples=20, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)).map(sorted).map(tuple),
                       min_size=1, max_size=4),
       seed=st.integers(0, 2 ** 16))
def test_prepared_layer_ranges_in_any_order_land_the_reference_bytes(
        ranges: list[tuple[int, int]], seed: int) -> None:
    """Property: any sequence of layer ranges (repeated, overlapping, empty) through one prepared
    move leaves exactly the reference's bytes in the layers covered so far, and the others
    untouched (the Triton kernel under the CPU interpreter)."""
    a, b = CASES["HND-NHD-rechunk"]
    g = torch.Generator().manual_seed(seed)
    src = fkv.allocate(a)
    for v in src:
        v.copy_(torch.randn(v.shape, generator=g))
    dst, ref = fkv.allocate(b), fkv.allocate(b)
    for v in dst + ref:
        v.fill_(float("nan"))
    src_ids, dst_ids = torch.randperm(6, generator=g)[:3], torch.randperm(3, generator=g)[:2]
    tokens = int(torch.randint(1, 13, (1,), generator=g))
    used = -(-tokens // 8)
    prepared = LayerMove(src, a, dst, b, src_heads=(1, 3), dst_heads=(2, 4)).prepare(
        src_ids[:-(-tokens // 4)], dst_ids[:used], tokens)
    covered: set[int] = set()
    for start, stop in ranges:
        prepared((start, stop))
        covered |= set(range(start, stop))
    for layer in sorted(covered):
        fkv.ops.reference.move(src[layer], a, src_ids[:-(-tokens // 4)], ref[layer], b,
                               dst_ids[:used], src_heads=(1, 3), dst_heads=(2, 4),
                               num_tokens=tokens)
    for layer in range(3):
        assert torch.equal(dst[layer].nan_to_num(7.0), ref[layer].nan_to_num(7.0)), layer


# -- the checks of the two sides, each message exact (mutation audit of fkv/ops/layers.py) -------

def _refusal(*args, **kwargs) -> str:
    with pytest.raises(FkvError) as e:
        LayerMove(*args, **kwargs)
    return str(e.value)


def test_layer_move_names_each_bad_side_exactly() -> None:
    a, b = CASES["NHD-HND"]
    src, dst = fkv.allocate(a), fkv.allocate(b)
    assert _refusal(src, "NHD", dst, b) == "'src_spec' must be a KVCacheSpec (got 'str')"
    assert _refusal(src, a, dst, None) == "'dst_spec' must be a KVCacheSpec (got 'NoneType')"
    assert _refusal([], a, dst, b) == "'src' must be a non-empty list of layer views (got 'list')"
    assert _refusal(src, a, "dst", b) == "'dst' must be a non-empty list of layer views (got 'str')"
    assert _refusal([src[0], "x"], a, dst, b) == "'src[1]' must be a tensor (got 'str')"
    hnd_as_nhd = fkv.allocate(a)[2]
    assert _refusal(src, a, [dst[0], dst[1], hnd_as_nhd], b).startswith(
        f"'dst[2]' has strides {tuple(hnd_as_nhd.stride())} but spec ")
    assert _refusal(src, a, fkv.allocate(b.evolve(dtype="float16")), b.evolve(dtype="float16")) == (
        "LayerMove: src and dst must agree on dtype: src_spec.dtype is 'bfloat16', dst_spec.dtype "
        "is 'float16'")
    mla = a.evolve(backend="mla", num_kv_heads=1)
    not_mla = a.evolve(num_kv_heads=1)
    assert _refusal(fkv.allocate(mla), mla, fkv.allocate(not_mla), not_mla) == (
        "LayerMove: src and dst must agree on is_mla: src_spec.is_mla is True, dst_spec.is_mla "
        "is False")


def test_layer_move_refuses_layers_on_other_devices() -> None:
    """Every layer of a side on one device, and both sides on the same one (``meta`` stands in
    for a second device on a CPU-only machine)."""
    a, b = CASES["NHD-HND"]
    src, meta = fkv.allocate(a), fkv.allocate(a, "meta")
    assert _refusal([src[0], meta[1], src[2]], a, fkv.allocate(b), b) == (
        "'src': layer 1 is on meta but layer 0 on cpu; all layers must be on one device")
    assert _refusal(src, a, fkv.allocate(b, "meta"), b) == (
        "'src' is on cpu but 'dst' on meta; map or move the source to the destination's device "
        "first")


def test_layer_move_of_one_tensor_is_a_one_layer_move(device: str) -> None:
    """A single view (not a list) is one layer."""
    a, b = (s.evolve(num_layers=1) for s in CASES["NHD-HND"])
    host, src, dst, ref = _sides(a, b, device, 8)
    mover = LayerMove(src[0], a, dst[0], b)
    assert mover.num_layers == 1
    mover([5, 1], [2, 0], 7)
    fkv.ops.reference.move(host[0], a, [5, 1], ref[0], b, [2, 0], num_tokens=7)
    assert torch.equal(dst[0].cpu().nan_to_num(7.0), ref[0].nan_to_num(7.0))


def test_layer_tables_hold_element_offsets_from_layer_zero() -> None:
    """The device tables hold each layer's offset from layer 0 in elements of its own dtype
    (int64: peer mappings may lie far apart); views a fraction of an element apart are refused."""
    a = BASE.evolve(backend="flash_attn", cross_layer=True, dtype="float32")  # layers 256 apart
    b = BASE.evolve(dtype="float32")
    src, dst = fkv.allocate(a), fkv.allocate(b)
    mover = LayerMove(src, a, dst, b)
    assert [t.dtype for t in mover._tables] == [torch.int64, torch.int64]
    assert mover._tables[0].tolist() == [0, 256, 512]
    assert mover._tables[1].tolist() == [(v.data_ptr() - dst[0].data_ptr()) // 4 for v in dst]
    one = b.evolve(num_layers=2)
    buf = bytearray(2 * one.region_bytes + 8)
    count = one.region_bytes // 4
    apart = [torch.frombuffer(buf, dtype=torch.float32, offset=o, count=count).as_strided(
        one.logical_shape, one.element_strides) for o in (0, one.region_bytes + 2)]
    assert _refusal(apart, one, fkv.allocate(one), one) == (
        "LayerMove: layer views must lie a whole number of elements apart")


def test_disjoint_heads_of_one_view_may_move_either_way() -> None:
    """A dst view that is a src view itself is aliased only where the head ranges overlap:
    heads (2, 4) -> (0, 2) of the same blocks may move, as (0, 2) -> (2, 4) may."""
    a = CASES["NHD-HND"][0]
    src = fkv.allocate(a)
    for v in src:
        v.copy_(torch.randn(v.shape))
    before = [v.clone() for v in src]
    mover = LayerMove(src, a, src, a, src_heads=(2, 4), dst_heads=(0, 2))
    assert mover._aliased is False
    mover([1, 2], [2, 1])
    for layer in range(a.num_layers):
        expected = before[layer].clone()
        fkv.ops.reference.move(before[layer], a, [1, 2], expected, a, [2, 1],
                               src_heads=(2, 4), dst_heads=(0, 2))
        assert torch.equal(src[layer], expected), layer
    assert LayerMove(src, a, src, a, src_heads=(1, 3), dst_heads=(0, 2))._aliased is True


def test_default_token_count_is_the_source_blocks_capacity(device: str) -> None:
    """Without ``num_tokens`` every token of the source blocks moves (3 blocks of 4 into 2 of 8);
    destination blocks too few for them are refused, not silently filled."""
    a, b = CASES["HND-NHD-rechunk"]
    host, src, dst, ref = _sides(a, b, device, 9)
    LayerMove(src, a, dst, b)([5, 1, 3], [2, 0])
    for layer in range(a.num_layers):
        fkv.ops.reference.move(host[layer], a, [5, 1, 3], ref[layer], b, [2, 0], num_tokens=12)
        assert torch.equal(dst[layer].cpu().nan_to_num(7.0), ref[layer].nan_to_num(7.0)), layer
    with pytest.raises(FkvError) as e:
        LayerMove(src, a, dst, b)([5, 1, 3], [2])
    assert str(e.value) == ("'num_tokens' is 12 but the 1 dst_block_ids hold only 8 tokens; pass "
                            "more block ids or fewer tokens")


def test_a_range_of_bools_never_reuses_the_launch_of_its_ints() -> None:
    a, b = CASES["NHD-HND"]
    prepared = LayerMove(fkv.allocate(a), a, fkv.allocate(b), b).prepare([3], [0])
    prepared((0, 1))
    for layers in [(0, True), (False, 1)]:
        with pytest.raises(FkvError) as e:
            prepared(layers)
        assert str(e.value) == (f"'layers' must be (start, stop) ints with 0 <= start <= stop <= "
                                f"3 (got {layers!r})")


@pytest.mark.interpreter  # CPU only: with CUDA, conftest deselects it (no interpreter there)
def test_the_interpreter_runs_the_kernel_not_the_reference_loop() -> None:
    """Under ``TRITON_INTERPRET=1`` (conftest sets it without CUDA) a CPU LayerMove launches the
    Triton kernel (its launch kept per layer range), so the kernel tests above compare the
    kernel, not the reference, against the reference."""
    a, b = CASES["NHD-HND"]
    mover = LayerMove(fkv.allocate(a), a, fkv.allocate(b), b)
    assert mover.triton is True
    prepared = mover.prepare([3], [0])
    prepared((1, 3))
    assert list(prepared._launches) == [(1, 3)]


def test_cpu_without_the_interpreter_loops_over_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU outside ``TRITON_INTERPRET=1`` each layer of the range goes through
    ``fkv.ops.reference.move`` (heads, token count and range kept; nothing launched or kept)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a, b = CASES["HND-NHD-rechunk"]
    host, src, dst, ref = _sides(a, b, "cpu", 10)
    mover = LayerMove(src, a, dst, b, src_heads=(1, 3), dst_heads=(2, 4))
    assert mover.triton is False
    prepared = mover.prepare([5, 1, 3], [2, 0], 9)
    prepared((1, 2))
    assert prepared._launches == {}
    fkv.ops.reference.move(host[1], a, [5, 1, 3], ref[1], b, [2, 0], src_heads=(1, 3),
                           dst_heads=(2, 4), num_tokens=9)
    for layer in range(3):
        assert torch.equal(dst[layer].nan_to_num(7.0), ref[layer].nan_to_num(7.0)), layer
    assert torch.isnan(dst[0]).all() and torch.isnan(dst[2]).all()
