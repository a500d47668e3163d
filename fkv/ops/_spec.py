"""Spec -> kernel specialization, shared by every kernel launcher.

Kernels see only pointers, strides and ``tl.constexpr``. This module turns a :class:`KVCacheSpec`
into the constexpr values that select a kernel variant (so Triton compiles one variant per layout
and reuses it) and checks a cache tensor against its spec before any launch. Strides come from the
layout algebra (``spec.axis_strides``); nothing here branches on a layout string.
"""

from __future__ import annotations

import functools
from typing import Any

from fkv.errors import FkvError
from fkv.layout import KVCacheSpec

__all__ = ["CacheStrides", "cache_constexprs", "cache_strides", "check_cache"]


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
    if any(size != 1 and a != b for a, b, size in zip(strides, expected, shape)):
        raise FkvError(
            f"{name!r} has strides {strides} but spec {spec!r} lays it out with strides "
            f"{expected}; the tensor's real layout differs from the spec (use fkv.infer_spec "
            f"to read its layout, or fkv.ops.convert)"
        )
