"""The layout algebra: the docs/layouts.md table, normalization, validation, addressing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from inline_snapshot import snapshot

import fkv
from fkv import FkvError, KVCacheSpec, Layout, rearrange_pattern
from fkv.layout import canonical_dtype
from fkv.tensors import torch_dtype
from fkv.testing import specs


def _spec(**kw):
    base = dict(num_blocks=5, block_size=16, num_kv_heads=8, head_size=128)
    base.update(kw)
    return KVCacheSpec(**base)


def _table() -> dict[str, tuple]:
    rows = {}
    for backend in ("triton", "flashinfer", "flash_attn", "mla"):
        for layout in ("NHD", "HND"):
            for cross in (False, True):
                s = KVCacheSpec(backend=backend, layout=layout, num_blocks=7, block_size=16,
                                num_kv_heads=1 if backend == "mla" else 8,
                                head_size=576 if backend == "mla" else 128, num_layers=3,
                                cross_layer=cross)
                rows[f"{backend} {layout}{' +layers' if cross else ''}"] = (
                    s.logical_shape, s.stride_order, s.physical_shape)
    return rows


def test_spec_table_matches_spec_md():
    # NB=7, L=3, N=16, H=8, D=128 (mla: D=576): docs/layouts.md, every backend × layout × cross_layer.
    assert _table() == snapshot(
        {
            "triton NHD": ((7, 2, 16, 8, 128), (0, 1, 2, 3, 4), (7, 2, 16, 8, 128)),
            "triton NHD +layers": ((7, 2, 16, 8, 128), (1, 0, 2, 3, 4, 5), (7, 3, 2, 16, 8, 128)),
            "triton HND": ((7, 2, 16, 8, 128), (0, 1, 3, 2, 4), (7, 2, 8, 16, 128)),
            "triton HND +layers": ((7, 2, 16, 8, 128), (1, 2, 4, 0, 3, 5), (7, 2, 8, 3, 16, 128)),
            "flashinfer NHD": ((7, 2, 16, 8, 128), (0, 1, 2, 3, 4), (7, 2, 16, 8, 128)),
            "flashinfer NHD +layers": ((7, 2, 16, 8, 128), (1, 0, 2, 3, 4, 5), (7, 3, 2, 16, 8, 128)),
            "flashinfer HND": ((7, 2, 16, 8, 128), (0, 1, 3, 2, 4), (7, 2, 8, 16, 128)),
            "flashinfer HND +layers": ((7, 2, 16, 8, 128), (1, 2, 4, 0, 3, 5), (7, 2, 8, 3, 16, 128)),
            "flash_attn NHD": ((2, 7, 16, 8, 128), (0, 1, 2, 3, 4), (2, 7, 16, 8, 128)),
            "flash_attn NHD +layers": ((2, 7, 16, 8, 128), (2, 0, 1, 3, 4, 5), (7, 3, 2, 16, 8, 128)),
            "flash_attn HND": ((2, 7, 16, 8, 128), (0, 1, 3, 2, 4), (2, 7, 8, 16, 128)),
            "flash_attn HND +layers": ((2, 7, 16, 8, 128), (2, 4, 0, 1, 3, 5), (7, 8, 3, 2, 16, 128)),
            "mla NHD": ((7, 16, 576), (0, 1, 2), (7, 16, 576)),
            "mla NHD +layers": ((7, 16, 576), (1, 0, 2, 3), (7, 3, 16, 576)),
            "mla HND": ((7, 16, 576), (0, 1, 2), (7, 16, 576)),
            "mla HND +layers": ((7, 16, 576), (1, 0, 2, 3), (7, 3, 16, 576)),
        }
    )


def test_worked_strides_and_page_bytes():
    # docs/layouts.md worked strides (bf16, N=16, H=8, D=128).
    assert _spec(layout="NHD").element_strides == (32768, 16384, 1024, 128, 1)
    assert _spec(layout="HND").element_strides == (32768, 16384, 128, 2048, 1)
    assert _spec().page_bytes == 65536
    assert _spec(num_kv_heads=4).page_bytes == 32768
    assert _spec(dtype="float8_e4m3fn").page_bytes == 32768
    assert KVCacheSpec(backend="mla", num_blocks=2, block_size=16, num_kv_heads=1,
                       head_size=576).page_bytes == 16 * 576 * 2


@pytest.mark.parametrize(("alias", "layout"), [
    ("NHD", Layout.NHD), ("nhd", Layout.NHD), (" Hnd ", Layout.HND), ("LBNHC", Layout.NHD),
    ("lbhnc", Layout.HND), ("LHBNC", Layout.HND), ("BLNHC", Layout.NHD), ("BHLNC", Layout.HND),
    ("blhnc", Layout.HND), (Layout.HND, Layout.HND),
])
def test_layout_aliases(alias, layout):
    """Every name of the engines' vocabulary; a spec made with one is the spec of its layout,
    fkv's physical order (a buffer laid out otherwise is refused at its strides)."""
    assert Layout.parse(alias) is layout
    cross = str(alias).upper() in ("BLNHC", "BHLNC", "BLHNC")
    spec = _spec(layout=alias, num_layers=2, cross_layer=cross)
    assert spec == _spec(layout=layout, num_layers=2, cross_layer=cross)


@pytest.mark.parametrize(("alias", "plain"), [("BLNHC", "'NHD' (alias 'LBNHC')"),
                                              (" bhlnc", "'HND' (alias 'LBHNC')"),
                                              ("BLHNC", "'HND' (alias 'LBHNC')")])
def test_a_cross_layer_alias_needs_cross_layer(alias, plain):
    """The alias names one buffer of all layers: per-layer buffers with it are refused, never
    read as the per-layer layout of the same letters."""
    message = (f"'cross_layer' must be True with the layout alias {alias!r}, which names one "
               f"buffer of all layers (got False); pass cross_layer=True, or layout={plain} for a "
               f"buffer per layer")
    with pytest.raises(FkvError) as e:
        _spec(layout=alias)
    assert str(e.value) == message
    with pytest.raises(FkvError) as e:
        _spec(layout="NHD").evolve(layout=alias)
    assert str(e.value) == message


def test_normalization_makes_equal_specs_equal_and_hashable():
    a = _spec(layout="hnd", dtype="bfloat16")
    b = _spec(layout=Layout.HND, dtype="torch.bfloat16")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    m1 = KVCacheSpec(backend="mla", layout="HND", num_blocks=2, block_size=16, num_kv_heads=1,
                     head_size=576)
    m2 = m1.evolve(layout="NHD")
    assert m1 == m2 and m1.layout is Layout.NHD
    assert repr(a) == snapshot(
        "KVCacheSpec(backend='triton', layout='HND', num_blocks=5, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')"
    )


def test_same_bytes_treats_size_one_dims_as_ambiguous():
    assert _spec(num_kv_heads=1, layout="NHD").same_bytes(_spec(num_kv_heads=1, layout="HND"))
    assert not _spec(layout="NHD").same_bytes(_spec(layout="HND"))
    assert _spec(block_size=1, layout="NHD").same_bytes(_spec(block_size=1, layout="HND"))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(backend="vllm"), r"'backend' must be in \('triton', 'flashinfer', 'flash_attn', 'mla'\) \(got 'vllm'\)"),
    (dict(layout="NDH"), r"'layout' must be in \('NHD', 'HND'\) or an alias in .* \(got 'NDH'\)"),
    (dict(layout=3), r"'layout' must be a Layout or one of .* \(got 3\)"),
    (dict(num_blocks=0), r"'num_blocks' must be a positive int \(got 0\)"),
    (dict(block_size=16.0), r"'block_size' must be a positive int \(got 16.0\)"),
    (dict(num_kv_heads=True), r"'num_kv_heads' must be a positive int \(got True\)"),
    (dict(head_size=-1), r"'head_size' must be a positive int \(got -1\)"),
    (dict(dtype="int8"), r"'dtype' must be in \('bfloat16', 'float16', 'float32', 'float8_e4m3fn', 'float8_e5m2'\) "
                         r"or an engine name in \('fp8', 'fp8_e4m3', 'fp8_e5m2', 'fp8_inc'\) \(got 'int8'\)$"),
    (dict(dtype="auto"), r"'dtype' must be in .* \(got 'auto'\); 'auto' means the model's dtype, which a "
                         r"cache spec cannot know: pass that dtype \(e.g. 'bfloat16'\)"),
    (dict(dtype="fp8_ds_mla"), r"'dtype' must be in .* \(got 'fp8_ds_mla'\); 'fp8_ds_mla' is a packed "
                               r"DeepSeek MLA entry .* use backend='mla' with dtype 'fp8' or 'bfloat16'$"),
    (dict(num_layers=0), r"'num_layers' must be a positive int \(got 0\)"),
    (dict(cross_layer="yes"), r"'cross_layer' must be a bool \(got 'yes'\)"),
    (dict(backend="mla"), r"'num_kv_heads' must be 1 for backend 'mla' .*\(got 8\); pass num_kv_heads=1"),
])
def test_validation_errors(kwargs, match):
    with pytest.raises(FkvError, match=match):
        _spec(**kwargs)


@pytest.mark.parametrize(("name", "canonical"), [
    ("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"),
    ("fp8_inc", "float8_e4m3fn"),
    ("torch.float8_e5m2", "float8_e5m2"), ("bfloat16", "bfloat16")])
def test_engine_dtype_names_normalize(name, canonical):
    """vLLM's kv_cache_dtype names are accepted and normalized: equal specs compare and hash equal."""
    spec = _spec(dtype=name)
    assert spec.dtype == canonical
    assert spec == _spec(dtype=canonical) and hash(spec) == hash(_spec(dtype=canonical))
    assert spec.evolve(dtype=name) == spec
    assert canonical_dtype(name) == canonical
    assert torch_dtype(name) == getattr(torch, canonical)
    assert spec.itemsize == (1 if "8" in canonical else 2)


def test_infer_spec_takes_engine_dtype_names():
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8, dtype="fp8")
    (view,) = fkv.allocate(spec)
    assert view.dtype == torch.float8_e4m3fn
    assert fkv.infer_spec(view, backend="triton", dtype="fp8") == spec
    assert fkv.infer_spec(view, backend="triton", dtype="fp8_e4m3") == spec
    with pytest.raises(FkvError, match=r"'dtype' must be the tensor's dtype 'float8_e4m3fn' \(got 'fp8_e5m2'\)"):
        fkv.infer_spec(view, backend="triton", dtype="fp8_e5m2")
    with pytest.raises(FkvError, match=r"'dtype' must be in .* \(got 'auto'\); 'auto' means"):
        fkv.infer_spec(view, backend="triton", dtype="auto")


def test_keyword_only_and_evolve_errors():
    with pytest.raises(TypeError):
        KVCacheSpec("triton")  # type: ignore[misc]
    with pytest.raises(FkvError, match=r"evolve: unknown field\(s\) \['heads'\]"):
        _spec().evolve(heads=4)
    with pytest.raises(FkvError, match=r"'block_size' must be a positive int \(got 0\)"):
        _spec().evolve(block_size=0)
    with pytest.raises(FkvError, match=r"rearrange: src and dst must have the same geometry; "
                       r"they differ in num_kv_heads: src 8, dst 4"):
        rearrange_pattern(_spec(), _spec(num_kv_heads=4))
    with pytest.raises(FkvError, match=r"rearrange_pattern takes two KVCacheSpec \(got str"):
        rearrange_pattern("NHD", _spec())  # type: ignore[arg-type]


def test_patterns_snapshot():
    nhd = _spec(num_layers=2)
    assert rearrange_pattern(nhd, nhd.evolve(layout="HND")) == "L B two N H C -> L B two H N C"
    assert {
        name: rearrange_pattern(nhd, nhd.evolve(**kw)) for name, kw in {
            "flash_attn HND": dict(backend="flash_attn", layout="HND"),
            "triton HND + layers": dict(layout="HND", cross_layer=True),
            "flash_attn HND + layers": dict(backend="flash_attn", layout="HND", cross_layer=True),
        }.items()
    } == snapshot({
        "flash_attn HND": "L B two N H C -> L two B H N C",
        "triton HND + layers": "L B two N H C -> B two H L N C",
        "flash_attn HND + layers": "L B two N H C -> B H L two N C",
    })


def test_span_and_offsets_match_worked_example_a():
    # docs/handshake.md example A: P TP=1 page 65536 B, D rank t reads heads [4t, 4t+4).
    p = _spec(layout="HND")
    assert p.span(B=0, two=0, H=(0, 4)) == (0, 16384)
    assert p.span(B=0, two=1, H=(0, 4)) == (32768, 16384)
    assert p.span(B=0, two=0, H=(4, 8)) == (16384, 16384)
    assert p.span(B=0, two=1, H=(4, 8)) == (49152, 16384)
    assert p.span(B=3) == (3 * 65536, 65536)
    assert p.span(B=(2, 5)) == (2 * 65536, 3 * 65536)
    assert p.evolve(layout="NHD").span(B=0, two=0, H=(0, 4)) is None
    assert p.evolve(layout="NHD").span(B=0, two=0, N=3, H=(4, 8)) == (3 * 2048 + 1024, 1024)
    assert p.region_and_offset(block=0, kv=1, head=4) == (0, 49152)
    cross = p.evolve(num_layers=3, cross_layer=True)
    # phys (NB, 2, H, L, N, D): layer 2's K tokens of head 1 in block 1.
    assert cross.region_and_offset(layer=2, block=1, kv=0, head=1) == (
        0, (1 * 2 * 8 * 3 * 16 * 128 + 1 * 3 * 16 * 128 + 2 * 16 * 128) * 2)
    with pytest.raises(FkvError, match=r"span: H=\(4, 9\) outside \[0, 8\)"):
        p.span(H=(4, 9))
    with pytest.raises(FkvError, match=r"span: axes \['X'\] are not axes of 'triton'"):
        p.span(X=1)


def test_import_fkv_is_pure_and_fast():
    code = ("import sys, time; t = time.perf_counter(); import fkv; "
            "fkv.KVCacheSpec(num_blocks=1, block_size=1, num_kv_heads=1, head_size=1); "
            "import fkv.connector; "
            "print([m for m in ('torch', 'triton', 'nixl', 'zmq') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- hypothesis: the algebra against real memory -----------------------------------------------

torch = pytest.importorskip("torch")
einops = pytest.importorskip("einops")


# Tiny geometries (fkv.testing.specs); MLA about half the time, as often as all K/V backends.
KV_BACKENDS = ("triton", "flashinfer", "flash_attn")
TINY_SPECS = specs(num_blocks=range(1, 5), block_size=range(1, 6), num_kv_heads=range(1, 5),
                   head_size=range(1, 7), num_layers=range(1, 4), dtype=("float32", "bfloat16"),
                   layout=("NHD", "HND"), max_bytes=None,
                   backend=st.one_of(st.just("mla"), st.sampled_from(KV_BACKENDS)))


@st.composite
def spec_pairs(draw):
    """A spec from ``fkv.testing.specs`` and one of the same geometry with its own backend (same
    family: MLA or K/V), layout and cross_layer (an evolve: building specs() per draw is slow)."""
    a = draw(TINY_SPECS)
    b = a.evolve(backend="mla" if a.is_mla else draw(st.sampled_from(KV_BACKENDS)),
                 layout=draw(st.sampled_from(["NHD", "HND"])), cross_layer=draw(st.booleans()))
    return a, b


def _memory(views, spec):
    """The real bytes behind fkv.allocate's views, as the pattern's side: stack or one buffer."""
    if spec.cross_layer:
        storage = views[0].untyped_storage()
        buf = torch.empty(0, dtype=views[0].dtype).set_(storage)
        assert views[0].data_ptr() == buf.data_ptr()
        assert all(v.untyped_storage().data_ptr() == storage.data_ptr() for v in views)
        return buf.view(spec.physical_shape)
    phys = [v.permute(spec.stride_order) for v in views]
    assert all(p.is_contiguous() for p in phys)
    return torch.stack(phys)


def _filled(spec, logical):
    views = fkv.allocate(spec)
    for view, values in zip(views, logical):
        view.copy_(values if spec.family != "flash_attn" else values.transpose(0, 1))
    return views


def _logical_values(spec, seed):
    # One canonical logical tensor per layer: (B, two, N, H, C) or mla (B, N, C).
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_blocks, spec.block_size, spec.head_size) if spec.is_mla else (
        spec.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
    return torch.randn((spec.num_layers, *shape), generator=g).to(getattr(torch, spec.dtype))


@given(spec_pairs(), st.integers(0, 2**16))
def test_pattern_moves_real_memory(pair, seed):
    src, dst = pair
    values = _logical_values(src, seed)
    src_mem = _memory(_filled(src, values), src)
    dst_mem = _memory(_filled(dst, values), dst)
    pattern = rearrange_pattern(src, dst)
    assert torch.equal(einops.rearrange(src_mem, pattern), dst_mem)
    back = einops.rearrange(einops.rearrange(src_mem, pattern), rearrange_pattern(dst, src))
    assert torch.equal(back, src_mem)


@given(TINY_SPECS)
def test_allocate_and_infer_round_trip(spec):
    views = fkv.allocate(spec)
    for v in views:
        v.copy_(torch.randn(v.shape))
    assert len(views) == spec.num_layers
    for v in views:
        assert tuple(v.shape) == spec.logical_shape
        assert v.stride() == spec.element_strides
        assert str(v.dtype) == f"torch.{spec.dtype}"
    if spec.cross_layer:
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    else:
        assert len({v.untyped_storage().data_ptr() for v in views}) == spec.num_layers
    got = fkv.infer_spec(views[0], backend=spec.backend, num_layers=spec.num_layers)
    assert got.same_bytes(spec) or spec.cross_layer
    if spec.num_kv_heads > 1 and spec.block_size > 1:
        assert got.layout == spec.layout
    if spec.cross_layer and spec.num_layers > 1:
        full = torch.stack(views)  # copy: per-layer stride order of the stack
        whole = views[0].as_strided((spec.num_layers, *spec.logical_shape),
                                    (spec.layer_stride, *spec.element_strides))
        inferred = fkv.infer_spec(whole, backend=spec.backend)
        assert inferred.cross_layer and inferred.num_layers == spec.num_layers
        assert inferred.same_bytes(spec) and torch.equal(whole, full)


def _vma_flags(address: int) -> tuple[int, int]:
    """``(THPeligible, start)`` of the mapping of this process that holds ``address``."""
    found, eligible, start = False, -1, -1
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
                if found:
                    start = lo
            elif found and head == "THPeligible:":
                eligible = int(line.split()[1])
    return eligible, start


@pytest.mark.parametrize("cross_layer", [False, True])
def test_cpu_caches_are_marked_for_huge_pages(monkeypatch, cross_layer):
    """Every whole huge page inside a CPU cache lies in a mapping marked MADV_HUGEPAGE
    (THPeligible), nothing is allocated beyond the tensor, and bytes and strides are those of a
    plain allocation; FKV_HUGE_PAGES=0 leaves the kernel's default ('madvise' here: not
    eligible)."""
    from fkv.tensors import _huge_page_bytes

    huge = _huge_page_bytes()
    assert huge == 2 << 20  # Linux x86-64 with transparent huge pages (CI's and the device's)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read().split("[")[1].split("]")[0]
    spec = _spec(num_blocks=512, block_size=16, num_kv_heads=2, head_size=128, num_layers=2,
                 cross_layer=cross_layer)
    assert spec.region_bytes >= 3 * huge  # one layer's buffer, or the cross-layer one

    def inner(view) -> int:  # the first huge page boundary inside the buffer
        return -(-view.data_ptr() // huge) * huge

    views = fkv.allocate(spec)
    for i, v in enumerate(views):
        v.copy_(torch.full(v.shape, float(i + 1)))
        assert v.stride() == spec.element_strides
    assert torch.equal(views[1], torch.full(views[1].shape, 2.0, dtype=views[1].dtype))
    assert views[0].storage_offset() == 0
    assert views[0].untyped_storage().nbytes() == spec.region_bytes
    assert _vma_flags(inner(views[0]))[0] == 1
    assert _vma_flags(inner(views[0]) + huge)[0] == 1
    monkeypatch.setenv("FKV_HUGE_PAGES", "0")
    plain = fkv.allocate(spec)[0]
    assert plain.untyped_storage().nbytes() == spec.region_bytes
    assert _vma_flags(inner(plain))[0] == (1 if mode == "always" else 0)


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 30), st.sampled_from([4096, 2 << 20, 1 << 30]))
def test_huge_span_is_the_longest_run_of_whole_pages_inside(start, nbytes, huge):
    from fkv.tensors import huge_span

    first, last = huge_span(start, nbytes, huge)
    assert first % huge == 0 and last % huge == 0
    assert start <= first <= last
    if last > first:
        assert last <= start + nbytes
    assert first - huge < start  # no whole page starts earlier inside
    assert last + huge > start + nbytes or last == first  # none ends later
    if last == first:  # nothing fits: no aligned page lies wholly inside
        assert -(-start // huge) * huge + huge > start + nbytes


def test_cpu_caches_stay_on_the_cpu_under_another_default_device():
    """``device="cpu"`` (the default) allocates in CPU memory whatever torch's default device is;
    ``device=None`` still means torch's default device."""
    spec = _spec(num_blocks=512, block_size=16, num_kv_heads=2, head_size=128)
    torch.set_default_device("meta")
    try:
        assert fkv.allocate(spec)[0].device == torch.device("cpu")
        assert fkv.allocate(spec, None)[0].device == torch.device("meta")
    finally:
        torch.set_default_device(None)


def test_infer_spec_errors_name_the_strides():
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    view = fkv.allocate(spec)[0]
    with pytest.raises(FkvError, match=r"infer_spec: strides \(128, 64, 1, 4, 8\) of a 'triton' "
                       r"cache of shape \(2, 2, 4, 2, 8\) match no fkv layout"):
        fkv.infer_spec(view.transpose(2, 4).contiguous().transpose(2, 4), backend="triton")
    with pytest.raises(FkvError, match=r"'backend' must be in .* \(got 'vllm'\)"):
        fkv.infer_spec(view, backend="vllm")
    with pytest.raises(FkvError, match=r"has logical axes \('B', 'N', 'C'\); a tensor of shape "
                       r"\(2, 2, 4, 2, 8\) has 5 dims"):
        fkv.infer_spec(view, backend="mla")
    with pytest.raises(FkvError, match=r"'dtype' must be the tensor's dtype 'bfloat16' \(got 'float16'\)"):
        fkv.infer_spec(view, backend="triton", dtype="float16")
    assert fkv.infer_spec(view, backend="triton", dtype=torch.bfloat16) == spec


@pytest.mark.parametrize(("device", "expected"), [
    ("gpu", "a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:0'"),
    (1.5, "a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:0'"),
    pytest.param("cuda", "a device of this machine; CUDA is not available; allocate on "
                 "device='cpu'", marks=pytest.mark.interpreter),
    pytest.param(0, "a device of this machine; CUDA is not available; allocate on device='cpu'",
                 marks=pytest.mark.interpreter),
], ids=["gpu", "float", "cuda-without-cuda", "index-without-cuda"])
def test_allocate_refuses_a_device_it_cannot_use(device, expected):
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    with pytest.raises(FkvError) as e:
        fkv.allocate(spec, device=device)
    field, _, fix = expected.partition("; ")
    assert str(e.value) == f"'device' must be {field} (got {device!r})" + (f"; {fix}" if fix else "")


def test_infer_spec_refuses_what_is_not_a_tensor():
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    view = fkv.allocate(spec)[0]
    for value, name in ((view.float().numpy(), "ndarray"), ([view], "list")):
        with pytest.raises(FkvError) as e:
            fkv.infer_spec(value, backend="triton")
        assert str(e.value) == (f"'tensor' must be a torch.Tensor (one layer's cache view, or a "
                                f"cross-layer buffer's view with its layers dim) (got {name!r})")


def test_wrap_views_existing_memory():
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8, layout="HND",
                 num_layers=2, dtype="float32")
    raw = torch.zeros(64 + 2 * spec.region_bytes, dtype=torch.uint8)
    views = fkv.tensors.wrap(raw, spec, byte_offset=64)
    views[1][1, 1, 3, 1, 7] = 1.0
    off = 64 + spec.region_bytes + spec.region_and_offset(block=1, kv=1, token=3, head=1, channel=7)[1]
    assert raw[off:off + 4].view(torch.float32).item() == 1.0
    with pytest.raises(FkvError, match=r"wrap: spec needs 2048 bytes at offset 64, but the buffer holds 2048"):
        fkv.tensors.wrap(raw[:2048], spec, byte_offset=64)


def test_cli_show(capsys):
    from fkv.cli import main

    assert main(["show", "--layout", "HND", "--blocks", "4", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "(0, 1, 3, 2, 4)" in out and "(4, 2, 8, 16, 128)" in out and "65,536" in out
    assert "L B two H N C -> L two B N H C" in out
    assert main(["show", "--layout", "NDH"]) == 2
    assert "'layout' must be in ('NHD', 'HND')" in capsys.readouterr().err  # a usage error: stderr


@pytest.mark.parametrize(("name", "dtype"), [("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
                                             ("fp8_e5m2", "float8_e5m2"), ("fp8_inc", "float8_e4m3fn")])
def test_cli_show_takes_the_engine_dtype_names(capsys, name, dtype):
    from fkv.cli import main

    assert main(["show", "--dtype", name, "--blocks", "4"]) == 0
    out = capsys.readouterr().out
    assert f"dtype='{dtype}')" in out and "32,768" in out  # one byte per element: 16 x 8 x 128 x 2


def _exhaustive_atoms(sides, full):
    """The planner's search written out: every subset of ``full``'s axes to split, fewest atoms
    first (then fewer axes, then ``itertools.combinations`` order), the first whose atom is
    contiguous (:func:`fkv.layout.box_is_contiguous`) with one element order on every side."""
    import itertools
    import math

    from fkv.layout import box_is_contiguous

    names = [a for a, _ in full]
    sizes = dict(full)
    subsets = [s for k in range(len(names) + 1) for s in itertools.combinations(names, k)]
    subsets.sort(key=lambda s: (math.prod(sizes[a] for a in s), len(s)))
    for split in subsets:
        ext = tuple((a, 1 if a in split else e) for a, e in full)
        extd = {**dict(ext), "C": sides[0].head_size}
        orders = {tuple(a for a in s.physical_axes if extd.get(a, 1) > 1) for s in sides}
        if len(orders) == 1 and all(box_is_contiguous(s, ext) for s in sides):
            return split, math.prod(sizes[a] for a in split)
    raise AssertionError("no contiguous atom")


@settings(max_examples=300)
@given(spec_pairs(), st.booleans(), st.data())
def test_fewest_contiguous_atoms_is_the_exhaustive_search(pair, two_sides, data):
    """The planner's atom search (one pass per subset and side) picks what the exhaustive search
    over ``box_is_contiguous`` picks, for one side (staging) and two (direct). Extents are drawn
    from one, half and all of each axis: where contiguity and element order change."""
    from fkv.layout import fewest_contiguous_atoms

    a, b = pair
    sides = (a, b) if two_sides else (a,)
    cross = all(s.cross_layer for s in sides) and a.num_layers > 1
    full = []
    for axis in ("L", "two", "N", "H"):
        if axis not in a.axis_sizes or (axis == "L" and not cross):
            continue
        size = a.axis_sizes[axis]
        full.append((axis, size if axis in ("L", "two") else data.draw(
            st.sampled_from(sorted({1, max(1, size // 2), size})), label=axis)))
    full = tuple(full)
    assert fewest_contiguous_atoms(sides, full) == _exhaustive_atoms(sides, full)


# -- holes found by mutation (2026-12-04) ---------------------------------------------------------

def test_regions_of_per_layer_and_cross_layer_specs():
    """Per-layer: one region per layer, the layer's index is the region; cross-layer: one
    region of every layer (bf16, NB=5, N=16, H=8, D=128: 65536 B a page)."""
    per_layer = _spec(layout="HND", num_layers=3)
    assert (per_layer.num_regions, per_layer.region_bytes) == (3, 5 * 65536)
    assert per_layer.region_and_offset(layer=2, block=1, kv=1, head=4) == (2, 114688)
    assert per_layer.region_and_offset(layer=1, block=1, kv=1, head=4) == (1, 114688)
    cross = per_layer.evolve(cross_layer=True)
    assert (cross.num_regions, cross.region_bytes) == (1, 3 * 5 * 65536)


def test_span_of_a_cross_layer_buffer_takes_layer_0_unless_told():
    # phys (NB, two, H, L, N, D) = (5, 2, 8, 3, 16, 128): element strides B 98304, two 49152,
    # H 6144, L 2048, N 128.
    cross = _spec(layout="HND", num_layers=3, cross_layer=True)
    assert cross.span(B=1, two=0, H=2) == ((98304 + 2 * 6144) * 2, 16 * 128 * 2)
    assert cross.span(B=1, two=0, H=2, L=2) == ((98304 + 2 * 6144 + 2 * 2048) * 2, 16 * 128 * 2)
    assert cross.span(B=1, two=0, H=2, L=(0, 3)) == ((98304 + 2 * 6144) * 2, 3 * 16 * 128 * 2)


@pytest.mark.parametrize("bad", [(3, 3), (5, 4), 8, -1])
def test_span_refuses_empty_and_reversed_ranges(bad):
    with pytest.raises(FkvError) as e:
        _spec(layout="HND").span(B=0, H=bad)
    assert str(e.value) == f"span: H={bad!r} outside [0, 8)"


def test_same_bytes_needs_the_same_dtype():
    assert not _spec().same_bytes(_spec(dtype="float16"))
    assert not _spec(num_kv_heads=1, layout="NHD").same_bytes(
        _spec(num_kv_heads=1, layout="HND", dtype="float8_e4m3fn"))
    assert _spec(dtype="fp8").same_bytes(_spec(dtype="float8_e4m3fn"))


def test_rearrange_names_every_geometry_difference():
    with pytest.raises(FkvError) as e:
        rearrange_pattern(_spec(num_layers=3), _spec(num_blocks=4, dtype="float16", num_layers=2))
    assert str(e.value) == ("rearrange: src and dst must have the same geometry; they differ in "
                            "num_blocks: src 5, dst 4; dtype: src 'bfloat16', dst 'float16'; "
                            "num_layers: src 3, dst 2")


def test_repr_shows_layers_and_cross_layer():
    assert repr(_spec(layout="HND", num_layers=3, cross_layer=True)) == (
        "KVCacheSpec(backend='triton', layout='HND', num_blocks=5, block_size=16, num_kv_heads=8, "
        "head_size=128, dtype='bfloat16', num_layers=3, cross_layer=True)")
    assert repr(_spec(num_layers=3)).endswith("dtype='bfloat16', num_layers=3)")


@pytest.mark.parametrize("extent", [0, 9])
def test_box_is_contiguous_refuses_an_extent_outside_the_axis(extent):
    from fkv.layout import box_is_contiguous

    with pytest.raises(FkvError) as e:
        box_is_contiguous(_spec(layout="HND"), (("two", 1), ("H", extent)))
    assert str(e.value) == f"box_is_contiguous: H extent {extent} outside [1, 8]"


def test_strides_match_ignores_only_size_one_dims():
    from fkv.layout import strides_match

    assert strides_match((256, 128, 16, 16, 1), (4, 2, 8, 1, 16), (256, 128, 16, 12345, 1))
    assert not strides_match((256, 128, 16, 16, 1), (4, 2, 8, 2, 16), (256, 128, 16, 12345, 1))
    # one KV head: an HND buffer has NHD's strides but the H dim's; infer_spec says NHD
    hnd = _spec(layout="HND", num_blocks=2, block_size=4, num_kv_heads=1, head_size=8)
    (view,) = fkv.allocate(hnd)
    assert view.stride() == (64, 32, 8, 32, 1)
    assert fkv.infer_spec(view, backend="triton") == hnd.evolve(layout="NHD")
    odd = view.as_strided(view.shape, (64, 32, 8, 7, 1))  # a size-1 dim's stride says nothing
    assert fkv.infer_spec(odd, backend="triton") == hnd.evolve(layout="NHD")


def test_same_bytes_needs_the_same_sizes():
    assert not _spec(num_blocks=5).same_bytes(_spec(num_blocks=4))
    assert not _spec(num_kv_heads=1, layout="NHD").same_bytes(
        _spec(num_kv_heads=1, layout="HND", block_size=8))


def test_infer_spec_refuses_a_k_v_dim_not_of_size_2_even_with_one_block():
    # One block: the B dim's stride says nothing, so only the size check stands between a 3-wide
    # K/V dim and a spec of 2.
    with pytest.raises(FkvError) as e:
        fkv.infer_spec(torch.zeros(1, 3, 4, 2, 8, dtype=torch.bfloat16), backend="triton")
    assert str(e.value) == "infer_spec: the K/V dim of a 'triton' cache must have size 2 (shape (1, 3, 4, 2, 8))"


def test_same_bytes_needs_the_same_logical_view_not_only_the_same_buffer():
    """Cross-layer triton and flash_attn NHD caches lay their buffers out alike (B L two N H C)
    but index their logical views differently, so they are not the same bytes."""
    triton = _spec(layout="NHD", num_blocks=2, num_layers=2, cross_layer=True)  # sizes alike too
    flash = triton.evolve(backend="flash_attn")
    assert triton.physical_axes == flash.physical_axes == ("B", "L", "two", "N", "H", "C")
    assert (triton.logical_axes, flash.logical_axes) == (("B", "two", "N", "H", "C"),
                                                         ("two", "B", "N", "H", "C"))
    assert not triton.same_bytes(flash) and not flash.same_bytes(triton)
    assert triton.same_bytes(triton.evolve()) and flash.same_bytes(flash.evolve())


# -- more holes found by mutation (2026-12-04): infer_spec and allocate --------------------


def test_infer_spec_returns_nhd_when_one_head_makes_the_layouts_identical():
    """One KV head: NHD and HND give the same strides; the docstring promises NHD."""
    hnd = _spec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8, layout="HND")
    view = fkv.allocate(hnd)[0]
    assert view.stride() == (64, 32, 8, 32, 1)  # NHD would give the size-1 head dim 8
    assert fkv.infer_spec(view, backend="triton") == hnd.evolve(layout="NHD")


def test_infer_spec_refuses_a_kv_dim_that_is_not_two():
    with pytest.raises(FkvError) as e:
        fkv.infer_spec(torch.empty(2, 3, 4, 2, 8, dtype=torch.bfloat16), backend="triton")
    assert str(e.value) == ("infer_spec: the K/V dim of a 'triton' cache must have size 2 "
                            "(shape (2, 3, 4, 2, 8))")


def test_infer_spec_whole_buffer_is_cross_layer_only():
    """A tensor with a layers dim is a cross-layer buffer: one layer unsqueezed is a cross-layer
    spec of 1 layer, and a layer broadcast over 3 layers (stride 0: all alias) is refused rather
    than read as 3 per-layer caches."""
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    view = fkv.allocate(spec)[0]
    assert fkv.infer_spec(view.unsqueeze(0), backend="triton") == spec.evolve(cross_layer=True)
    with pytest.raises(FkvError) as e:
        fkv.infer_spec(view.expand(3, *view.shape), backend="triton")
    assert str(e.value).startswith("infer_spec: strides (0, 128, 64, 16, 8, 1) of a 'triton' "
                                   "cache of shape (3, 2, 2, 4, 2, 8) match no fkv layout (NHD or "
                                   "HND, per-layer or cross-layer with num_layers=3)")


def test_infer_spec_dtype_errors_name_torch_dtypes_without_prefix_and_prefix_spec_errors():
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    view = fkv.allocate(spec)[0]
    with pytest.raises(FkvError) as e:
        fkv.infer_spec(view, backend="triton", dtype=torch.float16)
    assert str(e.value) == "'dtype' must be the tensor's dtype 'bfloat16' (got 'float16')"
    with pytest.raises(FkvError) as e:
        fkv.infer_spec(torch.empty(2, 2, 4, 2, 8, dtype=torch.float64), backend="triton")
    assert str(e.value).startswith("infer_spec: 'dtype' must be in ('bfloat16', ")
    assert str(e.value).endswith(" (got 'float64')")


def test_allocate_refuses_what_is_not_a_spec_and_a_bool_device():
    with pytest.raises(FkvError) as e:
        fkv.allocate("HND")
    assert str(e.value) == "'spec' must be a KVCacheSpec (got 'HND')"
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    with pytest.raises(FkvError) as e:  # True is an int, but not an accelerator's index
        fkv.allocate(spec, device=True)
    assert str(e.value) == ("'device' must be a torch.device or a device string such as 'cpu', "
                            "'cuda' or 'cuda:0' (got True)")


def test_allocate_places_non_cpu_caches_on_the_device_asked():
    spec = _spec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8, layout="HND",
                 num_layers=2)
    views = fkv.allocate(spec, device="meta")
    assert [v.device for v in views] == [torch.device("meta")] * 2
    assert [v.stride() for v in views] == [spec.element_strides] * 2 == [(128, 64, 8, 32, 1)] * 2


def test_allocate_checks_a_cuda_index_against_the_device_count(monkeypatch):
    """Without a GPU here: a machine with one CUDA device takes cuda:0, refuses cuda:1."""
    from fkv.tensors import _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _device(torch, "cuda:0") == torch.device("cuda:0")
    with pytest.raises(FkvError) as e:
        _device(torch, "cuda:1")
    assert str(e.value) == "'device' must be a CUDA device of this machine (indices 0 to 0) (got 'cuda:1')"


def test_no_huge_pages_off_linux(monkeypatch):
    """Off Linux the THP size is 0 (no MADV_HUGEPAGE advice), even where the sysfs file exists."""
    from fkv import tensors

    monkeypatch.setattr(sys, "platform", "darwin")
    tensors._huge_page_bytes.cache_clear()
    try:
        assert tensors._huge_page_bytes() == 0 and not tensors.huge_pages_wanted()
    finally:
        monkeypatch.undo()
        tensors._huge_page_bytes.cache_clear()
    assert tensors._huge_page_bytes() == 2 << 20
