"""fkv.ops.convert: convert / gather / scatter / move against the references and independent oracles.

Oracles: ``fkv.ops.reference`` (token-level torch indexing), ``einops.rearrange`` with
``fkv.rearrange_pattern`` over physical buffers, and ``fkv.testing.assert_kv_equal`` / ``token_major``
(what a cache means, token by token). Outputs are poisoned with random bits first, and compared
bitwise (payloads are random bit patterns, NaNs included), so an unwritten element shows.
"""

from __future__ import annotations

import importlib
import itertools
import random

import einops
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import fkv
from fkv import FkvError, KVCacheSpec, rearrange_pattern
from fkv.ops import _move_kernel as MK
from fkv.ops import reference as R
from fkv.testing import assert_kv_equal, token_major

C = importlib.import_module("fkv.ops.relayout")
RC = importlib.import_module("fkv.ops.reference._convert")

GEOM = dict(num_blocks=8, block_size=4, num_kv_heads=4, head_size=8, num_layers=2)
KV_SPECS = [KVCacheSpec(backend=b, layout=lay, cross_layer=c, **GEOM)
            for b in ("triton", "flashinfer", "flash_attn") for lay in ("NHD", "HND")
            for c in (False, True)]
MLA_SPECS = [KVCacheSpec(backend="mla", cross_layer=c, num_blocks=8, block_size=4, num_kv_heads=1,
                         head_size=24, num_layers=2) for c in (False, True)]
PAIRS = list(itertools.product(KV_SPECS, KV_SPECS)) + list(itertools.product(MLA_SPECS, MLA_SPECS))
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _name(spec: KVCacheSpec) -> str:
    return f"{spec.backend}-{spec.layout.value}{'-xl' if spec.cross_layer else ''}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def _fill(views: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random bit patterns in every element (NaN payloads included: copies must be bit-exact)."""
    g = torch.Generator().manual_seed(seed)
    for v in views:
        lo, hi = (0, 256) if v.element_size() == 1 else (-(1 << 15), 1 << 15)
        _bits(v).copy_(torch.randint(lo, hi, v.shape, generator=g, dtype=torch.int32))
    return views


def _cache(spec: KVCacheSpec, device: str, seed: int) -> list[torch.Tensor]:
    return _fill(fkv.allocate(spec, device=device), seed)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a).cpu(), _bits(b).cpu())


def _clone(views: list[torch.Tensor], spec: KVCacheSpec) -> list[torch.Tensor]:
    out = fkv.allocate(spec, device=views[0].device)
    for o, v in zip(out, views):
        _bits(o).copy_(_bits(v))
    return out


def _physical(views: list[torch.Tensor], spec: KVCacheSpec) -> torch.Tensor:
    """One side of a rearrange pattern: the stack of layer buffers, or the cross-layer buffer."""
    if spec.cross_layer:
        return torch.stack([_bits(v) for v in views]).permute(spec.stride_order)
    return torch.stack([_bits(v).permute(spec.stride_order) for v in views])


# -- convert --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("src_spec", "dst_spec"), PAIRS,
                         ids=[f"{_name(a)}->{_name(b)}" for a, b in PAIRS])
def test_convert_every_pair(device, src_spec, dst_spec):
    src = _cache(src_spec, device, seed=1)
    before = [_bits(v).clone() for v in src]
    out = C.convert(src, src_spec, dst_spec)
    assert len(out) == dst_spec.num_layers
    for layer, view in enumerate(out):
        assert tuple(view.shape) == dst_spec.logical_shape
        assert view.stride() == dst_spec.element_strides
        assert view.device.type == device
        step = dst_spec.layer_stride * view.element_size() if dst_spec.cross_layer else None
        if step is not None:
            assert view.data_ptr() - out[0].data_ptr() == layer * step
    expected = einops.rearrange(_physical(src, src_spec), rearrange_pattern(src_spec, dst_spec))
    assert _equal(_physical(out, dst_spec), expected)
    ref = R.convert(src, src_spec, dst_spec)
    assert all(_equal(a, b) for a, b in zip(out, ref))
    assert_kv_equal(src, src_spec, out, dst_spec)
    assert all(torch.equal(_bits(v), b) for v, b in zip(src, before))  # src untouched


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float32", "float16"])
def test_convert_dtypes_bit_exact(device, dtype):
    a = KV_SPECS[0].evolve(dtype=dtype)  # triton NHD
    b = KV_SPECS[-1].evolve(dtype=dtype)  # flash_attn HND cross-layer
    src = _cache(a, device, seed=2)
    out = _fill(fkv.allocate(b, device=device), seed=3)
    assert C.convert(src, a, b, out=out) is out
    assert all(_equal(x, y) for x, y in zip(out, R.convert(src, a, b)))
    back = C.convert(out, b, a)
    assert all(_equal(x, y) for x, y in zip(back, src))


def test_convert_single_tensor_and_out(device):
    a = KV_SPECS[0].evolve(num_layers=1)
    b = KV_SPECS[3].evolve(num_layers=1)  # triton HND cross-layer, one layer
    (src,) = _cache(a, device, seed=4)
    res = C.convert(src, a, b)
    assert isinstance(res, torch.Tensor) and res.stride() == b.element_strides
    assert _equal(res, R.convert(src, a, b))
    (out,) = _cache(b, device, seed=5)
    assert C.convert(src, a, b, out=out) is out
    assert _equal(out, res)


@pytest.mark.parametrize(("src_spec", "dst_spec"), [(KV_SPECS[0], KV_SPECS[11]),
                                                    (KV_SPECS[11], KV_SPECS[2]),
                                                    (MLA_SPECS[0], MLA_SPECS[1])],
                         ids=["triton-NHD->fa-HND-xl", "fa-HND-xl->triton-HND", "mla->mla-xl"])
def test_convert_block_subset_in_place(device, src_spec, dst_spec):
    src = _cache(src_spec, device, seed=6)
    out = _cache(dst_spec, device, seed=7)
    expected = _clone(out, dst_spec)
    ids = torch.tensor([3, 0], device=device)
    R.convert(src, src_spec, dst_spec, out=expected, block_ids=[3, 0])
    assert C.convert(src, src_spec, dst_spec, out=out, block_ids=ids) is out
    assert all(_equal(x, y) for x, y in zip(out, expected))  # other blocks keep their poison
    assert_kv_equal(src, src_spec, out, dst_spec, block_ids_a=[3, 0], block_ids_b=[3, 0])
    untouched = [1, 2, 4, 5, 6, 7]
    with pytest.raises(AssertionError):
        assert_kv_equal(src, src_spec, out, dst_spec, block_ids_a=untouched, block_ids_b=untouched)


# -- gather / scatter -----------------------------------------------------------------------------
def _draw(spec: KVCacheSpec, seed: int) -> tuple[list[int], tuple[int, int]]:
    rng = random.Random(seed)
    ids = rng.sample(range(spec.num_blocks), 3)
    a = rng.randrange(spec.num_kv_heads)
    return ids, (a, rng.randrange(a + 1, spec.num_kv_heads + 1))


def _staging_oracle(cache: torch.Tensor, spec: KVCacheSpec, ids, heads) -> torch.Tensor:
    tok = token_major(cache, spec, ids, heads)  # [n*N, 2, h, D] (mla: [n*N, 1, 1, D])
    if spec.is_mla:
        return einops.rearrange(tok, "(n N) a b C -> n (a b N) C", N=spec.block_size)
    return einops.rearrange(tok, "(n N) two h C -> n two h N C", N=spec.block_size)


@pytest.mark.parametrize("spec", KV_SPECS + MLA_SPECS, ids=_name)
def test_gather_scatter_round_trip(device, spec):
    ids, heads = _draw(spec, seed=hash(_name(spec)) % 1000)
    if spec.is_mla:
        heads = None
    layer = spec.num_layers - 1  # a cross-layer view with a non-zero offset
    cache = _cache(spec, device, seed=8)
    staging = C.gather(cache[layer], spec, torch.tensor(ids, device=device), heads=heads)
    h = spec.num_kv_heads if heads is None else heads[1] - heads[0]
    shape = (3, spec.block_size, spec.head_size) if spec.is_mla else (3, 2, h, spec.block_size,
                                                                     spec.head_size)
    assert tuple(staging.shape) == shape and staging.is_contiguous()
    assert _equal(staging, _staging_oracle(cache[layer], spec, ids, heads))
    assert _equal(staging, R.gather(cache[layer], spec, ids, heads=heads))
    # into out=, poisoned first
    out = _fill([torch.empty_like(staging)], seed=9)[0]
    assert C.gather(cache[layer], spec, ids, heads=heads, out=out) is out
    assert _equal(out, staging)

    # scatter into a poisoned cache of every other layout of the same family, other blocks/heads
    for other in (MLA_SPECS if spec.is_mla else KV_SPECS[::3]):
        dst = _cache(other, device, seed=10)
        expected = _clone(dst, other)
        dst_ids = [4, 1, 2]
        dst_heads = None if heads is None else (other.num_kv_heads - h, other.num_kv_heads)
        C.scatter(staging, dst[0], other, dst_ids, heads=dst_heads)
        R.scatter(staging, expected[0], other, dst_ids, heads=dst_heads)
        assert all(_equal(x, y) for x, y in zip(dst, expected))  # untouched elements kept
        assert_kv_equal(cache[layer], spec.evolve(num_layers=1), dst[0], other.evolve(num_layers=1),
                        block_ids_a=ids, block_ids_b=dst_ids, heads_a=heads, heads_b=dst_heads)


def test_gather_empty_and_zero_tokens(device):
    spec = KV_SPECS[1]
    cache = _cache(spec, device, seed=11)
    empty = C.gather(cache[0], spec, [], heads=(1, 3))
    assert tuple(empty.shape) == (0, 2, 2, spec.block_size, spec.head_size)
    before = _bits(cache[0]).clone()
    C.scatter(empty, cache[0], spec, [], heads=(1, 3))
    C.move(cache[0], spec, [1], cache[1], spec, [2], num_tokens=0)
    assert torch.equal(_bits(cache[0]), before)


# -- move: re-chunking between block sizes ---------------------------------------------------------
@pytest.mark.parametrize(("n_src", "n_dst"), [(4, 8), (8, 4)])
@pytest.mark.parametrize("kind", ["kv", "mla"])
def test_move_rechunk(device, n_src, n_dst, kind):
    base = KV_SPECS[0] if kind == "kv" else MLA_SPECS[0]
    src_spec = base.evolve(block_size=n_src, num_blocks=6, num_layers=1)
    dst_spec = (KV_SPECS[11] if kind == "kv" else MLA_SPECS[1]).evolve(
        block_size=n_dst, num_blocks=7)
    src = _cache(src_spec, device, seed=12)[0]
    dst_views = _cache(dst_spec, device, seed=13)
    dst = dst_views[1]
    expected = _clone(dst_views, dst_spec)
    num_tokens = 13  # a partial last block on both sides
    src_ids = [5, 0, 3, 2] if n_src == 4 else [5, 0]
    dst_ids = [6, 1] if n_dst == 8 else [6, 1, 4, 3]
    heads = {} if kind == "mla" else dict(src_heads=(0, 2), dst_heads=(2, 4))
    C.move(src, src_spec, torch.tensor(src_ids, device=device), dst, dst_spec, dst_ids,
           num_tokens=num_tokens, **heads)
    RC.move(src, src_spec, src_ids, expected[1], dst_spec, dst_ids, num_tokens=num_tokens, **heads)
    assert all(_equal(x, y) for x, y in zip(dst_views, expected))
    one = dict(num_layers=1, cross_layer=False)
    assert_kv_equal(src, src_spec, dst, dst_spec.evolve(**one), block_ids_a=src_ids,
                    block_ids_b=dst_ids, num_tokens=num_tokens,
                    heads_a=heads.get("src_heads"), heads_b=heads.get("dst_heads"))
    # tokens 13.. of the destination blocks still hold their poison
    tail = token_major(dst, dst_spec.evolve(**one), dst_ids)[num_tokens:]
    ref_tail = token_major(_cache(dst_spec, device, seed=13)[1], dst_spec.evolve(**one), dst_ids)
    assert _equal(tail, ref_tail[num_tokens:])


@pytest.mark.parametrize(("n_cache", "n_stage"), [(4, 8), (8, 4)])
def test_gather_scatter_rechunk(device, n_cache, n_stage):
    spec = KV_SPECS[2].evolve(block_size=n_cache, num_blocks=6, num_layers=1)  # triton HND
    cache = _cache(spec, device, seed=14)[0]
    ids = [4, 1, 5, 0] if n_cache == 4 else [4, 1]
    staging = C.gather(cache, spec, ids, heads=(1, 3), block_size=n_stage, num_tokens=11)
    n_blocks = -(-11 // n_stage)
    assert tuple(staging.shape) == (n_blocks, 2, 2, n_stage, spec.head_size)
    assert _equal(staging, R.gather(cache, spec, ids, heads=(1, 3), block_size=n_stage,
                                    num_tokens=11))
    tok = einops.rearrange(staging, "m two h N C -> (m N) two h C")
    assert _equal(tok[:11], token_major(cache, spec, ids, (1, 3), 11))
    assert not bool(_bits(tok[11:]).any())  # gather zero-fills the staging tail it allocates
    other = KV_SPECS[6].evolve(block_size=n_cache, num_blocks=6, num_layers=1)  # flash_attn NHD
    dst = _cache(other, device, seed=15)[0]
    expected = _clone([dst], other)[0]
    C.scatter(staging, dst, other, ids[::-1], heads=(0, 2), block_size=n_stage, num_tokens=11)
    R.scatter(staging, expected, other, ids[::-1], heads=(0, 2), block_size=n_stage,
              num_tokens=11)
    assert _equal(dst, expected)
    assert_kv_equal(cache, spec, dst, other, block_ids_a=ids, block_ids_b=ids[::-1], num_tokens=11,
                    heads_a=(1, 3), heads_b=(0, 2))


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_move_matches_reference_property(device, data):
    """Random layouts, block sizes (1..8), head counts (odd too), head sizes, ids and head ranges."""
    backend = data.draw(st.sampled_from(["triton", "flash_attn", "mla"]))
    heads = 1 if backend == "mla" else data.draw(st.sampled_from([1, 3, 4]))
    head_size = data.draw(st.sampled_from([4, 12]))

    def spec() -> KVCacheSpec:
        return KVCacheSpec(backend=data.draw(st.sampled_from(["triton", "flash_attn"]))
                           if backend != "mla" else "mla",
                           layout=data.draw(st.sampled_from(["NHD", "HND"])),
                           cross_layer=data.draw(st.booleans()),
                           num_blocks=data.draw(st.integers(2, 6)),
                           block_size=data.draw(st.sampled_from([1, 2, 4, 8])),
                           num_kv_heads=heads, head_size=head_size,
                           num_layers=data.draw(st.integers(1, 2)))

    a, b = spec(), spec()
    src_ids = data.draw(st.lists(st.integers(0, a.num_blocks - 1), min_size=1, max_size=4))
    cap = len(src_ids) * a.block_size
    n = data.draw(st.integers(0, cap))
    need = -(-n // b.block_size)
    b = b.evolve(num_blocks=max(b.num_blocks, need))
    dst_ids = data.draw(st.permutations(range(b.num_blocks)))[:need]
    h = data.draw(st.integers(1, heads))
    sh, dh = data.draw(st.integers(0, heads - h)), data.draw(st.integers(0, heads - h))
    src = _cache(a, device, seed=16)[-1]
    dst = _cache(b, device, seed=17)
    expected = _clone(dst, b)
    kw = dict(src_heads=(sh, sh + h), dst_heads=(dh, dh + h), num_tokens=n)
    C.move(src, a, src_ids, dst[0], b, dst_ids, **kw)
    RC.move(src, a, src_ids, expected[0], b, dst_ids, **kw)
    assert all(_equal(x, y) for x, y in zip(dst, expected))


class _AtenOps(TorchDispatchMode):
    """The names of the aten ops run inside the block (views and detaches included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


#: What the CPU reference's data movement may ask of torch: reinterpreting and permuting views
#: (and the detach behind ``Tensor.numpy``); no index/index_put/copy_, nothing parallel.
_VIEW_OPS = {"aten.view.dtype", "aten.permute.default", "aten.detach.default"}


def _canon(t: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """The test's own canonical view: (B, two, N, H, C); mla (B, N, C)."""
    axes = spec.logical_axes
    return _bits(t).permute([axes.index(a) for a in ("B", "two", "N", "H", "C") if a in axes])


def _token_copy(src, a, src_ids, dst, b, dst_ids, heads, n):
    """Oracle: one token at a time with plain (int and slice) indexing, no index arrays."""
    s, d = _canon(src, a), _canon(dst, b)
    for i in range(n):
        sb = i // a.block_size if src_ids is None else src_ids[i // a.block_size]
        db = i // b.block_size if dst_ids is None else dst_ids[i // b.block_size]
        ss, ds = i % a.block_size, i % b.block_size
        if a.is_mla:
            d[db, ds] = s[sb, ss]
        else:
            (sa, sz), (da, dz) = heads
            d[db, :, ds, da:dz] = s[sb, :, ss, sa:sz]


@pytest.mark.parametrize("whole_blocks", [False, True], ids=["any", "whole-blocks"])
@pytest.mark.parametrize("seed", range(8))
def test_cpu_reference_moves_without_torch_indexing(monkeypatch, seed, whole_blocks):
    """On CPU the reference move/gather/scatter move data through numpy views: inside ``_run`` no
    aten op but views runs (so no index/index_put parallel region of torch's intra-op pool, which
    processes sharing a host's cores oversubscribe), under ``torch.set_num_threads(4)``; the bits
    are those of a token-by-token plain-indexing oracle and of the torch path the GPU keeps
    (random layouts, block sizes, heads, dtypes, partial blocks, id tensors of both widths).
    ``whole_blocks``: equal block sizes on both sides and every block moved as one slice (the
    path large blocks take), the partial last block token by token."""
    rnd = random.Random(seed)
    if whole_blocks:
        monkeypatch.setattr(RC, "_BLOCK_BYTES", 0)
    mla = seed % 4 == 3
    dtype = rnd.choice(["bfloat16", "float8_e4m3fn", "float32"])
    heads, head_size = 1 if mla else rnd.choice([1, 3, 4]), rnd.choice([4, 12])

    def spec() -> KVCacheSpec:
        return KVCacheSpec(backend="mla" if mla else rnd.choice(["triton", "flash_attn"]),
                           layout=rnd.choice(["NHD", "HND"]), cross_layer=rnd.random() < 0.5,
                           num_blocks=rnd.randint(3, 6), block_size=rnd.choice([1, 2, 4, 8]),
                           num_kv_heads=heads, head_size=head_size, dtype=dtype,
                           num_layers=2)

    a, b = spec(), spec()
    if whole_blocks:
        b = b.evolve(block_size=a.block_size)
    src_ids = rnd.choices(range(a.num_blocks), k=rnd.randint(1, 3))
    n = rnd.randint(1, len(src_ids) * a.block_size)
    need = -(-n // b.block_size)
    b = b.evolve(num_blocks=max(b.num_blocks, need))
    dst_ids = None if rnd.random() < 0.25 else rnd.sample(range(b.num_blocks), need)
    h = rnd.randint(1, heads)
    hs = ((sa := rnd.randint(0, heads - h)), sa + h), ((da := rnd.randint(0, heads - h)), da + h)
    id_dtype = rnd.choice([torch.int32, torch.int64])
    sid = torch.tensor(src_ids, dtype=id_dtype)
    did = None if dst_ids is None else torch.tensor(dst_ids, dtype=id_dtype)
    src = _cache(a, "cpu", seed=30 + seed)[1]
    dst = _cache(b, "cpu", seed=40 + seed)
    oracle, torch_path = _clone(dst, b), _clone(dst, b)
    _token_copy(src, a, src_ids, oracle[0], b, dst_ids, hs, n)
    kw = dict(src_heads=None if mla else hs[0], dst_heads=None if mla else hs[1])
    RC._run_torch(RC._check_move(src, a, sid, torch_path[0], b, did, num_tokens=n, **kw))
    assert all(_equal(x, y) for x, y in zip(torch_path, oracle))

    seen: list[set[str]] = []
    run = RC._run

    def watched(m):
        with _AtenOps() as ops:
            run(m)
        seen.append(ops.ops)

    monkeypatch.setattr(RC, "_run", watched)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        RC.move(src, a, sid, dst[0], b, did, num_tokens=n, **kw)
        assert all(_equal(x, y) for x, y in zip(dst, oracle))
        staging = RC.gather(dst[0], b, dst_ids, num_tokens=n, heads=kw["dst_heads"])
        back = _cache(a, "cpu", seed=50 + seed)
        expected = _clone(back, a)
        back_ids = rnd.sample(range(a.num_blocks), len(src_ids))
        _token_copy(oracle[0], b, dst_ids, expected[1], a, back_ids, hs[::-1], n)
        RC.scatter(staging, back[1], a, back_ids,
                   num_tokens=n, block_size=b.block_size, heads=kw["src_heads"])
    finally:
        torch.set_num_threads(threads)
    assert all(_equal(x, y) for x, y in zip(back, expected))
    assert len(seen) == 3 and all(ops and ops <= _VIEW_OPS for ops in seen), seen
    with _AtenOps() as ops:  # the watch sees torch's indexing where it runs
        RC._run_torch(RC._check_move(src, a, sid, torch_path[0], b, did, num_tokens=n, **kw))
    assert {"aten.index.Tensor", "aten.index_put_.default"} <= ops.ops



@st.composite
def _move_case(draw):
    """Two caches (layouts, backends, block sizes, heads, dtypes at random), the ids, heads and
    token count of one move between them; head size 64 with 16-token blocks makes blocks large
    enough for the CPU path's whole-block copies."""
    mla = draw(st.booleans())
    dtype = draw(st.sampled_from(["bfloat16", "float8_e4m3fn", "float32"]))
    heads = 1 if mla else draw(st.integers(1, 4))
    head_size = draw(st.sampled_from([4, 64]))

    def spec(num_blocks):
        return KVCacheSpec(backend="mla" if mla else draw(st.sampled_from(["triton", "flash_attn"])),
                           layout=draw(st.sampled_from(["NHD", "HND"])),
                           cross_layer=draw(st.booleans()), num_blocks=num_blocks,
                           block_size=draw(st.sampled_from([1, 4, 16])), num_kv_heads=heads,
                           head_size=head_size, dtype=dtype, num_layers=2)

    a = spec(draw(st.integers(2, 5)))
    b = spec(1)
    if draw(st.booleans()):
        b = b.evolve(block_size=a.block_size)
    src_ids = draw(st.none() | st.lists(st.integers(0, a.num_blocks - 1), min_size=1, max_size=3))
    cap = (a.num_blocks if src_ids is None else len(src_ids)) * a.block_size
    n = draw(st.integers(1, cap))
    need = -(-n // b.block_size)
    b = b.evolve(num_blocks=need + draw(st.integers(0, 2)))
    dst_ids = draw(st.none() | st.permutations(range(b.num_blocks)).map(lambda p: p[:need]))
    h = draw(st.integers(1, heads))
    src_h, dst_h = draw(st.integers(0, heads - h)), draw(st.integers(0, heads - h))
    id_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return a, b, src_ids, dst_ids, n, ((src_h, src_h + h), (dst_h, dst_h + h)), id_dtype


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_move_case())
def test_cpu_reference_move_matches_the_torch_path(case):
    """The CPU reference's numpy copies (whole blocks where block sizes agree, token chunks
    otherwise, channels or heads folded into one element) write exactly the bytes of the torch
    indexing path, everywhere in the destination."""
    a, b, src_ids, dst_ids, n, (sh, dh), id_dtype = case
    src = _cache(a, "cpu", seed=7)[0]
    dst = _cache(b, "cpu", seed=8)
    torch_path = _clone(dst, b)
    sid = None if src_ids is None else torch.tensor(src_ids, dtype=id_dtype)
    did = None if dst_ids is None else torch.tensor(dst_ids, dtype=id_dtype)
    kw = dict(src_heads=None if a.is_mla else sh, dst_heads=None if a.is_mla else dh)
    RC._run_torch(RC._check_move(src, a, sid, torch_path[0], b, did, num_tokens=n, **kw))
    RC._run_numpy(RC._check_move(src, a, sid, dst[0], b, did, num_tokens=n, **kw))
    assert all(_equal(x, y) for x, y in zip(dst, torch_path))

def test_block_id_checks_follow_in_place_changes(device):
    """Bounds of an id tensor are cached per tensor and version: an in-place edit is re-checked
    (also on the fast path of a repeated signature)."""
    spec = KV_SPECS[2]
    cache = _cache(spec, device, seed=20)
    ids = torch.tensor([7, 2], device=device)
    first = C.gather(cache[0], spec, ids, validate=True)
    assert _equal(C.gather(cache[0], spec, ids, validate=True), first)
    ids[1] = 8
    with pytest.raises(FkvError, match=r"'block_ids' holds block id 8"):
        C.gather(cache[0], spec, ids, validate=True)
    with torch.inference_mode():  # inference tensors have no version counter: checked every call
        frozen = torch.tensor([3, 9], device=device, dtype=torch.int32)
        with pytest.raises(FkvError, match=r"'block_ids' holds block id 9"):
            C.gather(cache[0], spec, frozen, validate=True)
        ok = torch.tensor([1], device=device, dtype=torch.int16)
        assert _equal(C.gather(cache[0], spec, ok, validate=True), R.gather(cache[0], spec, [1]))


# -- unchecked ids on the GPU: masked in the kernel --------------------------------------------------
def test_validation_default_checks_host_ids_only(device):
    """Default: ids on the host are range-checked (free); ids on the cache's GPU are not (that
    would sync) and out-of-range ones move nothing. validate=False skips the host check too."""
    spec = KV_SPECS[3]  # triton HND cross-layer
    cache = _cache(spec, device, seed=30)
    bad = torch.tensor([5, 8, -3, 1], device=device)
    if device == "cpu":
        with pytest.raises(FkvError, match=r"'block_ids' holds block id -3"):
            C.gather(cache[1], spec, bad, heads=(1, 3))
    out = _fill([torch.empty(4, 2, 2, spec.block_size, spec.head_size, dtype=cache[0].dtype,
                             device=device)], seed=31)[0]
    poison = _bits(out).clone()
    kw = {} if device == "cuda" else {"validate": False}
    assert C.gather(cache[1], spec, bad, heads=(1, 3), out=out, **kw) is out
    good = R.gather(cache[1], spec, [5, 1], heads=(1, 3))
    assert _equal(out[0], good[0]) and _equal(out[3], good[1])
    assert torch.equal(_bits(out[1:3]), poison[1:3])  # the bad blocks' staging left as it was
    # scatter and move: tokens of bad destination ids are not written anywhere
    dst = _cache(spec, device, seed=32)
    expected = _clone(dst, spec)
    C.scatter(out, dst[0], spec, torch.tensor([2, 9, 99, 6], device=device), heads=(0, 2), **kw)
    R.scatter(out[0:1], expected[0], spec, [2], heads=(0, 2))
    R.scatter(out[3:4], expected[0], spec, [6], heads=(0, 2))
    assert all(_equal(x, y) for x, y in zip(dst, expected))
    C.move(cache[0], spec, torch.tensor([1, 2], device=device), dst[1], spec,
           torch.tensor([-1, 4], device=device), **kw)
    RC.move(cache[0], spec, [2], expected[1], spec, [4])
    assert all(_equal(x, y) for x, y in zip(dst, expected))


GUARD = 2048  # bytes of random guard around a cache (4 blocks): a write or read past it shows


def _guarded(spec: KVCacheSpec, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw, view)``: one layer of ``spec`` (per-layer, one layer) inside random guard bytes;
    the cache's own bytes are random too."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (GUARD + spec.region_bytes + GUARD,), generator=g,
                        dtype=torch.uint8).to(device)
    (view,) = fkv.tensors.wrap(raw, spec, byte_offset=GUARD)
    return raw, view


@pytest.mark.parametrize("spec", [KV_SPECS[0], KV_SPECS[10], MLA_SPECS[0]], ids=_name)
def test_unchecked_ids_past_either_end_touch_nothing_outside_the_cache(device, spec):
    """validate=False: ids -1 and num_blocks (just past each end) and one far past it move
    nothing. A gather leaves their staging blocks as they were (nothing read from the guard
    bytes), a scatter writes only the good blocks' bytes (guard bytes around the cache kept)."""
    spec = spec.evolve(num_layers=1)
    nb = spec.num_blocks
    raw, cache = _guarded(spec, device, seed=40)
    heads = None if spec.is_mla else (1, 3)
    ids = torch.tensor([nb, 2, -1, nb + 5], device=device)
    staging = C.gather(cache, spec, torch.tensor([0, 2, 5, 7], device=device), heads=heads)
    poison = _bits(staging).clone()
    C.gather(cache, spec, ids, heads=heads, out=staging, validate=False)
    want = poison.clone()
    want[1] = _bits(R.gather(cache, spec, [2], heads=heads))[0]
    assert torch.equal(_bits(staging), want)  # blocks of bad ids keep what they held
    _fill([staging], seed=41)
    expected = raw.clone()
    (ref,) = fkv.tensors.wrap(expected, spec, byte_offset=GUARD)
    C.scatter(staging, cache, spec, ids, heads=heads, validate=False)
    R.scatter(staging[1:2], ref, spec, [2], heads=heads)
    assert torch.equal(raw, expected)
    # a move with both id lists: a bad id on either side drops the token, whatever the other
    dst = _cache(spec, device, seed=44)
    moved = _clone(dst, spec)
    kw = {} if spec.is_mla else dict(src_heads=(0, 2), dst_heads=(2, 4))
    C.move(cache, spec, torch.tensor([nb, 2, -1, 0], device=device), dst[0], spec,
           torch.tensor([1, 3, 4, nb], device=device), validate=False, **kw)
    RC.move(cache, spec, [2], moved[0], spec, [3], **kw)
    assert _equal(dst[0], moved[0])
    assert torch.equal(raw, expected)  # the source read only


@pytest.mark.parametrize(("src_spec", "dst_spec"), [(KV_SPECS[0], KV_SPECS[2]),
                                                    (MLA_SPECS[0], MLA_SPECS[0])],
                         ids=["triton-NHD->triton-HND", "mla->mla"])
def test_convert_with_a_partial_last_tile_writes_only_the_cache(device, src_spec, dst_spec):
    """A whole-cache convert of 6 blocks x 4 = 24 tokens: fewer than the 32 of one tile, so the
    tile's tail is masked (no ids: the only mask is the token count's). Guard bytes around the
    output stay as they were."""
    a, b = (s.evolve(num_blocks=6, num_layers=1) for s in (src_spec, dst_spec))
    assert MK.tile_config(24, a.num_kv_heads, a.head_size, a.itemsize)[0] == 32
    _, src = _guarded(a, device, seed=42)  # the tile's tail reads (unused) guard bytes
    raw, out = _guarded(b, device, seed=43)
    expected = raw.clone()
    (ref,) = fkv.tensors.wrap(expected, b, byte_offset=GUARD)
    C.convert([src], a, b, out=[out])
    R.convert([src], a, b, out=[ref])
    assert torch.equal(raw, expected)


@pytest.mark.parametrize("kind", ["move", "convert"])
def test_tiles_smaller_than_the_move_split_tokens_and_heads_over_programs(device, kind,
                                                                           monkeypatch):
    """32-byte tiles (the sweep's ``MAX_TILE_BYTES`` knob; big heads split like this by default):
    one token and 2 of the heads per program, so grid axes 0 and 2 have many programs and the
    last head tile of a 3-head move is half empty. Each program lands at its own offsets: the
    bytes are the reference's."""
    monkeypatch.setattr(MK, "MAX_TILE_BYTES", 32)
    a = KV_SPECS[0].evolve(num_layers=1)                           # triton NHD
    b = KV_SPECS[10].evolve(num_layers=1, block_size=8, num_blocks=5)  # flash_attn HND
    src = _cache(a, device, seed=45)[0]
    if kind == "convert":
        b = b.evolve(block_size=a.block_size, num_blocks=a.num_blocks)
        assert MK.tile_config(32, 4, a.head_size, a.itemsize, max_tile_bytes=32) == (1, 2, 8)
        assert all(_equal(x, y) for x, y in zip(C.convert([src], a, b), R.convert([src], a, b)))
        return
    assert MK.tile_config(13, 3, a.head_size, a.itemsize, max_tile_bytes=32) == (1, 2, 8)
    dst = _cache(b, device, seed=46)
    expected = _clone(dst, b)
    kw = dict(src_heads=(1, 4), dst_heads=(0, 3), num_tokens=13)
    C.move(src, a, torch.tensor([5, 0, 3, 2], device=device), dst[0], b, [4, 1], **kw)
    RC.move(src, a, [5, 0, 3, 2], expected[0], b, [4, 1], **kw)
    assert _equal(dst[0], expected[0])


def test_repeated_gather_scatter_take_the_fast_path(device):
    """A repeated signature skips the checks and launches directly; results stay those of the
    reference for new ids/staging, and anything else (other heads, a list, a float range) is
    checked again."""
    spec = KV_SPECS[6]  # flash_attn NHD
    cache = _cache(spec, device, seed=33)
    for seed in range(3):
        ids = torch.tensor(random.Random(seed).sample(range(8), 3), device=device)
        staging = C.gather(cache[1], spec, ids, heads=(1, 4))
        assert _equal(staging, R.gather(cache[1], spec, ids.tolist(), heads=(1, 4)))
        dst = _cache(spec, device, seed=34 + seed)
        expected = _clone(dst, spec)
        C.scatter(staging, dst[0], spec, ids.flip(0).contiguous(), heads=(0, 3))
        R.scatter(staging, expected[0], spec, ids.flip(0).tolist(), heads=(0, 3))
        assert all(_equal(x, y) for x, y in zip(dst, expected))
    fast = C._FAST[C._staging_signature("gather", cache[1], spec, ids, (1, 4), None, None, None)]
    assert fast.num_tokens == 3 * spec.block_size
    if device == "cuda":  # the compiled kernel was called directly after the first launch
        assert fast.site.direct_launches >= 2
    with pytest.raises(FkvError, match=r"'heads' must be a slice\(start, stop\) or a \(start, stop\) pair of ints"):
        C.gather(cache[1], spec, ids, heads=(1.0, 4))
    with pytest.raises(FkvError, match=r"'out' has dtype torch.float16"):
        C.gather(cache[1], spec, ids, heads=(1, 4), out=torch.empty_like(staging, dtype=torch.float16))
    with pytest.raises(FkvError, match=r"'block_ids' holds block id 8"):
        C.gather(cache[1], spec, [1, 8, 2], heads=(1, 4))


# -- bad inputs: FkvError before anything is written ----------------------------------------------
@pytest.fixture
def small(device):
    spec = KV_SPECS[0]
    return spec, _cache(spec, device, seed=18)


def test_bad_block_ids(small):
    spec, cache = small
    before = _bits(cache[1]).clone()
    with pytest.raises(FkvError, match=r"'dst_block_ids' holds block id 8 but the cache has "
                                       r"num_blocks=8 \(valid ids: 0..7\)"):
        C.move(cache[0], spec, [0, 1], cache[1], spec, [0, 8])
    with pytest.raises(FkvError, match=r"'block_ids' holds block id -1"):
        C.gather(cache[0], spec, torch.tensor([2, -1], device=cache[0].device), validate=True)
    with pytest.raises(FkvError, match=r"'block_ids' holds block id -1"):
        C.gather(cache[0], spec, torch.tensor([2, -1]))  # host-side ids: checked by default
    with pytest.raises(FkvError, match=r"'block_ids' must be a 1-D sequence or tensor of int "
                                       r"block ids \(got \[0.5\]\)"):
        C.gather(cache[0], spec, [0.5])
    with pytest.raises(FkvError, match=r"'block_ids' must be a 1-D"):
        C.gather(cache[0], spec, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(FkvError, match=r"'block_ids' holds block id 9"):
        C.convert(cache, spec, spec.evolve(layout="HND"), out=fkv.allocate(
            spec.evolve(layout="HND"), device=cache[0].device), block_ids=[1, 9])
    assert torch.equal(_bits(cache[1]), before)


REPEAT = ("{name!r} repeats block {b}: two tokens would land in one slot (the last write wins); "
          "pass each destination block once")


def _raises(message: str, fn, *args, **kw) -> None:
    with pytest.raises(FkvError) as e:
        fn(*args, **kw)
    assert str(e.value) == message


def test_destination_blocks_written_twice_are_refused(small):
    """scatter and move refuse a destination block listed twice among the blocks they write (the
    last write would win, racing on a GPU); a repeat past num_tokens' blocks writes nothing."""
    spec, cache = small
    dev = cache[0].device
    staging = C.gather(cache[0], spec, [1, 2])
    before = [_bits(c).clone() for c in cache]
    for scatter in (C.scatter, RC.scatter):
        _raises(REPEAT.format(name="block_ids", b=1), scatter, staging, cache[1], spec, [1, 1])
    good, bad = torch.tensor([4, 6], device=dev), torch.tensor([6, 6], device=dev)
    C.scatter(staging, cache[1], spec, good, validate=True)  # the signature's fast path
    before[1] = _bits(cache[1]).clone()
    _raises(REPEAT.format(name="block_ids", b=6), C.scatter, staging, cache[1], spec, bad,
            validate=True)
    good[0] = 6  # an in-place edit is checked again
    _raises(REPEAT.format(name="block_ids", b=6), C.scatter, staging, cache[1], spec, good,
            validate=True)
    for move in (C.move, RC.move):
        _raises(REPEAT.format(name="dst_block_ids", b=5), move, cache[0], spec, [1, 3], cache[1],
                spec, [5, 5])
    assert all(torch.equal(_bits(c), b) for c, b in zip(cache, before))
    expected = _clone(cache, spec)
    C.move(cache[0], spec, [1, 3], cache[1], spec, [5, 5], num_tokens=spec.block_size)
    RC.move(cache[0], spec, [1], expected[1], spec, [5])
    assert all(_equal(x, y) for x, y in zip(cache, expected))


def test_move_within_one_cache_refuses_blocks_it_reads(small):
    """A move whose dst is src itself must not write a block it reads (the same heads): the copy
    would read tokens it has already overwritten. Other heads of the same blocks may move."""
    spec, cache = small
    before = _bits(cache[0]).clone()
    message = ("'dst_block_ids' holds block 2, which 'src_block_ids' also holds, and 'dst' is 'src' "
               "itself: the move would overwrite tokens it still reads; move into blocks that are "
               "not sources (or through a separate buffer)")
    for move in (C.move, RC.move):
        _raises(message, move, cache[0], spec, [1, 2, 3], cache[0], spec, [2, 3, 4])
        _raises(message.replace("block 2", "block 1"), move, cache[0], spec, [1], cache[0], spec,
                [1], src_heads=(0, 2), dst_heads=(1, 3))
    assert torch.equal(_bits(cache[0]), before)
    expected = _clone(cache, spec)
    C.move(cache[0], spec, [1, 2], cache[0], spec, [2, 1], src_heads=(0, 2), dst_heads=(2, 4))
    RC.move(expected[0].clone(), spec, [1, 2], expected[0], spec, [2, 1], src_heads=(0, 2),
            dst_heads=(2, 4))
    assert all(_equal(x, y) for x, y in zip(cache, expected))


def test_staging_that_overlaps_the_cache_is_refused(small):
    """gather's out and scatter's staging must not be memory of the cache (always checked, on the
    fast path of a repeated signature too)."""
    spec, cache = small
    dev = cache[0].device
    shape = (1, 2, spec.num_kv_heads, spec.block_size, spec.head_size)
    alias = cache[0].as_strided(shape, torch.empty(shape).stride(), cache[0].storage_offset())
    ids = torch.tensor([2], device=dev)
    C.gather(cache[0], spec, ids, out=torch.empty_like(alias))  # the signature's fast path
    before = _bits(cache[0]).clone()
    gather = ("gather: 'out' overlaps 'cache' in memory; gather writes a staging copy of the "
              "cache's tokens, so it cannot run in place: pass a separate out (or none)")
    for fn in (C.gather, RC.gather):
        _raises(gather, fn, cache[0], spec, ids, out=alias)
    scatter = ("scatter: 'staging' overlaps 'cache' in memory; scatter reads staging while it "
               "writes the cache: pass a separate staging buffer")
    C.scatter(torch.empty_like(alias), cache[1], spec, ids)  # the signature's fast path
    for fn in (C.scatter, RC.scatter):
        _raises(scatter, fn, alias, cache[0], spec, ids)
    assert torch.equal(_bits(cache[0]), before)


def test_an_out_sharing_only_the_last_byte_of_the_cache_is_refused(device):
    """The overlap check counts every byte of both extents: an out (fp8: one-byte elements) whose
    first element is the cache's last one overlaps it, one byte past it does not."""
    spec = KVCacheSpec(dtype="float8_e4m3fn", **{**GEOM, "num_layers": 1})
    shape = (1, 2, spec.num_kv_heads, spec.block_size, spec.head_size)
    size = shape[1] * shape[2] * shape[3] * shape[4]  # bytes of one staging block
    raw = torch.zeros(spec.region_bytes + 2 * size, dtype=torch.uint8, device=device)
    (cache,) = fkv.tensors.wrap(raw, spec)

    def out_at(byte: int) -> torch.Tensor:
        return raw[byte:byte + size].view(cache.dtype).view(shape)

    gather = ("gather: 'out' overlaps 'cache' in memory; gather writes a staging copy of the "
              "cache's tokens, so it cannot run in place: pass a separate out (or none)")
    for fn in (C.gather, RC.gather):
        _raises(gather, fn, cache, spec, [3], out=out_at(spec.region_bytes - 1))
    out = out_at(spec.region_bytes)
    assert C.gather(cache, spec, [3], out=out) is out


def test_repeated_gather_scatter_recheck_what_the_signature_does_not_pin(small):
    """A remembered gather/scatter signature pins the ids' shape, dtype and layout and the
    staging's shape: a repeat that differs in any of them is checked (or launched) afresh, never
    with the remembered token count, grid or id type; and the fast path keeps every default
    check (host ids range-checked, destination blocks of a partial last block distinct, each new
    out or staging buffer checked for overlap) and gather's zeroed partial last staging block."""
    spec, cache = small
    dev = cache[0].device
    bs = spec.block_size
    three = torch.tensor([5, 1, 7], device=dev)
    assert _equal(C.gather(cache[0], spec, three), R.gather(cache[0], spec, [5, 1, 7]))
    # fewer ids than the remembered call: two blocks, not three (the ids would be read past)
    two = torch.tensor([6, 2], device=dev)
    assert _equal(C.gather(cache[0], spec, two), R.gather(cache[0], spec, [6, 2]))
    # int32 ids: a signature and a launch site of their own (a site types the ids' pointer)
    three32 = three.to(torch.int32)
    assert _equal(C.gather(cache[0], spec, three32), R.gather(cache[0], spec, [5, 1, 7]))
    sig64, sig32 = (C._staging_signature("gather", cache[0], spec, ids, None, None, None, None)
                    for ids in (three, three32))
    assert sig64 != sig32 and C._FAST[sig64].site is not C._FAST[sig32].site
    # strided ids are copied to contiguous ones: never remembered, each call reads the right ones
    strided = torch.tensor([3, 0, 4, 0, 6, 0], device=dev)[::2]
    for _ in range(2):
        assert _equal(C.gather(cache[0], spec, strided), R.gather(cache[0], spec, [3, 4, 6]))
    # a staging (or out) one block short, with the remembered one's strides: refused
    staging = C.gather(cache[0], spec, three)
    C.scatter(staging, cache[1], spec, three)
    short = ("'{}' has shape (2, 2, 4, 4, 8) but {} 3 staging blocks of 4 tokens, heads (0, 4) "
             "needs [n, 2, h, N, D] = (3, 2, 4, 4, 8)")
    before = [_bits(c).clone() for c in cache]
    _raises(short.format("staging", "scattering from"), C.scatter, staging[:2], cache[1], spec,
            three)
    C.gather(cache[0], spec, three, out=torch.empty_like(staging))
    _raises(short.format("out", "gathering into"), C.gather, cache[0], spec, three,
            out=torch.empty_like(staging)[:2])
    assert all(torch.equal(_bits(c), b) for c, b in zip(cache, before))
    # default checks on the fast path: host ids are range-checked (free)
    if dev.type == "cpu":
        _raises("'block_ids' holds block id 8 but the cache has num_blocks=8 (valid ids: 0..7)",
                C.gather, cache[0], spec, torch.tensor([5, 1, 8]))
        _raises("'block_ids' holds block id 8 but the cache has num_blocks=8 (valid ids: 0..7)",
                C.scatter, staging, cache[1], spec, torch.tensor([5, 1, 8]))
        _raises(REPEAT.format(name="block_ids", b=5), C.scatter, staging, cache[1], spec,
                torch.tensor([5, 1, 5]))
    # a repeated block among those a partial last block writes
    part = C.gather(cache[0], spec, three, num_tokens=2 * bs + 1)
    C.scatter(part, cache[1], spec, torch.tensor([4, 2, 6], device=dev), num_tokens=2 * bs + 1,
              validate=True)
    _raises(REPEAT.format(name="block_ids", b=4), C.scatter, part, cache[1], spec,
            torch.tensor([4, 2, 4], device=dev), num_tokens=2 * bs + 1, validate=True)
    # gather's partial last staging block stays zero past num_tokens on the fast path too
    for _ in range(3):
        junk = torch.full_like(part, float("nan"))
        del junk
        again = C.gather(cache[0], spec, three, num_tokens=2 * bs + 1)
        assert _equal(again, part) and not _bits(again[2, :, :, 1:]).any()
    # a new out that overlaps the cache, after a separate one took the fast path
    shape = (1, 2, spec.num_kv_heads, bs, spec.head_size)
    alias = cache[0].as_strided(shape, torch.empty(shape).stride(), cache[0].storage_offset())
    one = torch.tensor([2], device=dev)
    separate = torch.empty_like(alias)
    for _ in range(2):
        C.gather(cache[0], spec, one, out=separate)
    _raises("gather: 'out' overlaps 'cache' in memory; gather writes a staging copy of the "
            "cache's tokens, so it cannot run in place: pass a separate out (or none)",
            C.gather, cache[0], spec, one, out=alias)
    assert torch.equal(_bits(cache[0]), before[0])  # only ever read


def test_bools_never_take_a_remembered_ints_fast_path(small):
    """``True == 1`` in Python: a bool ``num_tokens``/``block_size`` or head bound after a
    remembered call with the equal int is still refused by the checked path, not launched."""
    spec, cache = small
    ids = torch.tensor([3, 5], device=cache[0].device)
    for _ in range(2):
        C.gather(cache[0], spec, ids, heads=(0, 2), num_tokens=1, block_size=1)
    _raises("'num_tokens' must be a non-negative int (got True)", C.gather, cache[0], spec, ids,
            heads=(0, 2), num_tokens=True, block_size=1)
    _raises("'block_size' must be a positive int (tokens per staging block) (got True)", C.gather,
            cache[0], spec, ids, heads=(0, 2), num_tokens=1, block_size=True)
    _raises("'heads' must be a slice(start, stop) or a (start, stop) pair of ints with 0 <= start "
            "< stop <= 4 (a contiguous range of this rank's 4 heads) (got (False, 2))", C.gather,
            cache[0], spec, ids, heads=(False, 2), num_tokens=1, block_size=1)


def test_convert_refuses_layers_on_different_devices(small):
    spec, cache = small
    mixed = [cache[0], cache[1].to("meta")]
    _raises(f"'src': layer 1 is on meta but layer 0 on {cache[0].device}; all layers must be on "
            f"one device", C.convert, mixed, spec, spec.evolve(layout="HND"))
    out = fkv.allocate(spec.evolve(layout="HND"), device=cache[0].device)
    _raises(f"'out': layer 1 is on meta but layer 0 on {cache[0].device}; all layers must be on "
            f"one device", C.convert, cache, spec, spec.evolve(layout="HND"),
            out=[out[0], out[1].to("meta")])


def test_ids_on_another_device_and_validate_flags_are_refused(small):
    spec, cache = small
    dev = cache[0].device
    _raises(f"'block_ids' is on meta but the cache is on {dev}; pass the ids on the CPU or on the "
            f"cache's device", C.gather, cache[0], spec, torch.tensor([1], device="meta"))
    _raises(f"'dst_block_ids' is on meta but the cache is on {dev}; pass the ids on the CPU or on "
            f"the cache's device", C.move, cache[0], spec, [1], cache[1], spec,
            torch.tensor([1], device="meta"))
    staging = C.gather(cache[0], spec, [1])
    message = "'validate' must be True, False or None (None: the default) (got 'no')"
    _raises(message, C.gather, cache[0], spec, [1], validate="no")
    _raises(message, C.scatter, staging, cache[1], spec, [1], validate="no")
    _raises(message, C.move, cache[0], spec, [1], cache[1], spec, [1], validate="no")
    out = fkv.allocate(spec.evolve(layout="HND"), device=dev)
    _raises(message, C.convert, cache, spec, spec.evolve(layout="HND"), out=out, validate="no")
    _raises(message.replace("'no'", "1"), C.convert, cache, spec, spec.evolve(layout="HND"),
            validate=1)


def test_bad_geometry(small):
    spec, cache = small
    with pytest.raises(FkvError, match=r"convert: src and dst must have the same geometry; they "
                                       r"differ in num_blocks: src 8, dst 9"):
        C.convert(cache, spec, spec.evolve(num_blocks=9))
    with pytest.raises(FkvError, match=r"move: src and dst must agree on head_size"):
        other = spec.evolve(head_size=16)
        C.move(cache[0], spec, [0], fkv.allocate(other, device=cache[0].device)[0], other, [0])
    with pytest.raises(FkvError, match=r"move: src and dst must agree on MLA cache"):
        C.move(cache[0], spec, [0], cache[1], MLA_SPECS[0], [0])
    with pytest.raises(FkvError, match=r"'src' holds 1 layer views but the spec has num_layers=2"):
        C.convert(cache[:1], spec, spec)
    with pytest.raises(FkvError, match=r"'src' is one tensor but the spec has num_layers=2"):
        C.convert(cache[0], spec, spec)
    with pytest.raises(FkvError, match=r"'src\[0\]' has strides .* the tensor's real layout "
                                       r"differs from the spec"):
        hnd = spec.evolve(layout="HND")
        C.convert(fkv.allocate(hnd, device=cache[0].device), spec, hnd)
    with pytest.raises(FkvError, match=r"convert: block_ids= converts those blocks in place"):
        C.convert(cache, spec, spec, block_ids=[0])
    with pytest.raises(FkvError, match=r"convert: 'out' overlaps 'src' in memory"):
        C.convert(cache, spec, spec, out=cache)


def test_bad_staging(small):
    spec, cache = small
    dev = cache[0].device
    staging = C.gather(cache[0], spec, [1, 2], heads=(0, 2))
    with pytest.raises(FkvError, match=r"'staging' has shape \(2, 2, 2, 4, 8\) but scattering "
                                       r"from 2 staging blocks of 4 tokens, heads \(0, 3\) needs "
                                       r"\[n, 2, h, N, D\] = \(2, 2, 3, 4, 8\)"):
        C.scatter(staging, cache[1], spec, [1, 2], heads=(0, 3))
    with pytest.raises(FkvError, match=r"'staging' has dtype torch.float32 but the cache's dtype "
                                       r"is torch.bfloat16"):
        C.scatter(staging.float(), cache[1], spec, [1, 2], heads=(0, 2))
    with pytest.raises(FkvError, match=r"'staging' must be contiguous"):
        wide = torch.empty(2, 2, 2, 4, 16, dtype=staging.dtype, device=dev)[..., :8]
        C.scatter(wide, cache[1], spec, [1, 2], heads=(0, 2))
    with pytest.raises(FkvError, match=r"'out' has shape \(1, 2, 2, 4, 8\) but gathering into 2"):
        C.gather(cache[0], spec, [1, 2], heads=(0, 2), out=staging[:1])
    with pytest.raises(FkvError, match=r"'block_size' must be a positive int"):
        C.gather(cache[0], spec, [1], block_size=0)


@pytest.mark.parametrize("heads", [(2, 2), (0, 5), (-1, 2), (3, 1), "ab", (0.0, 1), (0, 1, 2),
                                   (True, 2), slice(2, 2), slice(0, 5), slice(3, 1),
                                   slice(0.0, 2), slice("a", None)])
def test_bad_heads(small, heads):
    spec, cache = small
    with pytest.raises(FkvError, match=r"'heads' must be a slice\(start, stop\) or a \(start, stop\) "
                                       r"pair of ints with 0 <= start < stop <= 4 \(a contiguous "
                                       r"range of this rank's 4 heads\) \(got "):
        C.gather(cache[0], spec, [0], heads=heads)


@pytest.mark.parametrize(("heads", "fix"), [
    (slice(0, 4, 2), r"\(got slice\(0, 4, 2\)\); heads are one contiguous range: drop the step "
                     r"\(e.g. slice\(0, 4\)\)"),
    (slice(3, 0, -1), r"\(got slice\(3, 0, -1\)\); heads are one contiguous range: drop the step"),
    (slice(-2, None), r"\(got slice\(-2, None, None\)\); negative bounds \(counted from the end\) "
                      r"are not taken: write the heads out, e.g. slice\(2, 4\)"),
    (slice(0, -1), r"\(got slice\(0, -1, None\)\); negative bounds .* e.g. slice\(0, 3\)"),
])
def test_ambiguous_head_slices_are_refused_with_the_fix(small, heads, fix):
    spec, cache = small
    for fn in (C.gather, R.gather):
        with pytest.raises(FkvError, match=r"'heads' must be a slice\(start, stop\) .*" + fix):
            fn(cache[0], spec, [0], heads=heads)
    with pytest.raises(FkvError, match=r"'src_heads' must be a slice.*" + fix):
        C.move(cache[0], spec, [0], cache[1], spec, [0], src_heads=heads, dst_heads=(0, 2))


@pytest.mark.parametrize(("heads", "pair"), [
    (slice(1, 3), (1, 3)), (slice(None, 2), (0, 2)), (slice(2, None), (2, 4)),
    (slice(None), (0, 4)), (slice(1, 4, 1), (1, 4))])
def test_heads_as_a_slice_equal_the_pair(device, heads, pair):
    """The public contract's "a slice of this rank's heads": ``heads=slice(a, b)`` moves exactly
    the bytes of ``heads=(a, b)`` in gather, scatter and move, kernel and reference."""
    spec = KV_SPECS[2]  # triton HND
    cache = _cache(spec, device, seed=41)
    ids = [5, 1, 6]
    want = R.gather(cache[1], spec, ids, heads=pair)
    for fn in (C.gather, R.gather):
        assert _equal(fn(cache[1], spec, ids, heads=heads), want)
    ids_t = torch.tensor(ids, device=device)
    assert _equal(C.gather(cache[1], spec, ids_t, heads=heads), want)
    if heads.start is not None and heads.stop is not None:  # a slice of ints: the pair's fast path
        assert C._staging_signature("gather", cache[1], spec, ids_t, pair, None, None, None) in C._FAST
    h = pair[1] - pair[0]
    other = KV_SPECS[0]  # triton NHD
    dst, expected = _cache(other, device, seed=42), _cache(other, device, seed=42)
    C.scatter(want, dst[0], other, [2, 7, 0], heads=heads)
    R.scatter(want, expected[0], other, [2, 7, 0], heads=pair)
    assert all(_equal(x, y) for x, y in zip(dst, expected))
    dst_pair = slice(4 - h, None)
    C.move(cache[1], spec, ids, dst[1], other, [3, 4, 1], src_heads=heads, dst_heads=dst_pair)
    RC.move(cache[1], spec, ids, expected[1], other, [3, 4, 1], src_heads=pair,
            dst_heads=(4 - h, 4))
    assert all(_equal(x, y) for x, y in zip(dst, expected))


@pytest.mark.parametrize("heads", [(1, 3), slice(1, 3), slice(None, 2), slice(2, None)])
def test_move_heads_is_the_same_range_on_both_sides(device, heads):
    """The contract's ``move(..., heads=...)``: the bytes of ``src_heads=dst_heads=heads``, in
    the kernel and the reference, every head outside the range untouched."""
    spec, other = KV_SPECS[2], KV_SPECS[0]  # triton HND -> triton NHD
    cache = _cache(spec, device, seed=43)
    got, want = _cache(other, device, seed=44), _cache(other, device, seed=44)
    ref = _cache(other, device, seed=44)
    C.move(cache[1], spec, [5, 1], got[0], other, [2, 7], heads=heads)
    C.move(cache[1], spec, [5, 1], want[0], other, [2, 7], src_heads=heads, dst_heads=heads)
    RC.move(cache[1], spec, [5, 1], ref[0], other, [2, 7], heads=heads)
    assert all(_equal(x, y) for x, y in zip(got, want))
    assert all(_equal(x, y) for x, y in zip(ref, want))
    inside = range(4)[heads] if isinstance(heads, slice) else range(*heads)
    untouched = _cache(other, device, seed=44)
    for h in range(4):  # block 5 -> 2: the range's heads moved, the others as they were
        expected = cache[1][5, :, :, h] if h in inside else untouched[0][2, :, :, h]
        assert _equal(got[0][2, :, :, h], expected), h


@pytest.mark.parametrize("fn", [C.move, RC.move], ids=["kernel", "reference"])
def test_move_refuses_heads_with_src_or_dst_heads(small, fn):
    spec, cache = small
    before = [c.clone() for c in cache]
    for kwargs in ({"src_heads": (0, 2)}, {"dst_heads": slice(0, 2)},
                   {"src_heads": (0, 2), "dst_heads": (2, 4)}):
        with pytest.raises(FkvError) as e:
            fn(cache[0], spec, [0], cache[1], spec, [1], heads=(0, 2), **kwargs)
        assert str(e.value) == (
            f"move: pass 'heads' (the same range on both sides) or 'src_heads'/'dst_heads', not "
            f"both (got heads=(0, 2), src_heads={kwargs.get('src_heads')!r}, "
            f"dst_heads={kwargs.get('dst_heads')!r})")
    assert all(_equal(a, b) for a, b in zip(cache, before))


def test_the_references_take_the_kernels_signatures():
    """``fkv.ops.reference``: "same signatures" -- every parameter of every op, its kind and its
    default; the kernels' launch options are checked there too and change nothing."""
    import inspect

    for name in ("write_kv", "convert", "gather", "scatter", "move", "paged_attention"):
        kernel, ref = inspect.signature(getattr(fkv.ops, name)), inspect.signature(getattr(R, name))
        assert [(p.name, p.kind, p.default) for p in kernel.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in ref.parameters.values()], name
    spec = KV_SPECS[0].evolve(num_layers=1)
    (cache,) = _cache(spec, "cpu", seed=45)
    for bad in ("yes", 1):
        with pytest.raises(FkvError, match=r"'validate' must be True, False or None"):
            R.gather(cache, spec, [0], validate=bad)
        with pytest.raises(FkvError, match=r"'validate' must be True, False or None"):
            R.move(cache, spec, [0], cache, spec, [1], validate=bad)
    for validate in (None, False, True):  # the reference checks ids whatever validate says
        with pytest.raises(FkvError, match=r"'block_ids'"):
            R.gather(cache, spec, [8], validate=validate)


def test_bad_move_ranges(small):
    spec, cache = small
    with pytest.raises(FkvError, match=r"'src_heads' \(0, 2\) selects 2 heads but 'dst_heads' "
                                       r"\(1, 4\) selects 3"):
        C.move(cache[0], spec, [0], cache[1], spec, [0], src_heads=(0, 2), dst_heads=(1, 4))
    with pytest.raises(FkvError, match=r"'num_tokens' is 9 but the 2 dst_block_ids hold only 8 "
                                       r"tokens"):
        C.move(cache[0], spec, [0, 1, 2], cache[1], spec, [0, 1], num_tokens=9)
    with pytest.raises(FkvError, match=r"'num_tokens' is 12 but the 2 src_block_ids hold only 8"):
        C.move(cache[0], spec, [0, 1], cache[1], spec, [0, 1, 2], num_tokens=12)
    with pytest.raises(FkvError, match=r"'num_tokens' must be a non-negative int \(got -1\)"):
        C.move(cache[0], spec, [0], cache[1], spec, [0], num_tokens=-1)
    with pytest.raises(FkvError, match=r"'src_spec' must be a KVCacheSpec"):
        C.move(cache[0], "triton", [0], cache[1], spec, [0])
    with pytest.raises(FkvError, match=r"'num_tokens' is 12 but the 2 block_ids hold only 8"):
        RC.gather(cache[0], spec, [0, 1], num_tokens=12)


def test_public_names_route_here(device):
    # The public names (fkv.ops) are the functions of fkv.ops.relayout, whatever was imported first.
    assert fkv.ops.convert is C.convert and fkv.ops.gather is C.gather
    assert fkv.ops.scatter is C.scatter and fkv.ops.move is C.move
    assert R.convert is RC.convert and R.gather is RC.gather and R.scatter is RC.scatter
    assert R.move is RC.move
    spec = MLA_SPECS[0].evolve(num_layers=1)
    (src,) = _cache(spec, device, seed=19)
    assert _equal(C.convert(src, spec, spec.evolve(cross_layer=True)), src)
    assert _equal(fkv.ops.convert(src, spec, spec), src)


_WITHOUT_INTERPRETER = """
import json, torch, fkv
from fkv import FkvError
from fkv.ops import convert, gather, move, paged_attention, scatter, write_kv
spec = fkv.KVCacheSpec(layout="HND", num_blocks=4, block_size=4, num_kv_heads=2, head_size=8,
                       dtype="float32")
(cache,) = fkv.allocate(spec)
cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape))
(other,) = fkv.allocate(spec)
other.zero_()
before = (cache.clone(), other.clone())
calls = {
    "write_kv": lambda: write_kv(torch.ones(2, 2, 8), torch.ones(2, 2, 8), cache,
                                 torch.tensor([0, 5]), spec),
    "convert": lambda: convert(cache, spec, spec.evolve(layout="NHD")),
    "gather": lambda: gather(cache, spec, [1, 2]),
    "scatter": lambda: scatter(torch.ones(1, 2, 2, 4, 8), other, spec, [3]),
    "move": lambda: move(cache, spec, [1], other, spec, [2]),
    "paged_attention": lambda: paged_attention(torch.ones(1, 2, 8), cache, spec,
                                               torch.tensor([[0, 1]], dtype=torch.int32),
                                               torch.tensor([6], dtype=torch.int32)),
}
got = {}
for name, call in calls.items():
    try:
        call()
        got[name] = ["no error", False, ""]
    except Exception as e:
        got[name] = [type(e).__name__, isinstance(e, FkvError), str(e)]
got["untouched"] = torch.equal(cache, before[0]) and torch.equal(other, before[1])
print(json.dumps(got))
"""


def test_kernels_on_cpu_tensors_without_the_interpreter_raise_fkv_error():
    """Compiled Triton runs on CUDA tensors only: without ``TRITON_INTERPRET=1`` every op given
    CPU tensors raises an FkvError saying so (Triton's own error is a RuntimeError about its
    drivers), after its input checks and before anything is written."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # also on a machine with a GPU: no CUDA tensors here
    run = subprocess.run([sys.executable, "-c", _WITHOUT_INTERPRETER], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got.pop("untouched") is True
    fix = ("is on cpu: the Triton kernel runs on CUDA tensors, or on CPU with TRITON_INTERPRET=1 "
           "set before triton is imported; or use fkv.ops.reference.")
    field = {"write_kv": "cache", "convert": "src", "gather": "cache", "scatter": "cache",
             "move": "src", "paged_attention": "q"}
    assert got == {name: ["FkvError", True, f"{field[name]!r} {fix}{name}"] for name in field}
