"""CUDA IPC between processes of one host: export a rank's cache regions, map a peer's.

A prefill rank exports, per registered region, the CUDA IPC handle of the *allocation* holding it
(caches come from torch's caching allocator, so the region may start inside a larger allocation:
``cuMemGetAddressRange`` gives the allocation's base) and the region's offset into it, plus the
host identity and its device's UUID (:class:`fkv.connector.wire.IpcInfo`, which travels in the
rank's wire message and is checked by ``decode_untrusted``).

A decode rank maps them **in its own device's context** (``cuIpcOpenMemHandle`` with lazy peer
access, while its device is current): the pointers are then valid for kernels launched on the
decode device, which read the prefill GPU's memory over the peer link (or the same GPU's memory
from another process). Each mapped region is wrapped as a tensor on the decode device (through
DLPack, which names the device explicitly), so ``fkv.ops`` kernels read from it like from a local
cache. Handles are opened once per connection and closed with it.

The CUDA driver is called through its C ABI (``libcuda.so.1``, stable across CUDA 12 and 13;
four functions), so the path needs nothing beyond a CUDA driver and torch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
from typing import Any

from fkv.connector.transport._ipc_probe import _LAZY_ENABLE_PEER_ACCESS, _Handle, probe
from fkv.connector.wire import IpcInfo, Peer
from fkv.errors import FkvError

__all__ = ["Mapping", "export_regions", "host_identity", "ipc_refusal", "local_device_of"]

_KDL_CUDA = 2
_KDL_UINT = 1


@functools.cache
def _driver() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise FkvError(f"CUDA IPC needs the CUDA driver (libcuda.so.1): {e}") from None
    u64, p = ctypes.c_uint64, ctypes.POINTER
    lib.cuMemGetAddressRange_v2.argtypes = [p(u64), p(ctypes.c_size_t), u64]
    lib.cuIpcGetMemHandle.argtypes = [p(_Handle), u64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [p(u64), _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [u64]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, p(ctypes.c_char_p)]
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(code, ctypes.byref(name))
        raise FkvError(f"CUDA IPC: {what} failed: {(name.value or b'?').decode()} ({code})")


def host_identity() -> str:
    """This host's identity for IPC: the host name, the kernel's boot id (two processes can
    share CUDA memory only under one running kernel) and the PID namespace (so a pid the peer
    announces names the same process here)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return f"{socket.gethostname()}/{boot}/{pidns}"


def _uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def export_regions(regions: list[tuple[int, int]], device: Any) -> IpcInfo:
    """The IPC handles and offsets of ``regions`` (CUDA memory on ``device``)."""
    import torch

    lib = _driver()
    handles, offsets = [], []
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # makes the device's primary context current
        index = torch.cuda.current_device() if device.index is None else device.index
        for ptr, nbytes in regions:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                   f"cuMemGetAddressRange(0x{ptr:x})")
            if ptr + nbytes > base.value + size.value:
                raise FkvError(f"CUDA IPC: region 0x{ptr:x}+{nbytes} is not inside one "
                               f"allocation (0x{base.value:x}+{size.value})")
            handle = _Handle()
            _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value),
                   f"cuIpcGetMemHandle(0x{base.value:x})")
            handles.append(bytes(handle))  # all 64 bytes (``.reserved`` stops at a NUL byte)
            offsets.append(ptr - base.value)
    return IpcInfo(host=host_identity(), device_uuid=_uuid(index),
                   handles=tuple(handles), offsets=tuple(offsets), pid=os.getpid())


def local_device_of(uuid: str) -> int | None:
    """This process's index of the CUDA device with ``uuid`` (None: not visible here)."""
    import torch

    for i in range(torch.cuda.device_count()):
        if _uuid(i) == uuid:
            return i
    return None


def ipc_refusal(peer: Peer, device: Any) -> str:
    """Why this process (caches on ``device``) cannot map ``peer``'s caches; "" when it can."""
    rank = peer.engine.tp_rank
    if device.type != "cuda":
        return "the decode caches are not on CUDA (ipc maps GPU memory)"
    if peer.ipc is None:
        return f"prefill rank {rank} exported no CUDA IPC handles (its caches are not on CUDA)"
    if peer.ipc.host != host_identity():
        return (f"prefill rank {rank} runs on another host ({peer.ipc.host!r}, this is "
                f"{host_identity()!r})")
    import torch

    mine = device.index if device.index is not None else torch.cuda.current_device()
    theirs = local_device_of(peer.ipc.device_uuid)
    if theirs is None:
        return (f"prefill rank {rank}'s GPU {peer.ipc.device_uuid} is not visible to this "
                f"process (CUDA_VISIBLE_DEVICES)")
    if theirs != mine and not torch.cuda.can_device_access_peer(mine, theirs):
        return f"cuda:{mine} has no peer access to prefill rank {rank}'s GPU (cuda:{theirs})"
    return ""


# -- DLPack: a device-tagged tensor over mapped memory ---------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    """DLPack's ``DLManagedTensor`` (its fields are set below: the deleter points to the type)."""


_DLManaged._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                       ("deleter", ctypes.c_void_p)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _bytes_tensor(ptr: int, nbytes: int, device_index: int, keep: list[Any]) -> Any:
    """A uint8 tensor of ``nbytes`` at ``ptr`` on ``cuda:device_index`` (no copy, not owned)."""
    import torch

    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManaged()
    managed.dl_tensor = _DLTensor(ctypes.c_void_p(ptr), _DLDevice(_KDL_CUDA, device_index), 1,
                                  _DLDataType(_KDL_UINT, 8, 1),
                                  ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)), None, 0)
    keep += [shape, managed]  # no deleter: the mapping owns the memory and outlives the tensor
    return torch.from_dlpack(_capsule_new(ctypes.addressof(managed), b"dltensor", None))


def mps_running() -> bool:
    """Whether an MPS control daemon serves this process's CUDA clients (its control pipe
    exists). Without MPS, kernels of processes sharing a GPU never run side by side: the GPU
    switches between their contexts, which on an H200 delayed a copy launched right after the
    other process's kernel by about 0.12 ms (bench/NOTES.md, 2026-12-04)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipe, "control"))


def sharing_note(ranks: list[int], mps: bool) -> str:
    """What ``client.describe()`` adds when prefill ranks ``ranks`` share this rank's GPU.

    >>> sharing_note([0], mps=True)
    '; P0 on this GPU too, under MPS (their kernels overlap)'
    """
    if not ranks:
        return ""
    who = ", ".join(f"P{rank}" for rank in ranks)
    if mps:
        return f"; {who} on this GPU too, under MPS (their kernels overlap)"
    return (f"; {who} on this GPU too, without MPS: the GPU switches between the processes "
            f"before each copy (about 0.1-0.3 ms per streamed layer on an H200); an MPS daemon "
            f"(nvidia-cuda-mps-control -d) lets them overlap")


class Mapping:
    """One prefill rank's caches mapped into this process on ``device``: ``views`` are the layer
    views of ``peer.spec`` (as ``fkv.allocate`` lays them out). Close to unmap.

    The peer's handles are first tried in a separate process (``_ipc_probe``): one that CUDA
    opens but whose memory faults when read is refused there, before this process maps it.
    ``events_ok`` says whether the peer's interprocess events opened and answered a query there
    too (if not, a streaming read counts finished writes instead of waiting on them)."""

    def __init__(self, peer: Peer, device: Any) -> None:
        import torch

        from fkv.tensors import _inverse, torch_dtype

        reason = ipc_refusal(peer, device)
        if reason:
            raise FkvError(f"cannot map prefill rank {peer.engine.tp_rank}'s caches: {reason}")
        lib = _driver()
        self._opened: dict[bytes, int] = {}
        self._keep: list[Any] = []
        spec, info = peer.spec, peer.ipc
        index = device.index if device.index is not None else torch.cuda.current_device()
        unique = list(dict.fromkeys(info.handles))
        refusal, self.events_ok = probe(
            index, unique, [(unique.index(handle), offset, nbytes) for (_, nbytes), handle, offset
                            in zip(peer.regions, info.handles, info.offsets, strict=True)],
            list(info.events))
        if refusal:
            raise FkvError(f"prefill rank {peer.engine.tp_rank} sent CUDA IPC handles that this "
                           f"process must not map: {refusal} (found by trying them in a separate "
                           f"process: a mapping that faults would end every CUDA call of this "
                           f"one); refusing to map them")
        dtype = torch_dtype(spec.dtype)
        inv = _inverse(spec.stride_order)
        self.views: list[Any] = []
        try:
            with torch.cuda.device(index):
                torch.cuda.synchronize(index)  # this device's context is current
                regions = []
                for (_, nbytes), handle, offset in zip(peer.regions, info.handles, info.offsets,
                                                       strict=True):
                    if handle not in self._opened:
                        base = ctypes.c_uint64()
                        _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(base),
                                                         _Handle.from_buffer_copy(handle),
                                                         _LAZY_ENABLE_PEER_ACCESS),
                               "cuIpcOpenMemHandle")
                        self._opened[handle] = base.value
                    size = ctypes.c_size_t()
                    start = ctypes.c_uint64()
                    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(size),
                                                       self._opened[handle]),
                           "cuMemGetAddressRange of the mapped allocation")
                    if offset + nbytes > size.value:
                        raise FkvError(f"prefill rank {peer.engine.tp_rank} announced a region "
                                       f"at offset {offset} (+{nbytes} bytes) of an allocation of "
                                       f"{size.value} bytes; refusing to map it")
                    regions.append(_bytes_tensor(self._opened[handle] + offset, nbytes, index,
                                                 self._keep))
            for region in regions:
                physical = region.view(dtype).view(spec.physical_shape)
                if spec.cross_layer:
                    full = physical.permute(inv)
                    self.views += [full[layer] for layer in range(spec.num_layers)]
                else:
                    self.views.append(physical.permute(inv))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unmap every handle (idempotent). Views must not be used afterwards."""
        opened, self._opened = getattr(self, "_opened", {}), {}
        self.views = []
        if opened:
            lib = _driver()
            for base in opened.values():
                lib.cuIpcCloseMemHandle(base)
