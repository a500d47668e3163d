"""Pure torch/einops references of ``fkv.ops.convert``: ``move``, ``convert``, ``gather``, ``scatter``.

Same signatures and the same input checks as the kernels (shared validation), but the data movement
is the obvious one: ``einops.rearrange`` between logical axes for whole-cache conversion, and
advanced indexing token by token (``block_ids[i // N]``, slot ``i % N``) for everything else.
Payloads move as same-width integers, so every copy is bit-exact (fp8 and NaN payloads included).
On CPU that indexing runs on numpy views of the same memory, single-threaded, with whole blocks
copied as slices where both sides have the same block size (the transport's DRAM path moves with
these references; see :func:`_run_numpy`); elsewhere on torch tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import einops
import numpy as np

from fkv.layout import KVCacheSpec
from fkv.ops._spec import check_validate
from fkv.ops.relayout import (_check_convert, _check_gather, _check_move, _check_scatter, _Move,
                               move_heads)
from fkv.tensors import allocate, require_torch

if TYPE_CHECKING:
    import torch

__all__ = ["convert", "gather", "move", "scatter"]

#: Tokens per fancy-indexing copy of the CPU path; the least bytes of one block's part for the
#: CPU path to move it as one slice (equal block sizes) rather than token by token.
_CHUNK = 256
_BLOCK_BYTES = 8192

#: Canonical order of one layer's axes (blocks, K/V, tokens, heads, channels); MLA lacks two and H.
_CANONICAL = ("B", "two", "N", "H", "C")


def _as_int(t: torch.Tensor) -> torch.Tensor:
    torch = require_torch()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _canonical(view: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """A view of one layer with axes in canonical order: ``(B, two, N, H, C)``; mla ``(B, N, C)``."""
    axes = spec.logical_axes
    return _as_int(view).permute([axes.index(a) for a in _CANONICAL if a in axes])


def _run(m: _Move) -> None:
    if m.num_tokens == 0:
        return
    if m.src.device.type == "cpu" and m.dst.device.type == "cpu":
        _run_numpy(m)
    else:
        _run_torch(m)


def _run_torch(m: _Move) -> None:
    torch = require_torch()
    device = m.src.device
    i = torch.arange(m.num_tokens, device=device)

    def where(ids: Any, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = i // spec.block_size
        return (blocks if ids is None else ids.to(torch.int64)[blocks]), i % spec.block_size

    src_block, src_slot = where(m.src_ids, m.src_spec)
    dst_block, dst_slot = where(m.dst_ids, m.dst_spec)
    src, dst = _canonical(m.src, m.src_spec), _canonical(m.dst, m.dst_spec)
    if m.src_spec.is_mla:
        dst[dst_block, dst_slot] = src[src_block, src_slot]  # [T, C]
        return
    sh = slice(m.src_head_start, m.src_head_start + m.num_heads)
    dh = slice(m.dst_head_start, m.dst_head_start + m.num_heads)
    # Advanced indices split by a slice put the token dim first: both sides are [T, 2, h, C].
    dst[dst_block, :, dst_slot, dh] = src[src_block, :, src_slot, sh]


def _run_numpy(m: _Move) -> None:
    """:func:`_run_torch` on CPU tensors, through numpy views of the same memory.

    torch's index/index_put run as parallel regions of its intra-op (OpenMP) pool; numpy's fancy
    indexing is single-threaded, so processes that share a host's cores (a prefill and decodes
    moving blocks through DRAM) do not oversubscribe them. Same indices, same bits.
    """
    src, dst = _canonical(m.src, m.src_spec).numpy(), _canonical(m.dst, m.dst_spec).numpy()
    if not m.src_spec.is_mla:  # (B, N, 2, h, C): the block and slot axes first, as MLA's
        src = src[:, :, :, m.src_head_start:m.src_head_start + m.num_heads].swapaxes(1, 2)
        dst = dst[:, :, :, m.dst_head_start:m.dst_head_start + m.num_heads].swapaxes(1, 2)
    src_ids = None if m.src_ids is None else m.src_ids.numpy().astype(np.int64)
    dst_ids = None if m.dst_ids is None else m.dst_ids.numpy().astype(np.int64)
    n, done = m.src_spec.block_size, 0
    if n == m.dst_spec.block_size and src[0, :n].nbytes >= _BLOCK_BYTES:
        # equal block sizes: token i is slot i % n of block i // n on both sides, so whole
        # blocks move as slices (numpy copies them row by row, no index arrays), one slice per
        # run of blocks consecutive on both sides
        whole = m.num_tokens // n
        done = whole * n
        k = np.arange(whole)
        s_ids = k if src_ids is None else src_ids[:whole]
        d_ids = k if dst_ids is None else dst_ids[:whole]
        cut = np.flatnonzero((np.diff(s_ids) != 1) | (np.diff(d_ids) != 1)) + 1
        for a, b in zip(np.r_[0, cut], np.r_[cut, whole]):
            if b > a:
                dst[d_ids[a]:d_ids[a] + b - a] = src[s_ids[a]:s_ids[a] + b - a]
    i = np.arange(done, m.num_tokens)

    def where(ids: np.ndarray | None, spec: KVCacheSpec) -> tuple[np.ndarray, np.ndarray]:
        blocks = i // spec.block_size
        return (blocks if ids is None else ids[blocks]), i % spec.block_size

    src_block, src_slot = where(src_ids, m.src_spec)
    dst_block, dst_slot = where(dst_ids, m.dst_spec)
    # heads and channels as one element where both sides hold them contiguously (NHD), else the
    # channels alone (fancy indexing copies element by element; a slice copies rows at once)
    dst, src = _trailing_as_one(dst, src, 1 if m.src_spec.is_mla else 2)
    # the other tokens in chunks: the gathered temporary stays in cache (a fresh 8 MiB one per
    # call costs its page faults and a second pass through memory)
    for a in range(0, i.size, _CHUNK):
        z = slice(a, a + _CHUNK)
        dst[dst_block[z], dst_slot[z]] = src[src_block[z], src_slot[z]]


def _trailing_as_one(a: np.ndarray, b: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
    """``a`` and ``b`` (same shapes and item size) with up to ``most`` trailing axes, contiguous
    in both, folded into one opaque element of their bytes: fancy indexing then copies them with
    one memcpy per element instead of item by item (bench/experiments/cpu_moves.py times it).
    Unchanged when even the last axis is not contiguous in both."""
    size, k = a.itemsize, 0
    while k < most and all(x.strides[-1 - k] == size for x in (a, b)):
        size *= a.shape[-1 - k]
        k += 1
    if k == 0 or a.shape[-k:] != b.shape[-k:] or a.itemsize != b.itemsize:
        return a, b
    row = np.dtype((np.void, size))

    def fold(x: np.ndarray) -> np.ndarray:
        flat = np.lib.stride_tricks.as_strided(  # the checked contiguous run as one axis
            x, x.shape[:-k] + (size // x.itemsize,), x.strides[:-k] + (x.itemsize,))
        return flat.view(row)[..., 0]

    return fold(a), fold(b)


def move(src: torch.Tensor, src_spec: KVCacheSpec, src_block_ids: Any,
         dst: torch.Tensor, dst_spec: KVCacheSpec, dst_block_ids: Any, *,
         src_heads: Any = None, dst_heads: Any = None,
         num_tokens: int | None = None, validate: bool | None = None, heads: Any = None) -> None:
    """Reference of :func:`fkv.ops.move` (token ``i``: ``ids[i // N]`` slot ``i % N``).

    ``validate`` is checked and changes nothing: a reference always range-checks the ids (it
    cannot mask one outside the cache), in every op of this module.

    >>> import torch, fkv
    >>> a = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=2)
    >>> (src,), (dst,) = fkv.allocate(a), fkv.allocate(a.evolve(block_size=8, num_blocks=1))
    >>> _ = src.copy_(torch.arange(32.).view(2, 2, 4, 1, 2))
    >>> move(src, a, [1, 0], dst, a.evolve(block_size=8, num_blocks=1), [0])
    >>> dst[0, 0, :, 0, 0].tolist()
    [16.0, 18.0, 20.0, 22.0, 0.0, 2.0, 4.0, 6.0]
    """
    check_validate(validate)
    src_heads, dst_heads = move_heads(heads, src_heads, dst_heads)
    _run(_check_move(src, src_spec, src_block_ids, dst, dst_spec, dst_block_ids,
                     src_heads=src_heads, dst_heads=dst_heads, num_tokens=num_tokens))


def convert(src: Any, src_spec: KVCacheSpec, dst_spec: KVCacheSpec, *, out: Any = None,
            block_ids: Any = None, validate: bool | None = None) -> Any:
    """Reference of :func:`fkv.ops.relayout.convert`: ``einops.rearrange`` per layer.

    >>> import torch, fkv
    >>> s = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> src = fkv.allocate(s)
    >>> _ = src[0].copy_(torch.randn(src[0].shape))
    >>> (dst,) = convert(src, s, s.evolve(backend="flash_attn", layout="HND"))
    >>> torch.equal(dst[1, 0], src[0][0, 1])
    True
    """
    check_validate(validate)
    src_layers, out_layers, ids, single = _check_convert(src, src_spec, dst_spec, out, block_ids)
    if out_layers is None:
        out_layers = allocate(dst_spec, device=src_layers[0].device)
        out = out_layers[0] if single else out_layers
    pattern = f"{' '.join(src_spec.logical_axes)} -> {' '.join(dst_spec.logical_axes)}"
    for s, d in zip(src_layers, out_layers):
        if ids.tensor is None:
            _as_int(d).copy_(einops.rearrange(_as_int(s), pattern))
        else:
            _canonical(d, dst_spec)[ids.tensor] = _canonical(s, src_spec)[ids.tensor]
    return out


def gather(cache: torch.Tensor, spec: KVCacheSpec, block_ids: Any, *,
           heads: tuple[int, int] | slice | None = None, out: torch.Tensor | None = None,
           num_tokens: int | None = None, block_size: int | None = None,
           validate: bool | None = None) -> torch.Tensor:
    """Reference of :func:`fkv.ops.relayout.gather` (staging ``[n, 2, h, N, D]``; mla ``[n, N, D]``).

    >>> import torch, fkv
    >>> s = fkv.KVCacheSpec(num_blocks=4, block_size=2, num_kv_heads=2, head_size=2)
    >>> (cache,) = fkv.allocate(s)
    >>> _ = cache.copy_(torch.arange(64.).view(4, 2, 2, 2, 2))
    >>> gather(cache, s, [3], heads=(1, 2))[0, 0].tolist()
    [[[50.0, 51.0], [54.0, 55.0]]]
    """
    check_validate(validate)
    m, staging = _check_gather(cache, spec, block_ids, heads, out, num_tokens, block_size)
    _run(m)
    return staging


def scatter(staging: torch.Tensor, cache: torch.Tensor, spec: KVCacheSpec, block_ids: Any, *,
            heads: tuple[int, int] | slice | None = None, num_tokens: int | None = None,
            block_size: int | None = None, validate: bool | None = None) -> None:
    """Reference of :func:`fkv.ops.relayout.scatter`, the inverse of :func:`gather`.

    >>> import torch, fkv
    >>> s = fkv.KVCacheSpec(num_blocks=4, block_size=2, num_kv_heads=2, head_size=2)
    >>> (cache,) = fkv.allocate(s)
    >>> _ = cache.zero_()
    >>> scatter(torch.ones(1, 2, 1, 2, 2, dtype=torch.bfloat16), cache, s, [2], heads=(0, 1))
    >>> cache[2, :, :, 0].sum().item(), cache[2, :, :, 1].sum().item()
    (8.0, 0.0)
    """
    check_validate(validate)
    _run(_check_scatter(staging, cache, spec, block_ids, heads, num_tokens, block_size))
