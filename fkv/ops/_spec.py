"""Spec -> kernel specialization, shared by every kernel launcher.

Kernels see only pointers, strides and ``tl.constexpr``. This module turns a :class:`KVCacheSpec`
into the constexpr values that select a kernel variant (so Triton compiles one variant per layout
and reuses it) and checks a cache tensor against its spec before any launch. Strides come from the
layout algebra (``spec.axis_strides``); nothing here branches on a layout string.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec, strides_match
from fkv.tensors import require_torch

__all__ = ["CacheStrides", "cache_constexprs", "cache_strides", "check_cache", "check_scale_values",
           "check_validate", "join_kv_views"]


@functools.lru_cache(maxsize=None)
def cache_constexprs(spec: KVCacheSpec) -> dict[str, Any]:
    """The constexpr values a kernel specializes on for this spec (hashable inputs only).

    - ``HEADS_OUTER``: heads are outside tokens inside a page (HND); False for NHD and MLA.
    - ``IS_MLA``, ``CACHE_FP8``, ``BLOCK_SIZE``, ``NUM_HEADS``, ``HEAD_SIZE``.
    """
    st = spec.axis_strides
    heads_outer = (not spec.is_mla) and st["H"] > st["N"]
    return {
        "HEADS_OUTER": bool(heads_outer),
        "IS_MLA": spec.is_mla,
        "CACHE_FP8": spec.is_fp8,
        "BLOCK_SIZE": spec.block_size,
        "NUM_HEADS": spec.num_kv_heads,
        "HEAD_SIZE": spec.head_size,
    }


class CacheStrides(dict):
    """Element strides of one layer's logical view by role: block, kv, token, head, dim.

    For MLA, ``kv`` and ``head`` are 0. Keys match the kernel argument names
    ``stride_block, stride_kv, stride_token, stride_head, stride_dim``.
    """


@functools.lru_cache(maxsize=None)
def _strides_for(spec: KVCacheSpec) -> CacheStrides:
    st = spec.axis_strides
    return CacheStrides(
        stride_block=st["B"],
        stride_kv=0 if spec.is_mla else st["two"],
        stride_token=st["N"],
        stride_head=0 if spec.is_mla else st["H"],
        stride_dim=st["C"],
    )


def cache_strides(spec: KVCacheSpec) -> CacheStrides:
    """Strides (elements) of a cache view allocated by ``fkv.allocate(spec)``, by role."""
    return _strides_for(spec)


def check_cache(cache: Any, spec: KVCacheSpec, name: str = "cache") -> None:
    """Raise FkvError unless ``cache`` is one layer's logical view of ``spec`` (shape, dtype, strides).

    The strides must be exactly those ``fkv.allocate(spec)`` gives (size-1 dims excepted): a view
    with other strides is a different layout, and a kernel must never guess which.
    """
    if not isinstance(spec, KVCacheSpec):
        raise FkvError(f"'spec' must be a KVCacheSpec (got {type(spec).__name__})")
    shape = tuple(getattr(cache, "shape", ()))
    if shape != spec.logical_shape:
        raise FkvError(f"{name!r} has shape {shape} but spec {spec!r} has logical shape "
                       f"{spec.logical_shape}; pass one layer's view from fkv.allocate(spec)")
    dtype = str(cache.dtype).removeprefix("torch.")
    if dtype != spec.dtype:
        raise FkvError(f"{name!r} has dtype {dtype!r} but spec.dtype is {spec.dtype!r}")
    strides = tuple(cache.stride())
    expected = spec.element_strides
    if not strides_match(expected, shape, strides):
        raise FkvError(
            f"{name!r} has strides {strides} but spec {spec!r} lays it out with strides "
            f"{expected}; the tensor's real layout differs from the spec (use fkv.infer_spec "
            f"to read its layout, or fkv.ops.convert)"
        )


def check_pdl(pdl: Any) -> None:
    """Raise FkvError unless ``pdl`` is True or False (a launch option of the kernels; the
    references take it too and launch nothing)."""
    if pdl is not False and pdl is not True:
        raise field_error("pdl", pdl, "True or False")


def check_validate(validate: Any) -> None:
    """Raise FkvError unless ``validate`` is True, False or None (each op's default)."""
    if validate is not None and validate is not True and validate is not False:
        raise field_error("validate", validate, "True, False or None (None: the default)")


def check_scale_values(**scales: Any) -> None:
    """Raise FkvError naming the first fp8 scale (a one-element tensor, or None: skipped) that is
    not finite and > 0: a NaN, zero, negative or infinite scale stores NaN, saturated, sign-flipped
    or zero bytes, and reads them back as such. One device sync for tensors on a GPU (callers run
    it only when validating)."""
    torch = require_torch()
    named = [(name, s) for name, s in scales.items() if s is not None]
    if not named:
        return
    values = torch.cat([s.reshape(1).to(torch.float32) for _, s in named]).tolist()
    for (name, _), value in zip(named, values):
        if not (math.isfinite(value) and value > 0):
            raise field_error(name, value, "a finite scale > 0")


def _kv_pair_help(spec: KVCacheSpec) -> str:
    if spec.family == "flash_attn":
        return "(cache[0], cache[1])"
    return "(cache[:, 0], cache[:, 1])"


def join_kv_views(cache: Any, spec: KVCacheSpec) -> Any:
    """``cache`` itself, or the one-layer logical view that a ``(key_cache, value_cache)`` pair
    spans: the engine convention of passing the K and V halves of one layer buffer separately,
    ``(cache[:, 0], cache[:, 1])`` (flash_attn: ``(cache[0], cache[1])``), each ``(NB, N, H, D)``.

    Both must be views of one buffer laid out by ``spec``: same storage, the spec's strides, and
    the V half exactly ``stride_kv`` elements after the K half. Anything else (two separate
    tensors, swapped halves, other strides) is ambiguous and raises FkvError naming the field,
    the value, what was expected and the fix.
    """
    if not isinstance(cache, (tuple, list)):
        return cache
    if not isinstance(spec, KVCacheSpec):
        raise FkvError(f"'spec' must be a KVCacheSpec (got {type(spec).__name__})")
    pair = _kv_pair_help(spec)
    if spec.is_mla:
        raise FkvError(f"'cache' is a {type(cache).__name__} of {len(cache)} but spec.backend is "
                       f"'mla': one latent per token, no K and V halves; pass the layer's one "
                       f"(NB, N, D) view")
    if len(cache) != 2:
        raise FkvError(f"'cache' is a {type(cache).__name__} of {len(cache)} tensors; pass one "
                       f"layer's view, or its (key_cache, value_cache) halves {pair}")
    torch = require_torch()
    sizes, strides = spec.axis_sizes, spec.axis_strides
    axes = ("B", "N", "H", "C")
    shape = tuple(sizes[a] for a in axes)
    expected = tuple(strides[a] for a in axes)
    fix = f"pass {pair} of one layer's view from fkv.allocate(spec)"
    for name, t in zip(("key_cache", "value_cache"), cache):
        if not isinstance(t, torch.Tensor):
            raise FkvError(f"{name!r} must be a torch.Tensor (got {type(t).__name__}); {fix}")
        if tuple(t.shape) != shape:
            raise FkvError(f"{name!r} has shape {tuple(t.shape)} but one K or V half of spec "
                           f"{spec!r} is (NB, N, H, D) = {shape}; {fix}")
        if str(t.dtype).removeprefix("torch.") != spec.dtype:
            raise FkvError(f"{name!r} has dtype {str(t.dtype).removeprefix('torch.')!r} but "
                           f"spec.dtype is {spec.dtype!r}")
        got = tuple(t.stride())
        if any(n != 1 and a != b for a, b, n in zip(got, expected, shape)):
            raise FkvError(f"{name!r} has strides {got} but a K or V half of spec {spec!r} has "
                           f"strides {expected} (NB, N, H, D); the buffer's real layout differs "
                           f"from the spec (use fkv.infer_spec on the whole layer view, or "
                           f"fkv.ops.convert)")
    k, v = cache
    if k.device != v.device or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        raise FkvError(f"'key_cache' and 'value_cache' are separate buffers, but write_kv writes "
                       f"one layer buffer of the spec, whose V half is stride_kv="
                       f"{strides['two']} elements after its K half; {fix}, or write each half's "
                       f"own buffer with its own spec")
    delta = v.storage_offset() - k.storage_offset()
    if delta == -strides["two"]:
        raise FkvError(f"'value_cache' starts {strides['two']} elements before 'key_cache': the "
                       f"halves are swapped; pass (key_cache, value_cache) = {pair}")
    if delta != strides["two"]:
        raise FkvError(f"'value_cache' starts {delta} elements after 'key_cache' but spec "
                       f"{spec!r} puts the V half stride_kv={strides['two']} elements after the "
                       f"K half; {fix}")
    # Both views exist, so their storage holds the whole layer (V's last element is the layer's).
    return k.as_strided(spec.logical_shape, spec.element_strides, k.storage_offset())
