"""The same-run baseline of the decode-write benchmarks: an engine-style cache write.

A re-implementation of the structure of the leading engine's Triton reshape-and-cache kernel,
not its code: one program per token (padding slots, negative, return before any load), K and V
of all heads in that program, any layout through the cache's strides, 16 warps for rows of 1024
elements or more, fp8 by dividing by the scale in fp32 (so fp8 bytes can differ from fkv's
reference in the last bit; bf16 bytes are equal). ``fkv bench write`` times it beside
``write_kv`` in the same graph state, ``bench/gpu_kernels_sweep.py`` beside every tiling.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["engine_style_call"]

_KERNEL = None


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
               key_stride, value_stride, stride_block, stride_kv, stride_token, stride_head,
               BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
               H_PAD: tl.constexpr, FP8: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:
            return
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, HEAD_SIZE)
        mask = (h < NUM_HEADS)[:, None]
        blk = slot // BLOCK_SIZE
        dst = blk * stride_block + (slot % BLOCK_SIZE) * stride_token + \
            (h * stride_head)[:, None] + d[None, :]
        src = (h * HEAD_SIZE)[:, None] + d[None, :]
        k = tl.load(key_ptr + token * key_stride + src, mask=mask)
        v = tl.load(value_ptr + token * value_stride + src, mask=mask)
        if FP8:
            k = k.to(tl.float32) / tl.load(k_scale_ptr)
            v = v.to(tl.float32) / tl.load(v_scale_ptr)
        tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + stride_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)

    return kernel


def engine_style_call(spec: Any, cache: Any, key: Any, value: Any, slots: Any,
                      scales: dict[str, Any]) -> Callable[[], None]:
    """A no-argument call that writes ``key``/``value`` ``[T, H, D]`` at ``slots`` into one
    layer's ``cache`` of ``spec`` (``scales``: ``k_scale``/``v_scale`` tensors for fp8 caches,
    else empty); nothing is checked, as in the engine's hot path."""
    import triton

    from fkv.ops._spec import cache_strides

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    kernel = _KERNEL
    st = cache_strides(spec)
    ks = scales.get("k_scale", key)
    vs = scales.get("v_scale", key)
    tokens = slots.shape[0]
    warps = 16 if spec.num_kv_heads * spec.head_size >= 1024 else 4
    stages = 10 if os.environ.get("TRITON_INTERPRET") != "1" else 1

    def run() -> None:
        kernel[(tokens,)](key, value, cache, slots, ks, vs, key.stride(0), value.stride(0),
                          st["stride_block"], st["stride_kv"], st["stride_token"],
                          st["stride_head"], BLOCK_SIZE=spec.block_size,
                          NUM_HEADS=spec.num_kv_heads, HEAD_SIZE=spec.head_size,
                          H_PAD=triton.next_power_of_2(spec.num_kv_heads), FP8=spec.is_fp8,
                          num_warps=warps, num_stages=stages)
    return run
