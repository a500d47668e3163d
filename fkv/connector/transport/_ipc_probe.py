"""Try a prefill peer's CUDA IPC handles in a throwaway process before this one maps them.

The CUDA driver opens some altered memory handles without complaint and reports a plausible size
for them, yet the first read of the mapping faults (on an H200, driver 580: a memory handle with
its byte 31 flipped; ``bench/experiments/ipc_handle_flips.py``). A fault is sticky: it would end
every CUDA call of the decode process, whatever request it served. So before a decode rank maps a
peer's handles (``_ipc.Mapping``), :func:`probe` runs this file as a separate process (standard
library only, the CUDA driver through ``ctypes``), which opens each handle on the same device,
checks each region against the mapped allocation's size, reads one byte of every 64 KiB of every
region and the region's last byte, and opens and queries each interprocess event. A handle that
faults there ends that process, not this one.

Run as a script it reads one JSON object on stdin (``device``: the CUDA ordinal; ``handles``: hex
strings; ``regions``: ``[handle index, offset, nbytes]``; ``events``: hex strings) and prints one
JSON line: ``{"refusal": "" or why, "events_ok": bool}``.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Bytes between two probed bytes of a region: the smallest page a GPU mapping has.
STRIDE = 64 << 10
#: Rows of one strided copy (one byte each).
ROWS = 32768
_TIMEOUT_S = 60.0
_LAZY_ENABLE_PEER_ACCESS = 1
_NOT_READY = 600


class _Handle(ctypes.Structure):
    """``CUipcMemHandle`` / ``CUipcEventHandle`` (``_ipc`` uses it too: this file may import
    nothing of fkv, since it runs alone with ``python -I``)."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Copy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
                ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t),
                ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


class _Refused(Exception):
    """A driver call failed: the handles must not be mapped (the message says which and why)."""


def _run(request: dict[str, Any], lib: Any) -> dict[str, Any]:
    """The answer to ``request`` (module docstring), the CUDA driver being ``lib``."""
    u64, p = ctypes.c_uint64, ctypes.POINTER

    def check(code: int, what: str) -> None:
        if code:
            name = ctypes.c_char_p()
            lib.cuGetErrorName(code, ctypes.byref(name))
            raise _Refused(f"{what} failed: {(name.value or b'?').decode()} ({code})")

    lib.cuIpcOpenMemHandle_v2.argtypes = [p(u64), _Handle, ctypes.c_uint]
    lib.cuMemGetAddressRange_v2.argtypes = [p(u64), p(ctypes.c_size_t), u64]
    lib.cuMemcpy2D_v2.argtypes = [p(_Copy2D)]
    lib.cuIpcOpenEventHandle.argtypes = [p(ctypes.c_void_p), _Handle]
    lib.cuEventQuery.argtypes = [ctypes.c_void_p]
    check(lib.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(lib.cuDeviceGet(ctypes.byref(dev), int(request["device"])), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    bases, sizes = [], []
    for raw in request["handles"]:
        base, start, size = u64(), u64(), ctypes.c_size_t()
        check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(base),
                                        _Handle.from_buffer_copy(bytes.fromhex(raw)),
                                        _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        check(lib.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(size), base.value),
              "cuMemGetAddressRange of the mapped allocation")
        bases.append(base.value)
        sizes.append(size.value)
    sink = (ctypes.c_uint8 * ROWS)()
    for index, offset, nbytes in request["regions"]:
        if offset + nbytes > sizes[index]:
            return {"refusal": f"a region at offset {offset} (+{nbytes} bytes) of an allocation "
                               f"of {sizes[index]} bytes", "events_ok": False}
        start = bases[index] + offset
        points = -(-nbytes // STRIDE)  # bytes 0, STRIDE, 2 STRIDE, ... below nbytes
        for first in range(0, points, ROWS):
            rows = min(ROWS, points - first)
            copy = _Copy2D(srcMemoryType=2, srcDevice=start + first * STRIDE, srcPitch=STRIDE,
                           dstMemoryType=1, dstHost=ctypes.addressof(sink), dstPitch=1,
                           WidthInBytes=1, Height=rows)
            check(lib.cuMemcpy2D_v2(ctypes.byref(copy)), "reading the mapped region")
        if nbytes:
            last = _Copy2D(srcMemoryType=2, srcDevice=start + nbytes - 1, srcPitch=1,
                           dstMemoryType=1, dstHost=ctypes.addressof(sink), dstPitch=1,
                           WidthInBytes=1, Height=1)
            check(lib.cuMemcpy2D_v2(ctypes.byref(last)), "reading the mapped region")
    check(lib.cuCtxSynchronize(), "reading the mapped regions")
    events_ok = True
    for raw in request.get("events", ()):
        event = ctypes.c_void_p()
        if lib.cuIpcOpenEventHandle(ctypes.byref(event),
                                    _Handle.from_buffer_copy(bytes.fromhex(raw))):
            events_ok = False
            break
        if lib.cuEventQuery(event) not in (0, _NOT_READY) or lib.cuCtxSynchronize():
            events_ok = False
            break
    return {"refusal": "", "events_ok": events_ok}


def probe(device: int, handles: list[bytes], regions: list[tuple[int, int, int]],
          events: list[bytes] = ()) -> tuple[str, bool]:
    """``(why the handles must not be mapped here or "", whether the events may be used)``,
    found by trying them in a separate process on CUDA device ``device``. ``regions`` are
    ``(index into handles, offset, nbytes)``."""
    request = {"device": device, "handles": [h.hex() for h in handles],
               "regions": [list(r) for r in regions], "events": [e.hex() for e in events]}
    try:
        proc = subprocess.run([sys.executable, "-I", str(Path(__file__))],
                              input=json.dumps(request), capture_output=True, text=True,
                              timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"trying them in a separate process took over {_TIMEOUT_S:.0f} s", False
    got = _answer(proc.stdout)
    if got is not None:
        return got
    tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return f"trying them in a separate process ended without an answer ({tail[0][:200]})", False


def _answer(stdout: str) -> tuple[str, bool] | None:
    """The probe's answer, its last line of output; None when that is not one."""
    lines = stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    if isinstance(got, dict) and isinstance(got.get("refusal"), str) \
            and isinstance(got.get("events_ok"), bool):
        return got["refusal"], got["events_ok"]
    return None


def _main(lib: Any = None) -> None:
    try:
        got = _run(json.loads(sys.stdin.read()), lib or ctypes.CDLL("libcuda.so.1"))
    except _Refused as e:
        got = {"refusal": str(e), "events_ok": False}
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    _main()
