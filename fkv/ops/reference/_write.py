"""Pure torch reference of ``fkv.ops.write_kv`` (reshape-and-cache), and the input checks it shares
with the Triton launcher.

The checks live here because they are pure torch (no triton): both the reference and the kernel
launcher run exactly the same validation, so they raise the same FkvError for the same bad input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from fkv.errors import FkvError
from fkv.layout import KVCacheSpec
from fkv.ops._spec import (check_cache, check_pdl, check_scale_values, check_validate,
                           join_kv_views)
from fkv.tensors import require_torch, torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["WriteInputs", "check_slots", "check_token_counts", "check_write_inputs", "write_kv"]

_FLOAT_INPUTS = ("bfloat16", "float16", "float32")
_SLOT_DTYPES = ("int32", "int64")


class WriteInputs(NamedTuple):
    """Checked inputs of one write: ``key``/``value`` as ``[T, H, D]`` views (MLA: ``value`` None)."""

    key: Any
    value: Any
    num_tokens: int  # len(slot_mapping): key/value rows beyond it are ignored
    quantize: bool   # fp8 cache fed with bf16/fp16/fp32: stored = x / scale, saturated to fp8
    k_scale: Any
    v_scale: Any


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tokens(x: Any, name: str, spec: KVCacheSpec, cache: Any) -> Any:
    """``x`` as a ``[T, H, D]`` view (MLA accepts ``[T, D]`` too); raises naming both sides."""
    torch = require_torch()
    if not isinstance(x, torch.Tensor):
        raise FkvError(f"{name!r} must be a torch.Tensor of shape [T, {spec.num_kv_heads}, "
                       f"{spec.head_size}] (got {type(x).__name__})")
    heads, size = spec.num_kv_heads, spec.head_size
    if spec.is_mla and x.dim() == 2:
        x = x.unsqueeze(1)
    if x.dim() != 3 or tuple(x.shape[1:]) != (heads, size):
        want = f"[T, {heads}, {size}]" + (f" or [T, {size}]" if spec.is_mla else "")
        raise FkvError(f"{name!r} has shape {tuple(x.shape)} but spec (num_kv_heads={heads}, "
                       f"head_size={size}) needs {want}")
    if x.device != cache.device:
        raise FkvError(f"{name!r} is on {x.device} but 'cache' is on {cache.device}; "
                       f"move them to one device")
    return x


def _check_scale(scale: Any, name: str, cache: Any) -> Any:
    torch = require_torch()
    if scale is None:
        raise FkvError(f"{name!r} is required: spec.dtype is fp8 and the input is not, so the "
                       f"stored value is x / {name}; pass a float32 tensor of one element")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        got = (f"{_name(scale.dtype)} tensor of shape {tuple(scale.shape)}"
               if isinstance(scale, torch.Tensor) else type(scale).__name__)
        raise FkvError(f"{name!r} must be a float32 tensor of one element (got {got}); "
                       f"e.g. torch.tensor([1.0], device=cache.device)")
    if scale.device != cache.device:
        raise FkvError(f"{name!r} is on {scale.device} but 'cache' is on {cache.device}")
    return scale


def check_write_inputs(key: Any, value: Any, cache: Any, slot_mapping: Any, spec: KVCacheSpec,
                       k_scale: Any, v_scale: Any) -> WriteInputs:
    """Every check ``write_kv`` makes before anything is written; raises FkvError naming both sides."""
    torch = require_torch()
    check_cache(cache, spec)
    key = _check_tokens(key, "key", spec, cache)
    if spec.is_mla:
        value = None  # one latent per token: 'value' is ignored
    else:
        value = _check_tokens(value, "value", spec, cache)
        if value.dtype != key.dtype:
            raise FkvError(f"'key' has dtype {_name(key.dtype)!r} but 'value' has "
                           f"{_name(value.dtype)!r}; they must match")
    if not isinstance(slot_mapping, torch.Tensor):
        raise FkvError(f"'slot_mapping' must be an int64 (or int32) torch.Tensor of shape [T] "
                       f"(got {type(slot_mapping).__name__})")
    if slot_mapping.dim() != 1 or _name(slot_mapping.dtype) not in _SLOT_DTYPES:
        raise FkvError(f"'slot_mapping' must be a 1-D int64 (or int32) tensor (got "
                       f"{_name(slot_mapping.dtype)} of shape {tuple(slot_mapping.shape)})")
    if slot_mapping.device != cache.device:
        raise FkvError(f"'slot_mapping' is on {slot_mapping.device} but 'cache' is on "
                       f"{cache.device}; move them to one device")
    check_token_counts(key, value, slot_mapping)
    src, dst = _name(key.dtype), spec.dtype
    quantize = False
    if spec.is_fp8:
        if src in _FLOAT_INPUTS:
            quantize = True
            k_scale = _check_scale(k_scale, "k_scale", cache)
            if not spec.is_mla:
                v_scale = _check_scale(v_scale, "v_scale", cache)
        elif src != dst:
            raise FkvError(f"'key' has dtype {src!r} but spec.dtype is {dst!r}; an fp8 cache "
                           f"takes {_FLOAT_INPUTS} (quantized with k_scale/v_scale) or {dst!r} "
                           f"(stored unchanged)")
    else:
        if src != dst:
            raise FkvError(f"'key' has dtype {src!r} but spec.dtype is {dst!r}; cast the input "
                           f"to {dst!r} (only fp8 caches convert on write)")
        if k_scale is not None or v_scale is not None:
            raise FkvError(f"'k_scale'/'v_scale' apply to fp8 caches only, but spec.dtype is "
                           f"{dst!r}; pass None")
    return WriteInputs(key, value, int(slot_mapping.shape[0]), quantize, k_scale, v_scale)


def check_token_counts(key: Any, value: Any, slot_mapping: Any) -> None:
    """``value`` (None for MLA) has ``key``'s T, and ``slot_mapping`` is no longer than T."""
    if value is not None and value.shape[0] != key.shape[0]:
        raise FkvError(f"'key' has {key.shape[0]} tokens but 'value' has {value.shape[0]}; "
                       f"they must have the same T")
    if slot_mapping.shape[0] > key.shape[0]:
        raise FkvError(f"'slot_mapping' has {slot_mapping.shape[0]} slots but 'key' has only "
                       f"{key.shape[0]} tokens; pass one slot per token (negative = padding)")


def check_slots(slot_mapping: torch.Tensor, spec: KVCacheSpec) -> None:
    """Raise FkvError naming the first slot ``>= num_blocks * block_size`` (negative = padding).

    On a CUDA tensor this synchronizes the device (it reads the result on the host).
    """
    torch = require_torch()
    limit = spec.num_blocks * spec.block_size
    bad = torch.nonzero(slot_mapping >= limit)
    if bad.numel():
        i = int(bad[0, 0])
        raise FkvError(
            f"'slot_mapping'[{i}] = {int(slot_mapping[i])} is outside the cache: slots must be "
            f"< num_blocks * block_size = {spec.num_blocks} * {spec.block_size} = {limit} "
            f"(negative slots are padding and write nothing)")


def _bits(dtype: torch.dtype) -> torch.dtype:
    """An integer dtype of the same width, to copy elements bit-exactly (fp8 index_put included)."""
    torch = require_torch()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    torch = require_torch()
    if scale is None:
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale.reshape(()).float()).clamp(-fmax, fmax).to(dtype)


def write_kv(key: torch.Tensor, value: torch.Tensor | None, cache: torch.Tensor,
             slot_mapping: torch.Tensor, spec: KVCacheSpec, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, validate: bool | None = None,
             pdl: bool = False) -> None:
    """Pure torch reshape-and-cache: token ``t`` goes to block ``slot // N``, offset ``slot % N``.

    Same contract as :func:`fkv.ops.write_kv`: ``key``/``value`` ``[T, H, D]`` with any strides
    (MLA: ``key`` ``[T, D]`` or ``[T, 1, D]``, ``value`` ignored); ``cache`` one layer's logical
    view of ``spec`` (triton/flashinfer ``(NB, 2, N, H, D)``, flash_attn ``(2, NB, N, H, D)``, mla
    ``(NB, N, D)``, in NHD or HND strides) or its ``(key_cache, value_cache)`` halves; negative slots write nothing; fp8 caches store
    ``x / scale`` saturated to the fp8 range. ``validate`` (default: on for CPU tensors) raises on
    slots ``>= num_blocks * block_size`` and fp8 scales that are not finite and > 0; with it off
    such tokens are skipped.

    >>> import torch
    >>> from fkv import KVCacheSpec, allocate
    >>> spec = KVCacheSpec(layout="HND", num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> (cache,) = allocate(spec)
    >>> k, v = torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 2, 8).bfloat16()
    >>> write_kv(k, v, cache, torch.tensor([5, -1, 0]), spec)
    >>> bool((cache[1, 0, 1] == k[0]).all()), bool((cache[0, 1, 0] == v[2]).all())
    (True, True)
    """
    torch = require_torch()
    check_pdl(pdl)
    check_validate(validate)
    cache = join_kv_views(cache, spec)
    ins = check_write_inputs(key, value, cache, slot_mapping, spec, k_scale, v_scale)
    if validate is None:
        validate = slot_mapping.device.type == "cpu"
    if validate:
        check_slots(slot_mapping, spec)
        if ins.quantize:
            check_scale_values(k_scale=ins.k_scale, v_scale=None if spec.is_mla else ins.v_scale)
    slots = slot_mapping[:ins.num_tokens].long()
    keep = (slots >= 0) & (slots < spec.num_blocks * spec.block_size)
    rows = torch.nonzero(keep).flatten()
    slots = slots[rows]
    block, offset = slots // spec.block_size, slots % spec.block_size
    dtype = torch_dtype(spec.dtype)
    axes = spec.logical_axes
    if spec.is_mla:
        view = cache.permute([axes.index(a) for a in ("B", "N", "C")])
        halves = [(view, ins.key[:, 0], ins.k_scale)]
    else:
        view = cache.permute([axes.index(a) for a in ("two", "B", "N", "H", "C")])
        halves = [(view[0], ins.key, ins.k_scale), (view[1], ins.value, ins.v_scale)]
    for dst, src, scale in halves:
        vals = _quantize(src[rows], dtype, scale if ins.quantize else None)
        dst.view(_bits(dtype))[block, offset] = vals.view(_bits(dtype))
