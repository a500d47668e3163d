"""The ipc path's pure parts on CPU: when it is refused and why, and its wire fields (round trip
and fuzz); and ``_ipc.Mapping`` / ``export_regions`` over a fake CUDA driver whose "device memory"
is CPU tensors (what they open, check, view and close, and the errors a lying peer costs). Real
mappings run in the GPU tests (tests/test_transport.py, ``-m gpu``), and so do hostile handles
(below: a prefill peer's corrupt, random, dead or misplaced IPC handles)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fkv
from fkv.connector import EngineDesc, decode_untrusted, encode
from fkv.connector.transport import _ipc
from fkv.connector.transport._base import cache_regions
from fkv.connector.transport._ipc_probe import _Handle
from fkv.connector.wire import IpcInfo
from fkv.errors import FkvError, FkvWireError

# the plan-path tests' caches of distinct finite values (pytest runs with --import-mode=importlib)
sys.path.insert(0, os.path.dirname(__file__))
from test_plan_path import _caches as _filled  # noqa: E402

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128,
                       num_layers=2)
ENGINE = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=8)
REGIONS = [(0x7F0000000000, SPEC.region_bytes), (0x7F0001000000, SPEC.region_bytes)]


def ipc_info(**kw: object) -> IpcInfo:
    base = {"host": _ipc.host_identity(), "device_uuid": "GPU-1234", "handles": (b"\x01" * 64,
            b"\x02" * 64), "offsets": (0, 4096), "pid": 4242, "events": (b"\x03" * 64, b"\x04" * 64)}
    return IpcInfo(**{**base, **kw})


def peer(ipc: IpcInfo | None):
    return decode_untrusted(encode(ENGINE, SPEC, REGIONS, ipc=ipc))


CUDA0 = types.SimpleNamespace(type="cuda", index=0)


def test_wire_round_trip_carries_the_ipc_fields() -> None:
    info = ipc_info()
    assert peer(info).ipc == info
    assert peer(None).ipc is None
    assert peer(ipc_info(events=())).ipc.events == ()  # a rank without publish events


@pytest.mark.parametrize("change,message", [
    ({"handles": (b"\x01" * 64,)}, "'ipc.handles' must hold spec.num_regions=2 entries (got 1)"),
    ({"offsets": (0, 1, 2)}, "'ipc.offsets' must hold spec.num_regions=2 entries (got 3)"),
    ({"host": "h\x00st"}, "'ipc.host' must be printable ASCII"),
    ({"device_uuid": "GPU-\u00e9"}, "'ipc.device_uuid' must be printable ASCII"),
    ({"events": (b"\x03" * 64,) * 3}, "'ipc.events' must hold at most one event per layer "
                                      "(spec.num_layers=2, at most 128) (got 3)"),
])
def test_bad_ipc_fields_are_refused_by_the_peer(change: dict, message: str) -> None:
    msg = msgspec.msgpack.decode(encode(ENGINE, SPEC, REGIONS, ipc=ipc_info()))
    msg["ipc"].update({k: list(v) if isinstance(v, tuple) else v for k, v in change.items()})
    with pytest.raises(FkvWireError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_untrusted(msgspec.msgpack.encode(msg))


@pytest.mark.parametrize("field,value", [("handles", [b"\x01" * 63, b"\x02" * 64]),
                                         ("offsets", [-1, 0]), ("offsets", [1 << 49, 0]),
                                         ("pid", -5), ("host", "x" * 513), ("host", ""),
                                         ("events", [b"\x03" * 63]),
                                         ("events", [b"\x03" * 64] * 129)])
def test_out_of_bounds_ipc_fields_are_malformed(field: str, value: object) -> None:
    msg = msgspec.msgpack.decode(encode(ENGINE, SPEC, REGIONS, ipc=ipc_info()))
    msg["ipc"][field] = value
    with pytest.raises(FkvWireError, match="peer message is malformed"):
        decode_untrusted(msgspec.msgpack.encode(msg))


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=0, max_size=64), st.integers(0, 2000))
def test_fuzzed_ipc_messages_raise_only_the_wire_error(junk: bytes, at: int) -> None:
    data = bytearray(encode(ENGINE, SPEC, REGIONS, ipc=ipc_info()))
    at %= len(data)
    data[at:at + len(junk)] = junk
    try:
        got = decode_untrusted(bytes(data))
    except FkvWireError:
        return
    assert got.ipc is None or len(got.ipc.handles) == SPEC.num_regions


def test_refused_without_cuda_or_handles() -> None:
    cpu = types.SimpleNamespace(type="cpu", index=None)
    assert _ipc.ipc_refusal(peer(ipc_info()), cpu) == \
        "the decode caches are not on CUDA (ipc maps GPU memory)"
    assert _ipc.ipc_refusal(peer(None), CUDA0) == \
        "prefill rank 0 exported no CUDA IPC handles (its caches are not on CUDA)"


def test_refused_on_another_host() -> None:
    got = _ipc.ipc_refusal(peer(ipc_info(host="elsewhere/boot/1")), CUDA0)
    assert got == (f"prefill rank 0 runs on another host ('elsewhere/boot/1', this is "
                   f"{_ipc.host_identity()!r})")


def test_refused_when_the_gpu_is_not_visible_or_has_no_peer_access(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(_ipc, "local_device_of", lambda uuid: None)
    assert _ipc.ipc_refusal(peer(ipc_info()), CUDA0) == (
        "prefill rank 0's GPU GPU-1234 is not visible to this process (CUDA_VISIBLE_DEVICES)")
    monkeypatch.setattr(_ipc, "local_device_of", lambda uuid: 1)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert _ipc.ipc_refusal(peer(ipc_info()), CUDA0) == \
        "cuda:0 has no peer access to prefill rank 0's GPU (cuda:1)"
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert _ipc.ipc_refusal(peer(ipc_info()), CUDA0) == ""
    monkeypatch.setattr(_ipc, "local_device_of", lambda uuid: 0)  # the same GPU
    assert _ipc.ipc_refusal(peer(ipc_info()), CUDA0) == ""


def test_the_note_on_a_shared_gpu_says_whether_mps_lets_kernels_overlap(monkeypatch,
                                                                       tmp_path) -> None:
    """``client.describe()`` of an ipc read whose prefill ranks are on this GPU: without MPS it
    says what the context switches cost and how to avoid them."""
    from fkv.connector.transport._ipc import mps_running, sharing_note

    assert sharing_note([], mps=False) == ""
    assert sharing_note([0, 1], mps=False) == (
        "; P0, P1 on this GPU too, without MPS: the GPU switches between the processes before "
        "each copy (about 0.1-0.3 ms per streamed layer on an H200); an MPS daemon "
        "(nvidia-cuda-mps-control -d) lets them overlap")
    assert sharing_note([2], mps=True) == "; P2 on this GPU too, under MPS (their kernels overlap)"
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    (tmp_path / "control").touch()
    assert mps_running()


# -- Mapping and export_regions on CPU, over a fake CUDA driver ------------------------------------
H_A, H_B = b"\xa0" + bytes(63), b"\xb0" + b"\x00\x01" * 31 + b"\x00"  # NUL bytes inside
ERRORS = {1: "CUDA_ERROR_INVALID_VALUE", 400: "CUDA_ERROR_INVALID_HANDLE"}


class FakeCuda:
    """What ``_ipc`` reaches of CUDA, over CPU memory: the driver (``_ipc._driver()``: an IPC
    handle opens to the address of ``allocs[handle]``, a uint8 CPU tensor standing in for the
    exporter's allocation), the probe (answers ``answer``), ``torch.cuda``'s device context,
    synchronize, current device (1), device properties (``GPU-<i>`` of 2 devices) and peer access
    (granted), and DLPack: ``torch.from_dlpack`` records each descriptor ``_ipc`` builds, then
    reads it as CPU memory. Every call goes to ``log``; handles are logged by their first byte."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allocs: dict[bytes, torch.Tensor]) -> None:
        self.log: list[tuple] = []
        self.allocs = allocs
        self.answer: tuple[str, bool] = ("", True)
        self.errors: dict[str, int] = {}  # driver call -> the code it fails with
        self.fail_dlpack = 0  # the n-th tensor made raises (0: none)
        self.dlpack: list[tuple] = []
        log, by_base = self.log, {}

        def out(ref, value):
            ref._obj.value = value

        def open_mem(ref, handle, flags):
            raw = bytes(handle)
            log.append(("open", raw[0], flags))
            if self.errors.get("open"):
                return self.errors["open"]
            base = self.allocs[raw].data_ptr()
            by_base[base] = raw
            out(ref, base)
            return 0

        def address_range(start, size, ptr):
            log.append(("range", by_base[ptr][0] if ptr in by_base else ptr))
            if self.errors.get("range"):
                return self.errors["range"]
            base, alloc = next((t.data_ptr(), t) for t in self.allocs.values()
                               if t.data_ptr() <= ptr < t.data_ptr() + t.numel())
            out(start, base)
            out(size, alloc.numel())
            return 0

        def get_handle(ref, base):
            log.append(("get handle", base))
            if self.errors.get("get handle"):
                return self.errors["get handle"]
            raw = next(h for h, t in self.allocs.items() if t.data_ptr() == base)
            ctypes.memmove(ctypes.addressof(ref._obj), raw, 64)
            return 0

        def error_name(code, ref):
            if code in ERRORS:
                out(ref, ERRORS[code].encode())
            return 0

        self.cuIpcOpenMemHandle_v2 = open_mem
        self.cuMemGetAddressRange_v2 = address_range
        self.cuIpcGetMemHandle = get_handle
        self.cuIpcCloseMemHandle = lambda base: log.append(("close", by_base[base][0]))
        self.cuGetErrorName = error_name

        def probe(index, handles, regions, events):
            log.append(("probe", index, [h[0] for h in handles], regions,
                        [e[0] for e in events]))
            return self.answer

        @contextlib.contextmanager
        def device(d):
            log.append(("enter", d))
            try:
                yield
            finally:
                log.append(("exit", d))

        real = torch.from_dlpack

        def from_dlpack(capsule):
            get = ctypes.pythonapi.PyCapsule_GetPointer
            get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
            t = _ipc._DLManaged.from_address(get(capsule, b"dltensor")).dl_tensor
            dt = t.dtype
            self.dlpack.append((t.data, t.device.device_type, t.device.device_id, t.ndim,
                                (dt.code, dt.bits, dt.lanes), t.shape[0], bool(t.strides),
                                t.byte_offset))
            if len(self.dlpack) == self.fail_dlpack:
                raise RuntimeError("from_dlpack failed")
            t.device.device_type, t.device.device_id = 1, 0  # kDLCPU: the bytes are on the host
            return real(capsule)

        monkeypatch.setattr(_ipc, "_driver", lambda: self)
        monkeypatch.setattr(_ipc, "probe", probe)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: log.append(("sync", d)))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: types.SimpleNamespace(uuid=f"GPU-{i}", name="not a uuid"))
        monkeypatch.setattr(torch, "from_dlpack", from_dlpack)


def _exported(spec: fkv.KVCacheSpec, where: list[tuple[bytes, int]], sizes: dict[bytes, int],
              events: tuple[bytes, ...] = (), engine: EngineDesc = ENGINE):
    """A prefill rank's caches of ``spec`` (filled), copied into allocations of ``sizes`` bytes
    at ``where`` (per region: handle, offset): ``(caches, allocations, the peer as decoded)``."""
    caches = _filled(spec, 5)
    regions = cache_regions(spec, caches)[0]
    allocs = {h: torch.full((n,), 0xEE, dtype=torch.uint8) for h, n in sizes.items()}
    for (ptr, nbytes), (h, off) in zip(regions, where, strict=True):
        if off + nbytes <= sizes[h]:
            ctypes.memmove(allocs[h].data_ptr() + off, ptr, nbytes)
    info = ipc_info(device_uuid="GPU-0", handles=tuple(h for h, _ in where),
                    offsets=tuple(off for _, off in where), events=events)
    return caches, allocs, decode_untrusted(encode(engine, spec, regions, ipc=info))


THREE = SPEC.evolve(num_layers=3)
RB3 = THREE.region_bytes
CUDA1 = types.SimpleNamespace(type="cuda", index=1)
RANK1 = EngineDesc(engine_id="p", tp_size=2, tp_rank=1, total_num_kv_heads=16)  # errors name it


def test_a_mapping_opens_each_handle_once_and_views_the_peers_caches(monkeypatch) -> None:
    """Three regions in two allocations (A holds two of them, each allocation ends exactly where
    its last region does): the probe gets each handle once; each handle is opened once, lazily
    peer-enabled, inside the decode device's context; the views hold the peer's caches bit for
    bit; closing unmaps each handle once, and a second close nothing."""
    where = [(H_A, 64), (H_B, 0), (H_A, 64 + RB3 + 8)]
    caches, allocs, p = _exported(THREE, where, {H_A: 64 + 2 * RB3 + 8, H_B: RB3},
                                  events=(b"\x03" * 64, b"\x04" * 64))
    cuda = FakeCuda(monkeypatch, allocs)
    cuda.answer = ("", False)
    m = _ipc.Mapping(p, CUDA1)
    assert cuda.log == [
        ("probe", 1, [0xA0, 0xB0], [(0, 64, RB3), (1, 0, RB3), (0, 64 + RB3 + 8, RB3)],
         [3, 4]),
        ("enter", 1), ("sync", 1), ("open", 0xA0, 1), ("range", 0xA0), ("open", 0xB0, 1),
        ("range", 0xB0), ("range", 0xA0), ("exit", 1)]
    assert m.events_ok is False
    a, b = allocs[H_A].data_ptr(), allocs[H_B].data_ptr()
    assert cuda.dlpack == [(a + 64, 2, 1, 1, (1, 8, 1), RB3, False, 0),
                           (b, 2, 1, 1, (1, 8, 1), RB3, False, 0),
                           (a + 64 + RB3 + 8, 2, 1, 1, (1, 8, 1), RB3, False, 0)]
    assert len(m.views) == 3
    for view, want in zip(m.views, caches, strict=True):
        assert view.shape == want.shape and view.stride() == want.stride()
        assert torch.equal(view, want)
    # the DLPack descriptors (no deleter) live as long as the mapping: torch reads them again
    assert sum(isinstance(k, _ipc._DLManaged) for k in m._keep) == 3
    del cuda.log[:]
    m.close()
    assert sorted(cuda.log) == [("close", 0xA0), ("close", 0xB0)] and m.views == []
    m.close()
    assert sorted(cuda.log) == [("close", 0xA0), ("close", 0xB0)]


def test_a_cross_layer_mapping_views_every_layer_of_its_one_region(monkeypatch) -> None:
    spec = THREE.evolve(cross_layer=True)
    caches, allocs, p = _exported(spec, [(H_A, 128)], {H_A: 128 + spec.region_bytes})
    cuda = FakeCuda(monkeypatch, allocs)
    m = _ipc.Mapping(p, types.SimpleNamespace(type="cuda", index=None))  # the current device: 1
    assert cuda.log[0] == ("probe", 1, [0xA0], [(0, 128, spec.region_bytes)], [])
    assert m.events_ok is True
    assert len(m.views) == 3
    for view, want in zip(m.views, caches, strict=True):
        assert view.shape == want.shape and view.stride() == want.stride()
        assert torch.equal(view, want)


def test_a_region_past_its_allocation_is_refused_and_every_handle_unmapped(monkeypatch) -> None:
    """A lying peer: its last region ends one byte past its allocation (the probe, faked here,
    let it through). The error names the region; both handles opened so far are closed."""
    where = [(H_A, 0), (H_B, 0), (H_A, RB3 + 1)]
    _, allocs, p = _exported(THREE, where, {H_A: 2 * RB3, H_B: RB3}, engine=RANK1)
    cuda = FakeCuda(monkeypatch, allocs)
    with pytest.raises(FkvError) as e:
        _ipc.Mapping(p, CUDA1)
    assert str(e.value) == (f"prefill rank 1 announced a region at offset {RB3 + 1} (+{RB3} "
                            f"bytes) of an allocation of {2 * RB3} bytes; refusing to map it")
    assert cuda.log[-4:] == [("range", 0xA0), ("exit", 1), ("close", 0xA0), ("close", 0xB0)]
    assert len(cuda.dlpack) == 2  # no tensor over the region that does not fit


@pytest.mark.parametrize(("call", "message", "closed"), [
    ("open", "CUDA IPC: cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_HANDLE (400)", []),
    ("range", "CUDA IPC: cuMemGetAddressRange of the mapped allocation failed: "
              "CUDA_ERROR_INVALID_HANDLE (400)", [("close", 0xA0)]),
])
def test_a_failing_driver_call_is_an_error_and_unmaps(monkeypatch, call, message, closed) -> None:
    _, allocs, p = _exported(THREE, [(H_A, 0), (H_B, 0), (H_A, RB3)], {H_A: 2 * RB3, H_B: RB3})
    cuda = FakeCuda(monkeypatch, allocs)
    cuda.errors[call] = 400
    with pytest.raises(FkvError) as e:
        _ipc.Mapping(p, CUDA1)
    assert str(e.value) == message
    assert [c for c in cuda.log if c[0] in ("open", "close")] == [("open", 0xA0, 1), *closed]
    assert cuda.dlpack == []


def test_any_error_while_wrapping_unmaps(monkeypatch) -> None:
    _, allocs, p = _exported(THREE, [(H_A, 0), (H_B, 0), (H_A, RB3)], {H_A: 2 * RB3, H_B: RB3})
    cuda = FakeCuda(monkeypatch, allocs)
    cuda.fail_dlpack = 2
    with pytest.raises(RuntimeError, match="from_dlpack failed"):
        _ipc.Mapping(p, CUDA1)
    assert sorted(c for c in cuda.log if c[0] == "close") == [("close", 0xA0), ("close", 0xB0)]


def test_an_unknown_driver_error_is_named_by_its_code() -> None:
    class Lib:
        cuGetErrorName = staticmethod(lambda code, ref: 0)  # leaves the name NULL

    _ipc._check(0, "anything")
    with pytest.raises(FkvError) as e:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_ipc, "_driver", Lib)
            _ipc._check(999, "cuIpcCloseMemHandle")
    assert str(e.value) == "CUDA IPC: cuIpcCloseMemHandle failed: ? (999)"


def test_refused_peers_are_never_opened(monkeypatch) -> None:
    """The refusal (here: another host) or the probe's answer is the error; no handle opens."""
    _, allocs, p = _exported(THREE, [(H_A, 0), (H_B, 0), (H_A, RB3)], {H_A: 2 * RB3, H_B: RB3},
                             engine=RANK1)
    cuda = FakeCuda(monkeypatch, allocs)
    cuda.answer = ("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)", False)
    with pytest.raises(FkvError) as e:
        _ipc.Mapping(p, CUDA1)
    assert str(e.value) == (MUST_NOT.replace("rank 0", "rank 1") + "cuIpcOpenMemHandle failed: "
                            "CUDA_ERROR_INVALID_VALUE (1) " + FOUND)
    assert [c[0] for c in cuda.log] == ["probe"]
    here = _ipc.host_identity()
    monkeypatch.setattr(_ipc, "host_identity", lambda: "another/host/1")
    with pytest.raises(FkvError) as e:
        _ipc.Mapping(p, CUDA1)
    assert str(e.value) == (f"cannot map prefill rank 1's caches: prefill rank 1 runs on another "
                            f"host ({here!r}, this is 'another/host/1')")
    assert [c[0] for c in cuda.log] == ["probe"]


def test_export_names_each_regions_allocation_and_offset(monkeypatch) -> None:
    allocs = {H_A: torch.zeros(4096, dtype=torch.uint8), H_B: torch.zeros(100, dtype=torch.uint8)}
    cuda = FakeCuda(monkeypatch, allocs)
    a, b = allocs[H_A].data_ptr(), allocs[H_B].data_ptr()
    dev = types.SimpleNamespace(type="cuda", index=1)
    info = _ipc.export_regions([(a + 96, 4000), (b, 100)], dev)  # each ends with its allocation
    assert info == IpcInfo(host=_ipc.host_identity(), device_uuid="GPU-1", handles=(H_A, H_B),
                           offsets=(96, 0), pid=os.getpid())
    assert cuda.log == [("enter", dev), ("sync", dev), ("range", a + 96), ("get handle", a),
                        ("range", b), ("get handle", b), ("exit", dev)]
    # a device without an index: the current device's uuid (the fake's current device is 1)
    assert _ipc.export_regions([(b, 1)], types.SimpleNamespace(type="cuda", index=None)) \
        .device_uuid == "GPU-1"
    with pytest.raises(FkvError) as e:
        _ipc.export_regions([(a, 4097)], dev)
    assert str(e.value) == (f"CUDA IPC: region 0x{a:x}+4097 is not inside one allocation "
                            f"(0x{a:x}+4096)")
    cuda.errors["get handle"] = 1
    with pytest.raises(FkvError) as e:
        _ipc.export_regions([(a, 1)], dev)
    assert str(e.value) == f"CUDA IPC: cuIpcGetMemHandle(0x{a:x}) failed: " \
                           f"CUDA_ERROR_INVALID_VALUE (1)"
    cuda.errors["range"] = 400
    with pytest.raises(FkvError) as e:
        _ipc.export_regions([(a + 5, 1)], dev)
    assert str(e.value) == f"CUDA IPC: cuMemGetAddressRange(0x{a + 5:x}) failed: " \
                           f"CUDA_ERROR_INVALID_HANDLE (400)"


def test_a_gpu_is_found_by_its_uuid(monkeypatch) -> None:
    """``GPU-<i>`` is device i (of 2); a decode device without an index is the current one (1)."""
    FakeCuda(monkeypatch, {})
    assert [_ipc.local_device_of(u) for u in ("GPU-0", "GPU-1", "GPU-2")] == [0, 1, None]
    p1 = decode_untrusted(encode(ENGINE, SPEC, REGIONS, ipc=ipc_info(device_uuid="GPU-1")))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) != (0, 1))
    assert _ipc.ipc_refusal(p1, CUDA0) == \
        "cuda:0 has no peer access to prefill rank 0's GPU (cuda:1)"
    monkeypatch.setattr(torch.cuda, "can_device_access_peer",
                        lambda a, b: pytest.fail(f"asked for peer access {a} -> {b}"))
    assert _ipc.ipc_refusal(p1, types.SimpleNamespace(type="cuda", index=None)) == ""


def test_without_the_driver_library_the_error_says_so(monkeypatch) -> None:
    def cdll(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    with pytest.raises(FkvError) as e:
        _ipc._driver.__wrapped__()
    assert str(e.value) == ("CUDA IPC needs the CUDA driver (libcuda.so.1): libcuda.so.1: cannot "
                            "open shared object file")


def test_the_host_identity_is_host_boot_and_pid_namespace(monkeypatch) -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    ns = os.stat("/proc/self/ns/pid").st_ino
    assert _ipc.host_identity() == f"{socket.gethostname()}/{boot}/{ns}"

    def nothing(*args, **kw):
        raise OSError("no /proc")

    monkeypatch.setattr(_ipc, "open", nothing, raising=False)
    monkeypatch.setattr(_ipc.os, "stat", nothing)
    assert _ipc.host_identity() == f"{socket.gethostname()}/no-boot-id/0"


def test_the_driver_is_declared_so_addresses_and_handles_reach_it_whole(monkeypatch) -> None:
    """``libcuda``'s functions come without prototypes: ``_driver`` declares them, else a 64-bit
    address is cut to a C int and a handle (64 bytes by value) is passed as a pointer."""
    seen = []
    cf, c_int, u64, vp = ctypes.CFUNCTYPE, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p
    callbacks = {
        "cuMemGetAddressRange_v2": cf(c_int, vp, vp, u64)(
            lambda start, size, ptr: seen.append(("range", ptr)) or 0),
        "cuIpcGetMemHandle": cf(c_int, vp, u64)(lambda ref, base: seen.append(("get", base)) or 0),
        "cuIpcOpenMemHandle_v2": cf(c_int, vp, _Handle, ctypes.c_uint)(
            lambda ref, handle, flags: seen.append(("open", bytes(handle), flags)) or 0),
        "cuIpcCloseMemHandle": cf(c_int, u64)(lambda base: seen.append(("close", base)) or 0),
        "cuGetErrorName": cf(c_int, c_int, vp)(lambda code, ref: 0)}

    class Unprototyped(ctypes._CFuncPtr):  # as ctypes.CDLL makes them
        _flags_ = ctypes._FUNCFLAG_CDECL
        _restype_ = ctypes.c_int

    lib = types.SimpleNamespace(**{name: Unprototyped(ctypes.cast(cb, vp).value)
                                   for name, cb in callbacks.items()})
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    driver = _ipc._driver.__wrapped__()
    big = 0x7F12_3456_789A
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), big)
    driver.cuIpcGetMemHandle(ctypes.byref(_Handle()), big + 1)
    driver.cuIpcOpenMemHandle_v2(ctypes.byref(base), _Handle.from_buffer_copy(H_B), 1)
    driver.cuIpcCloseMemHandle(big + 2)
    assert seen == [("range", big), ("get", big + 1), ("open", H_B, 1), ("close", big + 2)]


def test_only_cuda_caches_are_mapped() -> None:
    meta = types.SimpleNamespace(type="meta", index=0)
    assert _ipc.ipc_refusal(peer(ipc_info()), meta) == \
        "the decode caches are not on CUDA (ipc maps GPU memory)"


@pytest.mark.parametrize("env", [None, ""])
def test_mps_is_looked_for_in_its_default_pipe_directory(monkeypatch, env) -> None:
    if env is None:
        monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    else:
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", env)
    asked = []
    monkeypatch.setattr(_ipc.os.path, "exists", lambda path: asked.append(path) or True)
    assert _ipc.mps_running() is True
    assert asked == [os.path.join("/tmp/nvidia-mps", "control")]  # the default pipe directory


FUZZ_WORKER = Path(__file__).with_name("_ipc_fuzz_worker.py")
MUST_NOT = "prefill rank 0 sent CUDA IPC handles that this process must not map: "
FOUND = ("(found by trying them in a separate process: a mapping that faults would end every "
         "CUDA call of this one); refusing to map them")


def _exporter() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(FUZZ_WORKER), "export"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline()


def _refused_by_the_probe(r: dict, *causes: str) -> bool:
    return (r["outcome"], r["error"]) == ("refused", "FkvError") and any(
        r["message"].startswith(MUST_NOT + cause) for cause in causes) and r["message"].endswith(
            FOUND)


@pytest.mark.gpu
def test_hostile_ipc_handles_cost_an_error_never_the_context() -> None:
    """A decode process maps a prefill peer's IPC handles altered every way a buggy or hostile
    peer could send them: each of the 64 bytes of the memory handle flipped, 16 random handles, all
    zeros, an event handle in its place, a region past the end of its allocation, the handle of a
    process that exited; and event handles zeroed, flipped, swapped for memory handles, or from
    the exited process. Each costs an ``FkvError`` naming what CUDA said when the handles were
    tried in a probe process (or maps the very same bytes, where CUDA ignores the byte), or, for
    events, the fallback that counts finished writes; after every case the process's CUDA context
    still computes right. (On the H200's driver 580 a memory handle with byte 31 flipped opens,
    reports the right size and faults on the first read: before the probe, this test's own
    process died of it.)"""
    live, live_line = _exporter()
    dead, dead_line = _exporter()
    dead.stdin.close()
    dead.stdout.close()
    assert dead.wait(timeout=60) == 0
    try:
        got = subprocess.run([sys.executable, str(FUZZ_WORKER), "map"], input=live_line + dead_line,
                             capture_output=True, text=True, timeout=600)
    finally:
        live.stdin.close()
        live.stdout.close()
        assert live.wait(timeout=60) == 0
    assert got.returncode == 0, got.stderr[-3000:]
    results = json.loads(next(line[7:] for line in got.stdout.splitlines()
                              if line.startswith("RESULT ")))
    by = {r.pop("case"): r for r in results}
    assert len(by) == 1 + 64 + 16 + 4 + 4 + 16
    assert [name for name, r in by.items() if not r.pop("context_ok")] == []
    assert by.pop("real") == {"outcome": "mapped", "same_bytes": True}
    info = json.loads(live_line)
    size, past = info["alloc_size"], info["alloc_size"] - SPEC.region_bytes + 1
    assert by.pop("offset past the allocation") == {
        "outcome": "refused", "error": "FkvError",
        "message": f"{MUST_NOT}a region at offset {past} (+{SPEC.region_bytes} bytes) of an "
                   f"allocation of {size} bytes {FOUND}"}
    assert by.pop("real events") == {"outcome": "opened", "probe": True, "done": [True, True]}
    for name in ("a memory handle as events", "zero events", "dead exporter's events",
                 *(f"event flip {i}" for i in range(0, 64, 4))):
        r = by.pop(name)
        assert r in ({"outcome": "no events (count finished writes)", "probe": False},
                     {"outcome": "opened", "probe": True, "done": [True, True]}), (name, r)
    for name in ("zeros", "an event handle as memory", "dead exporter",
                 *(f"random {k}" for k in range(16))):
        assert _refused_by_the_probe(by.pop(name), "cuIpcOpenMemHandle failed: "), name
    outcomes = {}
    for name, r in by.items():  # the 64 flips
        assert r == {"outcome": "mapped", "same_bytes": True} or _refused_by_the_probe(
            r, "cuIpcOpenMemHandle failed: ", "reading the mapped region failed: "), (name, r)
        outcomes[name] = r["outcome"]
    assert sorted(by) == sorted(f"flip {i}" for i in range(64))
    assert "refused" in outcomes.values()
    print("refused flips:", {name: r["message"][len(MUST_NOT):].split(" (found")[0]
                             for name, r in by.items() if r["outcome"] == "refused"})
