"""Layout conversion and transfer staging: ``move``, ``convert``, ``gather``, ``scatter``.

All four are thin uses of one Triton kernel (:mod:`fkv.ops._move_kernel`) that copies the tokens of
a request between two paged views of one layer, each laid out per its own :class:`KVCacheSpec`:
token ``i`` lives in source block ``src_block_ids[i // N_src]`` slot ``i % N_src`` and lands in
destination block ``dst_block_ids[i // N_dst]`` slot ``i % N_dst``. So one call converts layouts
(NHD <-> HND, blocks-first <-> K/V-first, per-layer <-> cross-layer), selects a contiguous range
of heads, and re-chunks between block sizes.

Shapes (one layer's logical view, as ``fkv.allocate`` returns it):

- triton / flashinfer: ``(NB, 2, N, H, D)``; flash_attn: ``(2, NB, N, H, D)``; mla: ``(NB, N, D)``
- staging (``gather`` output, ``scatter`` input): ``[n, 2, h, N, D]`` (K/V, heads, tokens, dim:
  canonical HND, contiguous) for K/V backends, ``[n, N, D]`` for mla.

Every input is checked before anything launches or is written; bad input raises
:class:`fkv.FkvError` naming the argument, the value and what was expected. Block ids may be a
sequence, a numpy array or an int tensor on the CPU or the cache's device. ``validate=`` (every op;
True, False or None) range-checks them and refuses a destination block that the call writes twice
(``scatter``, ``move``) or, in a ``move`` whose ``dst`` is ``src`` itself, that it also reads: by
default only host-side ids (free); ids already on a GPU are checked only with ``validate=True``
(a device sync, cached per tensor until it is modified in place). Unchecked ids outside
``0..num_blocks-1`` move nothing: the kernel masks their tokens (neither read nor written).
``gather``'s ``out`` and ``scatter``'s ``staging`` must not overlap the cache (always checked).

Launch cost: ``gather``/``scatter`` remember each input signature they have checked (spec, tensor
shapes/strides/dtypes/devices, heads, counts); a repeat with int32/int64 ids already on the cache's
device skips the checks and launches the compiled kernel directly (:mod:`fkv.ops._launch`), so the
host side costs a few µs and a GPU-sized gather stays GPU-bound.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec, Layout, check_same_geometry
from fkv.ops._spec import check_cache, check_validate
from fkv.tensors import _inverse, allocate, require_torch, torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["convert", "gather", "move", "scatter", "staging_spec"]


# -- the public ops -------------------------------------------------------------------------------
def move(src: torch.Tensor, src_spec: KVCacheSpec, src_block_ids: Any,
         dst: torch.Tensor, dst_spec: KVCacheSpec, dst_block_ids: Any, *,
         src_heads: tuple[int, int] | slice | None = None,
         dst_heads: tuple[int, int] | slice | None = None,
         num_tokens: int | None = None, validate: bool | None = None,
         heads: tuple[int, int] | slice | None = None) -> None:
    """Copy one request's tokens of one layer from ``src`` (per ``src_spec``) into ``dst``.

    Token ``i`` lives in block ``src_block_ids[i // src_spec.block_size]`` slot
    ``i % src_spec.block_size`` and goes to block ``dst_block_ids[i // dst_spec.block_size]`` slot
    ``i % dst_spec.block_size``: the block sizes may differ (re-chunking, e.g. 4 <-> 8), as may the
    layouts and backends. ``num_tokens`` defaults to ``len(src_block_ids) * src_spec.block_size``
    and must fit both id lists. ``src_heads=(a, b)`` / ``dst_heads=(c, d)`` (or ``slice(a, b)``,
    step 1, a None bound meaning the first / past the last head) pick contiguous head
    ranges of equal length (default: all heads); ``heads=`` is the same range on both sides
    (``src_heads=dst_heads=heads``, as ``gather``/``scatter`` take it; FkvError with either of
    the others). K and V both move (MLA: the latent). This is the
    re-chunking API; ``gather``/``scatter`` expose it too (``block_size=``, ``num_tokens=``).

    ``src``, ``dst``: one layer's logical view each (e.g. ``(NB, 2, N, H, D)`` for triton,
    ``(2, NB, N, H, D)`` for flash_attn, ``(NB, N, D)`` for mla). ``dst`` must not overlap the
    source tokens: with ``validate`` on, a ``dst`` that is ``src`` itself (the same view) takes no
    destination block that is also a source block (heads overlapping). ``validate``: range-check
    the ids, and refuse a destination block listed twice (default: host-side ids only; see the
    module docstring).

    >>> import torch, fkv
    >>> a = fkv.KVCacheSpec(layout="NHD", num_blocks=4, block_size=4, num_kv_heads=2, head_size=8)
    >>> b = a.evolve(layout="HND", block_size=8, num_blocks=2)
    >>> (src,), (dst,) = fkv.allocate(a), fkv.allocate(b)
    >>> _ = src.copy_(torch.randn(src.shape))
    >>> move(src, a, [3, 1, 2], dst, b, [1, 0], num_tokens=10)   # 10 tokens: 4-blocks -> 8-blocks
    >>> torch.equal(dst[1, :, 5], src[1, :, 1]) and torch.equal(dst[0, :, 1], src[2, :, 1])
    True
    """
    src_heads, dst_heads = move_heads(heads, src_heads, dst_heads)
    _launch(_check_move(src, src_spec, src_block_ids, dst, dst_spec, dst_block_ids,
                        src_heads=src_heads, dst_heads=dst_heads, num_tokens=num_tokens,
                        validate=validate), "src", "move")


def convert(src: Any, src_spec: KVCacheSpec, dst_spec: KVCacheSpec, *, out: Any = None,
            block_ids: Any = None, validate: bool | None = None) -> Any:
    """Convert all layers of a cache from ``src_spec``'s layout to ``dst_spec``'s (same geometry).

    Any pair: NHD <-> HND, blocks-first (triton, flashinfer) <-> K/V-first (flash_attn),
    per-layer <-> cross-layer. ``src`` is the list of ``num_layers`` logical views that
    ``fkv.allocate(src_spec)`` returns (a single tensor when ``num_layers == 1``). Returns ``dst``
    views of the same kind: newly allocated with ``fkv.allocate(dst_spec)`` on ``src``'s device, or
    ``out`` (checked against ``dst_spec``; must not overlap ``src``). ``block_ids=`` converts only
    those blocks, in place in ``out`` (e.g. the blocks a transfer just landed); the others are left
    as they are (``validate`` as in :func:`move`).

    >>> import torch, fkv
    >>> nhd = fkv.KVCacheSpec(layout="NHD", num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> src = fkv.allocate(nhd)
    >>> _ = src[0].copy_(torch.randn(src[0].shape))
    >>> (dst,) = convert(src, nhd, nhd.evolve(layout="HND"))
    >>> dst.stride(), torch.equal(dst, src[0])
    ((128, 64, 8, 32, 1), True)
    """
    src_layers, out_layers, ids, single = _check_convert(src, src_spec, dst_spec, out, block_ids,
                                                         validate=validate)
    if out_layers is None:
        out_layers = allocate(dst_spec, device=src_layers[0].device)
        out = out_layers[0] if single else out_layers
    heads = src_spec.num_kv_heads
    for s, d in zip(src_layers, out_layers):
        _launch(_Move(s, src_spec, ids.tensor, 0, d, dst_spec, ids.tensor, 0, heads,
                      ids.count * src_spec.block_size), "src", "convert")
    return out


def gather(cache: torch.Tensor, spec: KVCacheSpec, block_ids: Any, *,
           heads: tuple[int, int] | slice | None = None, out: torch.Tensor | None = None,
           num_tokens: int | None = None, block_size: int | None = None,
           validate: bool | None = None) -> torch.Tensor:
    """Pack blocks (and a head range) of one layer into a contiguous staging buffer.

    Returns ``[n, 2, h, N, D]`` (K/V, heads, tokens, dim: canonical HND) for K/V backends,
    ``[n, N, D]`` for mla, where ``h = b - a`` for ``heads=(a, b)`` or ``heads=slice(a, b)``
    (default all heads; a slice has step 1, a None bound means the first / past the last head; a
    negative bound or another step raises FkvError). Works from
    any layout. Re-chunking: with ``block_size=Ns`` the staging blocks hold ``Ns`` tokens (token
    ``i`` goes to staging block ``i // Ns`` slot ``i % Ns``) and ``n = ceil(num_tokens / Ns)``;
    ``num_tokens`` defaults to ``len(block_ids) * spec.block_size``. Staging slots past
    ``num_tokens`` are zero when gather allocates, untouched in ``out``. ``validate`` as in
    :func:`move` (unchecked out-of-range ids leave their staging tokens unwritten).

    >>> import torch, fkv
    >>> spec = fkv.KVCacheSpec(layout="NHD", num_blocks=8, block_size=4, num_kv_heads=4, head_size=8)
    >>> (cache,) = fkv.allocate(spec)
    >>> _ = cache.copy_(torch.randn(cache.shape))
    >>> st = gather(cache, spec, [5, 2], heads=(2, 4))
    >>> tuple(st.shape), torch.equal(st[0, 1, 0], cache[5, 1, :, 2])
    ((2, 2, 2, 4, 8), True)
    """
    check_validate(validate)
    heads = _plain_heads(heads)
    sig = _staging_signature("gather", cache, spec, block_ids, heads, out, num_tokens, block_size)
    fast = _FAST.get(sig) if sig is not None else None
    if fast is not None:
        if fast.host_ids if validate is None else validate:
            _check_range(block_ids, spec, "block_ids")
        if out is None:
            out = fast.alloc(fast.shape, dtype=fast.dtype, device=cache.device)
        else:
            _check_disjoint(sig, cache, out, "gather", _GATHER_OVERLAP)
        # per-call arguments as launch_move passes them (the src tensor fills unused pointers)
        fast.site(fast.grid, (cache, out, block_ids, cache, cache, cache, fast.num_tokens))
        return out
    m, staging = _check_gather(cache, spec, block_ids, heads, out, num_tokens, block_size,
                               validate=validate)
    _launch(m, "cache", "gather")
    if sig is not None and m.num_tokens and m.src_ids is block_ids:
        _remember(sig, m, staging, zero=out is None and m.num_tokens % m.dst_spec.block_size != 0)
    return staging


def scatter(staging: torch.Tensor, cache: torch.Tensor, spec: KVCacheSpec, block_ids: Any, *,
            heads: tuple[int, int] | slice | None = None, num_tokens: int | None = None,
            block_size: int | None = None, validate: bool | None = None) -> None:
    """The inverse of :func:`gather`: write a staging buffer into blocks (and heads) of one layer.

    ``staging`` is ``[n, 2, h, Ns, D]`` (mla ``[n, Ns, D]``), contiguous, with ``Ns = block_size``
    (default ``spec.block_size``) and ``n = ceil(num_tokens / Ns)``; ``num_tokens`` defaults to
    ``len(block_ids) * spec.block_size``. Only the selected heads of the tokens moved are written.
    ``validate`` as in :func:`move` (tokens of unchecked out-of-range ids are not written).

    >>> import torch, fkv
    >>> spec = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=4, head_size=8)
    >>> (cache,) = fkv.allocate(spec)
    >>> staging = torch.randn(2, 2, 2, 4, 8, dtype=torch.bfloat16)
    >>> scatter(staging, cache, spec, [6, 1], heads=(0, 2))
    >>> torch.equal(cache[1, 0, :, 1], staging[1, 0, 1])
    True
    """
    check_validate(validate)
    heads = _plain_heads(heads)
    sig = _staging_signature("scatter", cache, spec, block_ids, heads, staging, num_tokens,
                             block_size)
    fast = _FAST.get(sig) if sig is not None else None
    if fast is not None:
        if fast.host_ids if validate is None else validate:
            _check_range(block_ids, spec, "block_ids")
            _check_distinct(block_ids, -(-fast.num_tokens // spec.block_size), "block_ids")
        _check_disjoint(sig, cache, staging, "scatter", _SCATTER_OVERLAP)
        fast.site(fast.grid, (staging, cache, staging, block_ids, staging, staging, fast.num_tokens))
        return
    m = _check_scatter(staging, cache, spec, block_ids, heads, num_tokens, block_size,
                       validate=validate)
    _launch(m, "cache", "scatter")
    if sig is not None and m.num_tokens and m.dst_ids is block_ids:
        _remember(sig, m, None, zero=False)


def staging_spec(spec: KVCacheSpec, num_blocks: int, *, num_heads: int | None = None,
                 block_size: int | None = None) -> KVCacheSpec:
    """The spec whose physical buffer is a staging tensor of ``spec``'s cache (one layer).

    K/V backends: canonical HND blocks-first, physical ``[n, 2, h, N, D]``; mla: ``[n, N, D]``.

    >>> s = KVCacheSpec(backend="flash_attn", num_blocks=9, block_size=16, num_kv_heads=8,
    ...                 head_size=128)
    >>> staging_spec(s, 3, num_heads=4).physical_shape
    (3, 2, 4, 16, 128)
    """
    return spec.evolve(
        backend="mla" if spec.is_mla else "triton", layout=Layout.HND, num_blocks=num_blocks,
        block_size=spec.block_size if block_size is None else block_size,
        num_kv_heads=spec.num_kv_heads if num_heads is None else num_heads,
        num_layers=1, cross_layer=False,
    )


# -- validation (shared with fkv.ops.reference._convert) -----------------------------------------
@dataclass(frozen=True)
class _Ids:
    tensor: Any  # int tensor on the cache's device, or None for the identity 0..count-1
    count: int
    checked: bool = False  # the values were validated (range), so repeats are checked too
    source: Any = None     # the int tensor as given (CPU or the cache's device): memo key


@dataclass(frozen=True)
class _Move:
    """One validated move: everything the kernel (or the reference) needs."""

    src: Any
    src_spec: KVCacheSpec
    src_ids: Any
    src_head_start: int
    dst: Any
    dst_spec: KVCacheSpec
    dst_ids: Any
    dst_head_start: int
    num_heads: int
    num_tokens: int


def _launch(m: _Move, field: str, op: str) -> None:
    """Launch the move kernel (FkvError first when it is compiled and ``field`` is off CUDA)."""
    from fkv.ops._launch import check_kernel_device
    from fkv.ops._move_kernel import _LAUNCHER, launch_move

    check_kernel_device(m.src.device, _LAUNCHER.kernel, field, op)
    launch_move(m.src, m.src_spec, m.src_ids, m.src_head_start, m.dst, m.dst_spec, m.dst_ids,
                m.dst_head_start, m.num_heads, m.num_tokens)


def move_heads(heads: Any, src_heads: Any, dst_heads: Any) -> tuple[Any, Any]:
    """``(src_heads, dst_heads)`` of a move called with ``heads=`` (the same range on both
    sides) or with the two; FkvError when both forms are given (which range would win is
    ambiguous)."""
    if heads is None:
        return src_heads, dst_heads
    if src_heads is not None or dst_heads is not None:
        raise FkvError(f"move: pass 'heads' (the same range on both sides) or "
                       f"'src_heads'/'dst_heads', not both (got heads={heads!r}, "
                       f"src_heads={src_heads!r}, dst_heads={dst_heads!r})")
    return heads, heads


def _check_spec(spec: Any, name: str) -> None:
    if not isinstance(spec, KVCacheSpec):
        raise field_error(name, type(spec).__name__, "a KVCacheSpec")


def _is_tensor(x: Any) -> bool:
    torch = require_torch()
    return isinstance(x, torch.Tensor)


def _layers(x: Any, spec: KVCacheSpec, name: str) -> tuple[list[Any], bool]:
    """The per-layer views of a cache argument (a list, or one tensor when num_layers == 1)."""
    if _is_tensor(x):
        if spec.num_layers != 1:
            raise FkvError(f"{name!r} is one tensor but the spec has num_layers={spec.num_layers}; "
                           f"pass the list of {spec.num_layers} layer views fkv.allocate returns")
        check_cache(x, spec, name)
        return [x], True
    if not isinstance(x, (list, tuple)):
        raise field_error(name, type(x).__name__, "a list of layer views (as fkv.allocate returns) "
                          "or one tensor when num_layers == 1")
    if len(x) != spec.num_layers:
        raise FkvError(f"{name!r} holds {len(x)} layer views but the spec has "
                       f"num_layers={spec.num_layers}")
    for i, view in enumerate(x):
        if not _is_tensor(view):
            raise field_error(f"{name}[{i}]", type(view).__name__, "a tensor")
        check_cache(view, spec, f"{name}[{i}]")
        if view.device != x[0].device:
            raise FkvError(f"{name!r}: layer {i} is on {view.device} but layer 0 on {x[0].device}; "
                           f"all layers must be on one device")
    return list(x), False


def _check_device(t: Any, device: Any, name: str, other: str) -> None:
    if t.device != device:
        raise FkvError(f"{name!r} is on {t.device} but {other!r} is on {device}; "
                       f"move them to one device")


def _heads(heads: Any, spec: KVCacheSpec, name: str) -> tuple[int, int]:
    """``(start, stop)`` of a head range given as None (all), a ``(start, stop)`` pair or a
    ``slice`` (step 1; a None bound means the first / past the last head)."""
    total = spec.num_kv_heads
    if heads is None:
        return 0, total
    expected = (f"a slice(start, stop) or a (start, stop) pair of ints with 0 <= start < stop <= "
                f"{total} (a contiguous range of this rank's {total} heads)")
    if isinstance(heads, slice):
        step = heads.step
        if not (step is None or (type(step) is int and step == 1)):
            raise field_error(name, heads, expected, f"heads are one contiguous range: drop the "
                              f"step (e.g. slice({heads.start}, {heads.stop}))")
        bounds = (0 if heads.start is None else heads.start,
                  total if heads.stop is None else heads.stop)
    else:
        bounds = heads
    try:
        a, b = (operator.index(v) for v in bounds)
        if any(isinstance(v, bool) for v in bounds):
            raise TypeError
    except (TypeError, ValueError):
        raise field_error(name, heads, expected) from None
    if isinstance(heads, slice) and (a < 0 or b < 0):
        raise field_error(name, heads, expected, f"negative bounds (counted from the end) are "
                          f"not taken: write the heads out, e.g. slice({a % total if a < 0 else a}, "
                          f"{b % total if b < 0 else b})")
    if not 0 <= a < b <= total:
        raise field_error(name, heads if isinstance(heads, slice) else tuple(heads), expected)
    return a, b


def _plain_heads(heads: Any) -> Any:
    """A ``slice(a, b)`` of two ints (step None or 1) as the pair ``(a, b)``, for the fast path's
    signature; anything else unchanged (the checked path validates it)."""
    if (type(heads) is slice and type(heads.start) is int and type(heads.stop) is int
            and (heads.step is None or (type(heads.step) is int and heads.step == 1))
            and 0 <= heads.start and 0 <= heads.stop):
        return heads.start, heads.stop
    return heads


# Value checks of ids that live on a GPU need a device sync; remember their results per id tensor
# until it is freed or modified in place (its version counter moves).
_BOUNDS: dict[tuple[int, Any], tuple[Any, int, Any]] = {}


def _memo(t: Any, what: Any, compute: Any) -> Any:
    """``compute()``, cached per tensor object, version and ``what`` (no re-sync on reuse)."""
    try:
        version = t._version
    except RuntimeError:  # inference-mode tensors track no version: check every time
        version = None
    key = (id(t), what)
    hit = _BOUNDS.get(key)
    if version is not None and hit is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    value = compute()
    if version is not None:
        if len(_BOUNDS) > 1024:
            _BOUNDS.clear()
        ref = weakref.ref(t, lambda _r, key=key: _BOUNDS.pop(key, None))
        _BOUNDS[key] = (ref, version, value)
    return value


def _bounds(t: Any) -> tuple[int, int]:
    """(min, max) of an int tensor; cached per tensor object and version (no re-sync on reuse)."""
    torch = require_torch()
    return _memo(t, "bounds", lambda: tuple(int(v) for v in
                                            torch.stack(torch.aminmax(t)).tolist()))


def _first_repeat(t: Any) -> int | None:
    """The smallest id that the 1-D int tensor ``t`` holds more than once, or None (one sync)."""
    torch = require_torch()
    if t.numel() < 2:
        return None
    s = torch.sort(t).values
    same = s[1:] == s[:-1]
    hit, value = torch.stack([same.any().to(s.dtype), s[1:][same.to(torch.int8).argmax()]]).tolist()
    return int(value) if hit else None


def _check_distinct(t: Any, used: int, name: str) -> None:
    """Raise FkvError when the first ``used`` ids of ``t`` (the destination blocks a call writes)
    repeat a block: its tokens would be written twice, the last write winning (racy on a GPU)."""
    first = _memo(t, ("repeat", used), lambda: _first_repeat(t[:used]))
    if first is not None:
        raise FkvError(f"{name!r} repeats block {first}: two tokens would land in one slot (the "
                       f"last write wins); pass each destination block once")


def _same_view(a: Any, b: Any) -> bool:
    """Whether two tensors are the same view of the same memory (same address, shape, strides)."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


def _check_dst_ids(sids: _Ids, src_block_size: int, dids: _Ids, dst_block_size: int, n: int,
                   names: tuple[str, str], aliased: bool) -> None:
    """The value checks of a move's destination ids (those that were validated): no destination
    block written twice and, when ``aliased`` (dst is src itself, heads overlapping), no
    destination block that is also a source block (the copy would overwrite tokens it reads)."""
    if n == 0:
        return
    used = -(-n // dst_block_size)
    if dids.checked:
        _check_distinct(dids.source, used, names[1])
    known = [ids.checked or ids.tensor is None for ids in (sids, dids)]  # None: 0, 1, ...
    if not (aliased and all(known)):
        return
    torch = require_torch()
    given = sids.tensor if sids.tensor is not None else dids.tensor
    device = None if given is None else given.device

    def blocks(ids: _Ids, count: int) -> Any:
        if ids.tensor is None:
            return torch.arange(count, device=device)
        return ids.tensor[:count].to(torch.int64)

    dst_used = blocks(dids, used)
    shared = torch.isin(dst_used, blocks(sids, -(-n // src_block_size)))
    hit, i = torch.stack([shared.any().to(torch.int64), shared.to(torch.int8).argmax()]).tolist()
    if hit:
        raise FkvError(f"{names[1]!r} holds block {int(dst_used[i])}, which {names[0]!r} also "
                       f"holds, and 'dst' is 'src' itself: the move would overwrite tokens it "
                       f"still reads; move into blocks that are not sources (or through a "
                       f"separate buffer)")


def _block_ids(ids: Any, spec: KVCacheSpec, name: str, device: Any,
               validate: bool | None = True) -> _Ids:
    """Block ids as an int32/int64 tensor on ``device``; None means every block in order.

    ``validate``: range-check against ``spec.num_blocks`` (True), or only ids that are not on a GPU
    already (None: free on the host, a device sync otherwise), or not at all (False).
    """
    check_validate(validate)
    if isinstance(ids, _Ids):
        return ids
    torch = require_torch()
    if ids is None:
        return _Ids(None, spec.num_blocks)
    expected = "a 1-D sequence or tensor of int block ids"
    if isinstance(ids, torch.Tensor):
        t = ids
    else:
        try:
            t = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise field_error(name, ids, expected) from None
        if t.numel() == 0:
            t = t.to(torch.int64)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or t.dim() != 1:
        shown = ids if not isinstance(ids, torch.Tensor) else f"tensor {t.dtype} {tuple(t.shape)}"
        raise field_error(name, shown, expected)
    if t.device.type != "cpu" and t.device != device:
        raise FkvError(f"{name!r} is on {t.device} but the cache is on {device}; pass the ids on "
                       f"the CPU or on the cache's device")
    if t.dtype not in (torch.int32, torch.int64):
        t = t.to(torch.int64)
    n = t.numel()
    checked = bool(n) and (t.device.type == "cpu" if validate is None else validate)
    if checked:
        _check_range(t, spec, name)
    return _Ids(t.to(device).contiguous(), n, checked, t)


def _check_range(t: Any, spec: KVCacheSpec, name: str) -> None:
    """Raise FkvError unless every id of the (non-empty, 1-D int) tensor ``t`` is a block of spec."""
    lo, hi = _bounds(t)
    if lo < 0 or hi >= spec.num_blocks:
        bad = lo if lo < 0 else hi
        raise FkvError(f"{name!r} holds block id {bad} but the cache has num_blocks="
                       f"{spec.num_blocks} (valid ids: 0..{spec.num_blocks - 1})")


def _num_tokens(num_tokens: Any, default: int, capacity: dict[str, int]) -> int:
    if num_tokens is None:
        num_tokens = default
    try:
        if isinstance(num_tokens, bool):
            raise TypeError
        value = operator.index(num_tokens)
    except TypeError:
        raise field_error("num_tokens", num_tokens, "a non-negative int") from None
    if value < 0:
        raise field_error("num_tokens", value, "a non-negative int")
    for what, cap in capacity.items():
        if value > cap:
            raise FkvError(f"'num_tokens' is {value} but {what} hold only {cap} tokens; pass "
                           f"more block ids or fewer tokens")
    return value


def _check_move(src: Any, src_spec: Any, src_block_ids: Any, dst: Any, dst_spec: Any,
                dst_block_ids: Any, *, src_heads: Any, dst_heads: Any, num_tokens: Any,
                names: tuple[str, str] = ("src_block_ids", "dst_block_ids"),
                head_names: tuple[str, str] = ("src_heads", "dst_heads"),
                validate: bool | None = True) -> _Move:
    _check_spec(src_spec, "src_spec")
    _check_spec(dst_spec, "dst_spec")
    for what in ("is_mla", "head_size", "dtype"):
        a, b = getattr(src_spec, what), getattr(dst_spec, what)
        if a != b:
            label = "MLA cache" if what == "is_mla" else what
            raise FkvError(f"move: src and dst must agree on {label}: src_spec.{what} is {a!r}, "
                           f"dst_spec.{what} is {b!r}")
    if not _is_tensor(src):
        raise field_error("src", type(src).__name__, "one layer's cache view (a tensor)")
    if not _is_tensor(dst):
        raise field_error("dst", type(dst).__name__, "one layer's cache view (a tensor)")
    check_cache(src, src_spec, "src")
    check_cache(dst, dst_spec, "dst")
    _check_device(dst, src.device, "dst", "src")
    sa, sb = _heads(src_heads, src_spec, head_names[0])
    da, db = _heads(dst_heads, dst_spec, head_names[1])
    if sb - sa != db - da:
        raise FkvError(f"{head_names[0]!r} {(sa, sb)} selects {sb - sa} heads but "
                       f"{head_names[1]!r} {(da, db)} selects {db - da}; both ranges must "
                       f"have the same length")
    sids = _block_ids(src_block_ids, src_spec, names[0], src.device, validate)
    dids = _block_ids(dst_block_ids, dst_spec, names[1], src.device, validate)
    cap_src, cap_dst = sids.count * src_spec.block_size, dids.count * dst_spec.block_size
    n = _num_tokens(num_tokens, cap_src, {f"the {sids.count} {names[0]}": cap_src,
                                          f"the {dids.count} {names[1]}": cap_dst})
    _check_dst_ids(sids, src_spec.block_size, dids, dst_spec.block_size, n, names,
                   _same_view(src, dst) and sa < db and da < sb)
    return _Move(src, src_spec, sids.tensor, sa, dst, dst_spec, dids.tensor, da, sb - sa, n)


def _extent(t: Any) -> tuple[int, int]:
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + span * t.element_size()


_CONVERT_OVERLAP = ("'out' overlaps 'src' in memory; a layout conversion permutes elements, so "
                    "it cannot run in place: pass a separate out")
_GATHER_OVERLAP = ("'out' overlaps 'cache' in memory; gather writes a staging copy of the cache's "
                   "tokens, so it cannot run in place: pass a separate out (or none)")
_SCATTER_OVERLAP = ("'staging' overlaps 'cache' in memory; scatter reads staging while it writes "
                    "the cache: pass a separate staging buffer")


def _check_no_overlap(a: list[Any], b: list[Any], what: str, why: str = _CONVERT_OVERLAP) -> None:
    spans = sorted([(*_extent(t), 0) for t in a if t.numel()] + [(*_extent(t), 1) for t in b if t.numel()])
    reach = [0, 0]  # furthest end seen so far per side
    for start, end, side in spans:
        if start < reach[1 - side]:
            raise FkvError(f"{what}: {why}")
        reach[side] = max(reach[side], end)


def _check_convert(src: Any, src_spec: Any, dst_spec: Any, out: Any, block_ids: Any,
                   validate: bool | None = True) -> tuple[list[Any], list[Any] | None, _Ids, bool]:
    _check_spec(src_spec, "src_spec")
    _check_spec(dst_spec, "dst_spec")
    check_same_geometry(src_spec, dst_spec, "convert")
    src_layers, single = _layers(src, src_spec, "src")
    device = src_layers[0].device
    out_layers = None
    if out is None:
        if block_ids is not None:
            raise FkvError("convert: block_ids= converts those blocks in place into an existing "
                           "cache; pass out=<the destination's layer views> too")
    else:
        out_layers, _ = _layers(out, dst_spec, "out")
        for t in out_layers:
            _check_device(t, device, "out", "src")
        _check_no_overlap(src_layers, out_layers, "convert")
    ids = _block_ids(block_ids, src_spec, "block_ids", device, validate)
    return src_layers, out_layers, ids, single


def _check_staging(staging: Any, stage: KVCacheSpec, name: str, device: Any, heads: tuple[int, int],
                   what: str) -> Any:
    """Check a staging tensor against its spec; return its logical view (for the kernel)."""
    if not _is_tensor(staging):
        raise field_error(name, type(staging).__name__, "a tensor")
    dims = "[n, N, D]" if stage.is_mla else "[n, 2, h, N, D]"
    if tuple(staging.shape) != stage.physical_shape:
        raise FkvError(f"{name!r} has shape {tuple(staging.shape)} but {what} "
                       f"{stage.num_blocks} staging blocks of {stage.block_size} tokens, heads "
                       f"{heads} needs {dims} = {stage.physical_shape}")
    dtype = torch_dtype(stage.dtype)
    if staging.dtype != dtype:
        raise FkvError(f"{name!r} has dtype {staging.dtype} but the cache's dtype is {dtype}")
    if not staging.is_contiguous():
        raise FkvError(f"{name!r} must be contiguous (strides {staging.stride()}); "
                       f"pass staging.contiguous()")
    _check_device(staging, device, name, "cache")
    return staging.permute(_inverse(stage.stride_order))


def _staging_geometry(cache: Any, spec: Any, block_ids: Any, heads: Any, num_tokens: Any,
                      block_size: Any,
                      validate: bool | None) -> tuple[_Ids, tuple[int, int], int, KVCacheSpec]:
    _check_spec(spec, "spec")
    if not _is_tensor(cache):
        raise field_error("cache", type(cache).__name__, "one layer's cache view (a tensor)")
    check_cache(cache, spec, "cache")
    a, b = _heads(heads, spec, "heads")
    ids = _block_ids(block_ids, spec, "block_ids", cache.device, validate)
    if block_size is None:
        block_size = spec.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise field_error("block_size", block_size, "a positive int (tokens per staging block)")
    cap = ids.count * spec.block_size
    n = _num_tokens(num_tokens, cap, {f"the {ids.count} block_ids": cap})
    # A spec needs num_blocks >= 1; zero tokens are handled by the callers (empty staging).
    stage = staging_spec(spec, max(1, -(-n // block_size)), num_heads=b - a, block_size=block_size)
    return ids, (a, b), n, stage


def _check_gather(cache: Any, spec: Any, block_ids: Any, heads: Any, out: Any, num_tokens: Any,
                  block_size: Any, validate: bool | None = True) -> tuple[_Move, Any]:
    torch = require_torch()
    ids, (a, b), n, stage = _staging_geometry(cache, spec, block_ids, heads, num_tokens, block_size,
                                              validate)
    shape = stage.physical_shape if n else (0, *stage.physical_shape[1:])
    if out is None:
        make = torch.zeros if n % stage.block_size else torch.empty
        out = make(shape, dtype=torch_dtype(spec.dtype), device=cache.device)
    if n == 0:
        _check_empty(out, shape, "out")
        return _Move(cache, spec, ids.tensor, a, cache, spec, None, 0, b - a, 0), out
    view = _check_staging(out, stage, "out", cache.device, (a, b), "gathering into")
    _check_no_overlap([cache], [out], "gather", _GATHER_OVERLAP)
    return _Move(cache, spec, ids.tensor, a, view, stage, None, 0, b - a, n), out


def _check_scatter(staging: Any, cache: Any, spec: Any, block_ids: Any, heads: Any,
                   num_tokens: Any, block_size: Any, validate: bool | None = True) -> _Move:
    ids, (a, b), n, stage = _staging_geometry(cache, spec, block_ids, heads, num_tokens, block_size,
                                              validate)
    if n == 0:
        _check_empty(staging, (0, *stage.physical_shape[1:]), "staging")
        return _Move(cache, spec, None, a, cache, spec, ids.tensor, a, b - a, 0)
    view = _check_staging(staging, stage, "staging", cache.device, (a, b), "scattering from")
    _check_no_overlap([cache], [staging], "scatter", _SCATTER_OVERLAP)
    if ids.checked:
        _check_distinct(ids.source, -(-n // spec.block_size), "block_ids")
    return _Move(view, stage, None, 0, cache, spec, ids.tensor, a, b - a, n)


def _check_empty(t: Any, shape: tuple[int, ...], name: str) -> None:
    if not _is_tensor(t) or tuple(t.shape) != shape:
        raise FkvError(f"{name!r} must have shape {shape} for zero tokens "
                       f"(got {tuple(getattr(t, 'shape', ())) or type(t).__name__})")


# -- the repeat-call fast path of gather/scatter ---------------------------------------------------
class _Fast(NamedTuple):
    """A checked gather/scatter signature: what a repeat call needs to launch directly."""

    site: Any          # fkv.ops._launch.LaunchSite of the move kernel, fixed args bound
    grid: tuple[int, int, int]
    num_tokens: int
    host_ids: bool     # ids on the CPU: validated by default (free)
    shape: tuple[int, ...]  # staging shape gather allocates when out is None
    dtype: Any
    alloc: Any         # torch.empty, or torch.zeros when the last staging block is partial


_FAST: dict[tuple, _Fast] = {}
_FAST_MAX = 1024
# (signature, cache address, staging address) pairs found disjoint: under one signature the
# extents around the addresses are fixed, so a repeat call with the same buffers is not checked
# again (the overlap check is Python on every call: a few us by hand, no committed file)
_DISJOINT: set[tuple] = set()


def _check_disjoint(sig: tuple, cache: Any, staging: Any, what: str, why: str) -> None:
    key = (sig, cache.data_ptr(), staging.data_ptr())
    if key not in _DISJOINT:
        _check_no_overlap([cache], [staging], what, why)
        if len(_DISJOINT) >= 4 * _FAST_MAX:
            _DISJOINT.clear()
        _DISJOINT.add(key)


def _plain(v: Any) -> bool:
    """None, an int, or a tuple of ints: values whose equality means the same checks pass
    (``(0.0, 1) == (0, 1)`` and ``True == 1`` in Python, so floats and bools are kept out)."""
    return v is None or type(v) is int or (type(v) is tuple and all(type(x) is int for x in v))


def _staging_signature(op: str, cache: Any, spec: Any, block_ids: Any, heads: Any, other: Any,
                       num_tokens: Any, block_size: Any) -> tuple | None:
    """What gather's/scatter's checks depend on (``other``: ``out`` or ``staging``); None when the
    arguments are not of the kinds the fast path takes (the checked path then handles them)."""
    torch = require_torch()
    if (type(block_ids) is not torch.Tensor or not _plain(heads) or not _plain(num_tokens)
            or not _plain(block_size)):
        return None
    try:
        return (op, spec, cache.shape, cache.stride(), cache.dtype, cache.device,
                block_ids.shape, block_ids.stride(), block_ids.dtype, block_ids.device,
                heads, num_tokens, block_size,
                None if other is None else (other.shape, other.stride(), other.dtype, other.device))
    except (AttributeError, TypeError):
        return None


def _remember(sig: tuple, m: _Move, staging: Any, *, zero: bool) -> None:
    """Keep a checked gather/scatter signature (its ids were used as given: no copy/conversion)."""
    from fkv.ops._move_kernel import move_site

    torch = require_torch()
    site, grid = move_site(m.src_spec, m.dst_spec,
                           None if m.src_ids is None else m.src_ids.dtype,
                           None if m.dst_ids is None else m.dst_ids.dtype,
                           m.src_head_start, m.dst_head_start, m.num_heads, m.num_tokens)
    ids = m.src_ids if m.src_ids is not None else m.dst_ids
    shape = tuple(staging.shape) if staging is not None else ()
    dtype = staging.dtype if staging is not None else None
    if len(_FAST) >= _FAST_MAX:
        _FAST.clear()
    _FAST[sig] = _Fast(site, grid, m.num_tokens, ids.device.type == "cpu", shape, dtype,
                       torch.zeros if zero else torch.empty)
