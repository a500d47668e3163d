"""Tensors for a spec: allocation in physical order viewed logically, and layout inference.

This module imports torch; ``import fkv`` reaches it lazily (``fkv.allocate``, ``fkv.infer_spec``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from typing import TYPE_CHECKING, Any

from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec, Layout, canonical_dtype, strides_match

if TYPE_CHECKING:
    import torch

__all__ = ["allocate", "infer_spec", "torch_dtype", "require_torch"]


def require_torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a declared dependency
        raise FkvError("this part of fkv needs torch: pip install torch") from e
    return torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a spec dtype name (engine names such as ``"fp8"`` included)."""
    torch = require_torch()
    return getattr(torch, canonical_dtype(name))


@functools.cache
def _huge_page_bytes() -> int:
    """The PMD huge page size when this kernel has transparent huge pages, else 0."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


@functools.cache
def _madvise() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_pages_wanted() -> bool:
    """Whether :func:`allocate` asks for transparent huge pages for CPU caches
    (``FKV_HUGE_PAGES=0`` turns it off)."""
    return os.environ.get("FKV_HUGE_PAGES", "1") != "0" and _huge_page_bytes() > 0


def _cpu_empty(torch: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``torch.empty(shape, dtype)`` in CPU memory, with every whole huge page inside it marked
    ``MADV_HUGEPAGE`` before anything touches it.

    A same-host reader copies a cache's rows with ``process_vm_readv``, which walks both
    processes' page tables page by page; with 4 KiB pages much of a small copy is those walks
    (bench/NOTES.md, nineteenth session). Nothing is allocated beyond the tensor: the bytes
    before its first huge page boundary and after its last keep ordinary pages. The advice is
    best effort (a kernel that refuses it leaves ordinary pages); the bytes, strides and storage
    are those of ``torch.empty`` either way.
    """
    buf = torch.empty(shape, dtype=dtype, device="cpu")  # whatever torch's default device is
    if not huge_pages_wanted():
        return buf
    first, last = huge_span(buf.data_ptr(), buf.untyped_storage().nbytes(), _huge_page_bytes())
    if last > first:
        _madvise()(first, last - first, mmap.MADV_HUGEPAGE)  # best effort: ignore a refusal
    return buf


def huge_span(start: int, nbytes: int, huge: int) -> tuple[int, int]:
    """``(first, last)``: the longest run of whole ``huge``-byte pages inside the ``nbytes`` at
    address ``start`` (``first == last`` when no whole page fits).

    >>> huge_span(0x1000, 5 << 20, 2 << 20)
    (2097152, 4194304)
    """
    first = -(-start // huge) * huge
    last = (start + nbytes) // huge * huge
    return first, max(first, last)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(i) for i in range(len(order)))


def allocate(spec: KVCacheSpec, device: Any = "cpu") -> list[torch.Tensor]:
    """``num_layers`` logical views (``spec.logical_shape`` each) whose strides encode the order.

    The physical shape is allocated contiguously and viewed with the inverse permutation
    (docs/layouts.md). With ``cross_layer=True`` every view is ``buffer_view[l]`` of one shared buffer.

    >>> from fkv import KVCacheSpec
    >>> spec = KVCacheSpec(layout="HND", num_blocks=2, block_size=16, num_kv_heads=8, head_size=128)
    >>> (view,) = allocate(spec)
    >>> tuple(view.shape), view.stride()
    ((2, 2, 16, 8, 128), (32768, 16384, 128, 2048, 1))
    """
    torch = require_torch()
    if not isinstance(spec, KVCacheSpec):
        raise field_error("spec", spec, "a KVCacheSpec")
    device = _device(torch, device)
    dtype = torch_dtype(spec.dtype)
    inv = _inverse(spec.stride_order)
    cpu = device is not None and device.type == "cpu"

    def empty() -> Any:
        if cpu:
            return _cpu_empty(torch, spec.physical_shape, dtype)
        return torch.empty(spec.physical_shape, dtype=dtype, device=device)

    if spec.cross_layer:
        full = empty().permute(inv)
        return [full[layer] for layer in range(spec.num_layers)]
    return [empty().permute(inv) for _ in range(spec.num_layers)]


def _device(torch: Any, device: Any) -> Any:
    """``device`` as a ``torch.device`` of this machine (None: torch's default device)."""
    if device is None:
        return None
    no_cuda = "CUDA is not available; allocate on device='cpu'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        if type(device) is int and not torch.cuda.is_available():  # an accelerator's index
            raise field_error("device", device, "a device of this machine", no_cuda) from None
        raise field_error("device", device, "a torch.device or a device string such as 'cpu', "
                          "'cuda' or 'cuda:0'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise field_error("device", device, "a device of this machine", no_cuda)
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise field_error("device", device, f"a CUDA device of this machine (indices 0 to "
                              f"{count - 1})")
    return dev


def infer_spec(tensor: torch.Tensor, *, backend: str, dtype: Any = None,
               num_layers: int = 1) -> KVCacheSpec:
    """Derive the spec of one layer's cache view from its real strides (never from a string).

    ``tensor`` is one layer's logical view (``backend``'s logical shape), or a whole cross-layer
    buffer's view with a leading layers dim. When two layouts give the same strides (a size-1 dim,
    e.g. one KV head per rank: NHD == HND) they are byte-identical and NHD is returned.

    >>> from fkv import KVCacheSpec, allocate
    >>> spec = KVCacheSpec(layout="HND", num_blocks=2, block_size=16, num_kv_heads=8, head_size=128)
    >>> infer_spec(allocate(spec)[0], backend="triton").layout
    Layout.HND
    """
    torch = require_torch()
    if not isinstance(tensor, torch.Tensor):
        raise field_error("tensor", type(tensor).__name__, "a torch.Tensor (one layer's cache "
                          "view, or a cross-layer buffer's view with its layers dim)")
    probe = KVCacheSpec(backend=backend, num_blocks=1, block_size=1,
                        num_kv_heads=1, head_size=1)  # validates the backend name
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    ndim = len(probe.logical_axes)
    name = str(tensor.dtype).removeprefix("torch.")
    if dtype is not None and canonical_dtype(dtype) != name:
        raise field_error("dtype", str(dtype).removeprefix("torch."),
                          f"the tensor's dtype {name!r}")
    whole = len(shape) == ndim + 1
    if whole:
        num_layers = shape[0]
    elif len(shape) != ndim:
        raise FkvError(f"infer_spec: backend {backend!r} has logical axes {probe.logical_axes}; "
                       f"a tensor of shape {shape} has {len(shape)} dims (expected {ndim}, or "
                       f"{ndim + 1} for a cross-layer buffer with its layers dim)")
    sizes = dict(zip(probe.logical_axes, shape[1:] if whole else shape))
    if not probe.is_mla and sizes["two"] != 2:
        raise FkvError(f"infer_spec: the K/V dim of a {backend!r} cache must have size 2 "
                       f"(shape {shape})")
    for layout in (Layout.NHD, Layout.HND):
        for cross in (False, True) if not whole else (True,):
            try:
                spec = KVCacheSpec(backend=backend, layout=layout, num_blocks=sizes["B"],
                                   block_size=sizes["N"], num_kv_heads=sizes.get("H", 1),
                                   head_size=sizes["C"], dtype=name, num_layers=num_layers,
                                   cross_layer=cross)
            except FkvError as e:
                raise FkvError(f"infer_spec: {e}") from None
            expected = spec.element_strides
            if whole:
                expected = (spec.layer_stride, *expected)
            if strides_match(expected, shape, strides):
                return spec
    raise FkvError(
        f"infer_spec: strides {strides} of a {backend!r} cache of shape {shape} match no fkv "
        f"layout (NHD or HND, per-layer or cross-layer with num_layers={num_layers}); allocate "
        f"caches with fkv.allocate, or pass num_layers= for a layer view of a cross-layer buffer"
    )


def wrap(buffer: torch.Tensor, spec: KVCacheSpec, byte_offset: int = 0) -> list[torch.Tensor]:
    """Logical views of ``spec`` laid over existing memory, like ``allocate`` but without allocating.

    ``buffer`` is any contiguous tensor (typically uint8); the views start ``byte_offset`` bytes in.
    A per-layer spec's layers lie one after another (``spec.region_bytes`` each), a cross-layer
    spec's one buffer is ``spec.region_bytes`` long. Used for staging buffers and registered memory.

    >>> import torch
    >>> from fkv import KVCacheSpec
    >>> spec = KVCacheSpec(layout="HND", num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> raw = torch.zeros(2 * spec.region_bytes, dtype=torch.uint8)
    >>> [tuple(v.shape) for v in wrap(raw, spec.evolve(num_layers=2))]
    [(2, 2, 4, 2, 8), (2, 2, 4, 2, 8)]
    """
    torch = require_torch()
    if not buffer.is_contiguous():
        raise FkvError("wrap: 'buffer' must be contiguous")
    flat = buffer.reshape(-1).view(torch.uint8)
    total = spec.region_bytes * spec.num_regions
    if byte_offset < 0 or byte_offset + total > flat.numel():
        raise FkvError(f"wrap: spec needs {total} bytes at offset {byte_offset}, but the buffer "
                       f"holds {flat.numel()} bytes")
    dtype = torch_dtype(spec.dtype)
    inv = _inverse(spec.stride_order)

    def region(i: int) -> torch.Tensor:
        start = byte_offset + i * spec.region_bytes
        return flat[start:start + spec.region_bytes].view(dtype).view(spec.physical_shape).permute(inv)

    if spec.cross_layer:
        full = region(0)
        return [full[layer] for layer in range(spec.num_layers)]
    return [region(layer) for layer in range(spec.num_layers)]
