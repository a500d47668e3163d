"""The probe that tries a prefill peer's CUDA IPC handles in a throwaway process
(``fkv.connector.transport._ipc_probe``), on CPU: its checks against a fake CUDA driver that
records every call, and its process boundary (no answer, a timeout, no CUDA driver). The real
driver's answers to hostile handles are in tests/test_ipc.py (``-m gpu``)."""

from __future__ import annotations

import ctypes
import io
import json
import subprocess
import sys

import pytest

from fkv.connector.transport import _ipc_probe
from fkv.connector.transport._ipc_probe import ROWS, STRIDE

ERRORS = {1: "CUDA_ERROR_INVALID_VALUE", 400: "CUDA_ERROR_INVALID_HANDLE",
          719: "CUDA_ERROR_LAUNCH_FAILED"}
H0, H1 = b"\x01" * 64, b"\x02" * 64
E0 = b"\x03" * 64


class FakeDriver:
    """The driver calls the probe makes, as plain functions (``argtypes`` can be set on them).
    ``sizes``: allocation size per handle (absent: the open fails with ``open_error``);
    ``bad``: device addresses whose read fails with 719; ``events``: per event handle the
    query's code (absent: the open fails)."""

    def __init__(self, sizes: dict[bytes, int], bad: tuple[int, ...] = (), events=None,
                 open_error: int = 1, sync_error: int = 0) -> None:
        self.calls: list[tuple] = []
        bases = {h: 0x7000_0000_0000 + (i << 32) for i, h in enumerate(sizes)}
        self.bases = bases
        events = events or {}

        def out(ref, value):
            ref._obj.value = value

        def open_mem(ref, handle, flags):
            raw = bytes(handle)
            self.calls.append(("open", raw[:1], flags))
            if raw not in sizes:
                return open_error
            out(ref, bases[raw])
            return 0

        def address_range(start, size, base):
            raw = next(h for h, b in bases.items() if b == base)
            out(start, base)
            out(size, sizes[raw])
            return 0

        def copy(ref):
            c = ref._obj
            self.calls.append(("copy", c.srcDevice, c.srcPitch, c.Height, c.WidthInBytes,
                               c.srcMemoryType, c.dstMemoryType, c.dstPitch))
            rows = range(c.srcDevice, c.srcDevice + c.Height * c.srcPitch, c.srcPitch)
            return 719 if any(a in bad for a in rows) else 0

        def open_event(ref, handle):
            raw = bytes(handle)
            self.calls.append(("open event", raw[:1]))
            if raw not in events:
                return 400
            out(ref, 0x1000 + list(events).index(raw))
            return 0

        def query(event):
            raw = list(events)[event.value - 0x1000]
            self.calls.append(("query", raw[:1]))
            return events[raw]

        def error_name(code, ref):
            ref._obj.value = ERRORS.get(code, "CUDA_ERROR_UNKNOWN").encode()
            return 0

        self.cuInit = lambda flags: 0
        self.cuDeviceGet = lambda ref, ordinal: (self.calls.append(("device", ordinal)), 0)[1]
        self.cuDevicePrimaryCtxRetain = lambda ref, dev: 0
        self.cuCtxSetCurrent = lambda ctx: 0
        self.cuIpcOpenMemHandle_v2 = open_mem
        self.cuMemGetAddressRange_v2 = address_range
        self.cuMemcpy2D_v2 = copy
        self.cuCtxSynchronize = lambda: sync_error
        self.cuIpcOpenEventHandle = open_event
        self.cuEventQuery = query
        self.cuGetErrorName = error_name


def request(handles=(H0,), regions=((0, 0, 3 * STRIDE),), events=(), device=0) -> dict:
    return {"device": device, "handles": [h.hex() for h in handles],
            "regions": [list(r) for r in regions], "events": [e.hex() for e in events]}


def test_right_handles_are_read_one_byte_every_64_kib_and_at_each_region_end() -> None:
    lib = FakeDriver({H0: 4 * STRIDE, H1: STRIDE})
    got = _ipc_probe._run(request((H0, H1), [(0, 100, 2 * STRIDE + 5), (1, 0, 10)], (E0,), 3),
                          lib)
    assert got == {"refusal": "", "events_ok": False}  # E0 does not open here
    b0, b1 = lib.bases[H0], lib.bases[H1]
    assert lib.calls == [
        ("device", 3), ("open", b"\x01", 1), ("open", b"\x02", 1),
        ("copy", b0 + 100, STRIDE, 3, 1, 2, 1, 1), ("copy", b0 + 100 + 2 * STRIDE + 4, 1, 1, 1, 2,
                                                    1, 1),
        ("copy", b1, STRIDE, 1, 1, 2, 1, 1), ("copy", b1 + 9, 1, 1, 1, 2, 1, 1),
        ("open event", b"\x03")]


def test_a_long_region_is_read_in_copies_of_at_most_rows() -> None:
    n = (2 * ROWS + 3) * STRIDE
    lib = FakeDriver({H0: n})
    assert _ipc_probe._run(request(regions=[(0, 0, n)]), lib) == {"refusal": "",
                                                                  "events_ok": True}
    b = lib.bases[H0]
    assert [c[1:4] for c in lib.calls if c[0] == "copy"] == [
        (b, STRIDE, ROWS), (b + ROWS * STRIDE, STRIDE, ROWS), (b + 2 * ROWS * STRIDE, STRIDE, 3),
        (b + n - 1, 1, 1)]


def test_an_empty_region_reads_nothing() -> None:
    lib = FakeDriver({H0: STRIDE})
    assert _ipc_probe._run(request(regions=[(0, STRIDE, 0)]), lib) == {"refusal": "",
                                                                       "events_ok": True}
    assert [c for c in lib.calls if c[0] == "copy"] == []


def test_a_region_past_its_allocation_is_refused_before_any_read() -> None:
    lib = FakeDriver({H0: 4 * STRIDE})
    got = _ipc_probe._run(request(regions=[(0, 0, STRIDE), (0, STRIDE + 1, 3 * STRIDE)]), lib)
    assert got == {"refusal": f"a region at offset {STRIDE + 1} (+{3 * STRIDE} bytes) of an "
                              f"allocation of {4 * STRIDE} bytes", "events_ok": False}
    assert [c[1] for c in lib.calls if c[0] == "copy"] == [lib.bases[H0],
                                                           lib.bases[H0] + STRIDE - 1]
    exact = FakeDriver({H0: 4 * STRIDE})  # a region that ends at the allocation's end is fine
    assert _ipc_probe._run(request(regions=[(0, STRIDE, 3 * STRIDE)]), exact)["refusal"] == ""


def test_what_cuda_refuses_is_named_with_its_code() -> None:
    with pytest.raises(_ipc_probe._Refused) as e:
        _ipc_probe._run(request((H0, H1)), FakeDriver({H0: STRIDE}))
    assert str(e.value) == "cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)"
    lib = FakeDriver({H0: 4 * STRIDE}, bad=(0x7000_0000_0000 + 2 * STRIDE,))
    with pytest.raises(_ipc_probe._Refused) as e:
        _ipc_probe._run(request(regions=[(0, 0, 4 * STRIDE)]), lib)
    assert str(e.value) == "reading the mapped region failed: CUDA_ERROR_LAUNCH_FAILED (719)"
    last = FakeDriver({H0: 4 * STRIDE}, bad=(0x7000_0000_0000 + 4 * STRIDE - 1,))
    with pytest.raises(_ipc_probe._Refused) as e:  # only the region's last byte faults
        _ipc_probe._run(request(regions=[(0, 0, 4 * STRIDE)]), last)
    assert str(e.value) == "reading the mapped region failed: CUDA_ERROR_LAUNCH_FAILED (719)"
    late = FakeDriver({H0: STRIDE}, sync_error=719)
    with pytest.raises(_ipc_probe._Refused) as e:
        _ipc_probe._run(request(regions=[(0, 0, STRIDE)]), late)
    assert str(e.value) == "reading the mapped regions failed: CUDA_ERROR_LAUNCH_FAILED (719)"


def test_the_probe_reads_a_byte_every_65536_bytes_in_copies_of_at_most_32768_rows() -> None:
    n = 32769 * 65536 + 1
    lib = FakeDriver({H0: n})
    assert _ipc_probe._run(request(regions=[(0, 0, n)]), lib) == {"refusal": "",
                                                                  "events_ok": True}
    b = lib.bases[H0]
    assert [c[1:4] for c in lib.calls if c[0] == "copy"] == [
        (b, 65536, 32768), (b + 32768 * 65536, 65536, 2), (b + n - 1, 1, 1)]


@pytest.mark.parametrize(("call", "what"), [
    ("cuInit", "cuInit"), ("cuDeviceGet", "cuDeviceGet"),
    ("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain"),
    ("cuCtxSetCurrent", "cuCtxSetCurrent"),
    ("cuMemGetAddressRange_v2", "cuMemGetAddressRange of the mapped allocation"),
])
def test_a_setup_call_that_cuda_refuses_is_named_with_its_code(call, what) -> None:
    lib = FakeDriver({H0: STRIDE})
    setattr(lib, call, lambda *args: 1)
    with pytest.raises(_ipc_probe._Refused) as e:
        _ipc_probe._run(request(regions=[(0, 0, STRIDE)]), lib)
    assert str(e.value) == f"{what} failed: CUDA_ERROR_INVALID_VALUE (1)"
    assert [c for c in lib.calls if c[0] == "copy"] == []


def test_an_error_code_cuda_cannot_name_is_shown_as_a_question_mark() -> None:
    lib = FakeDriver({H0: STRIDE})
    lib.cuInit = lambda flags: 999
    lib.cuGetErrorName = lambda code, ref: 1  # leaves the name NULL
    with pytest.raises(_ipc_probe._Refused) as e:
        _ipc_probe._run(request(), lib)
    assert str(e.value) == "cuInit failed: ? (999)"


def test_the_probe_makes_the_asked_devices_primary_context_current() -> None:
    lib = FakeDriver({H0: STRIDE})
    seen = []

    def device_get(ref, ordinal):
        ref._obj.value = 40 + ordinal
        return 0

    def retain(ref, dev):
        seen.append(("retain", dev.value))
        ref._obj.value = 0xC0DE
        return 0

    lib.cuInit = lambda flags: (seen.append(("init", flags)), 0)[1]
    lib.cuDeviceGet = device_get
    lib.cuDevicePrimaryCtxRetain = retain
    lib.cuCtxSetCurrent = lambda ctx: (seen.append(("current", ctx.value)), 0)[1]
    assert _ipc_probe._run(request(regions=[(0, 0, STRIDE)], device=2), lib) == {
        "refusal": "", "events_ok": True}
    assert seen == [("init", 0), ("retain", 42), ("current", 0xC0DE)]


def test_the_mapped_base_reaches_the_driver_as_64_bits() -> None:
    """The driver's functions come from a C library without prototypes: the probe declares
    them, else a 64-bit address is cut to a C int."""
    lib = FakeDriver({H0: 3 * STRIDE})
    base = lib.bases[H0]
    seen = []

    def address_range(start, size, got):
        seen.append(got)
        if got != base:
            return 1
        ctypes.c_uint64.from_address(start).value = base
        ctypes.c_size_t.from_address(size).value = 3 * STRIDE
        return 0

    c_func = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_uint64)(address_range)

    class Unprototyped(ctypes._CFuncPtr):  # as ctypes.CDLL makes them
        _flags_ = ctypes._FUNCFLAG_CDECL
        _restype_ = ctypes.c_int

    lib.cuMemGetAddressRange_v2 = Unprototyped(ctypes.cast(c_func, ctypes.c_void_p).value)
    assert _ipc_probe._run(request(), lib) == {"refusal": "", "events_ok": True}
    assert seen == [base]


def test_every_copy_lands_in_a_host_buffer_that_holds_its_rows(monkeypatch) -> None:
    buffers = {}
    addressof = ctypes.addressof

    def recording_addressof(obj):
        buffers[addressof(obj)] = ctypes.sizeof(obj)
        return addressof(obj)

    monkeypatch.setattr(ctypes, "addressof", recording_addressof)
    n = ROWS * STRIDE + 1
    lib = FakeDriver({H0: n})
    copies = []
    copy = lib.cuMemcpy2D_v2

    def checked_copy(ref):
        c = ref._obj
        copies.append(buffers.get(c.dstHost, 0) >= (c.Height - 1) * c.dstPitch + c.WidthInBytes)
        return copy(ref)

    lib.cuMemcpy2D_v2 = checked_copy
    assert _ipc_probe._run(request(regions=[(0, 0, n)]), lib)["refusal"] == ""
    assert copies == [True, True, True]


def test_an_event_whose_query_faults_the_context_is_not_used() -> None:
    lib = FakeDriver({H0: STRIDE}, events={E0: 0})
    syncs = []
    lib.cuCtxSynchronize = lambda: (syncs.append(1), 0 if len(syncs) == 1 else 719)[1]
    got = _ipc_probe._run(request(regions=[(0, 0, STRIDE)], events=(E0,)), lib)
    assert got == {"refusal": "", "events_ok": False}
    assert len(syncs) == 2


@pytest.mark.parametrize(("events", "codes", "ok", "queried"), [
    ((E0, H1), {E0: 0, H1: 600}, True, 2),  # done and not yet done both answer
    ((E0, H1), {E0: 0, H1: 719}, False, 2),  # a query that fails
    ((E0, H1), {E0: 0}, False, 1),  # the second does not open
    ((E0, H1), {E0: 719, H1: 0}, False, 1),  # the first query fails: the second is not asked
    ((), {}, True, 0),
])
def test_events_must_open_and_answer_a_query(events, codes, ok, queried) -> None:
    lib = FakeDriver({H0: STRIDE}, events=codes)
    got = _ipc_probe._run(request(regions=[(0, 0, STRIDE)], events=events), lib)
    assert got == {"refusal": "", "events_ok": ok}
    assert len([c for c in lib.calls if c[0] == "query"]) == queried


def test_the_script_answers_one_json_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(request())))
    _ipc_probe._main(FakeDriver({H0: 3 * STRIDE}))
    assert json.loads(capsys.readouterr().out) == {"refusal": "", "events_ok": True}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(request())))
    _ipc_probe._main(FakeDriver({}))
    assert json.loads(capsys.readouterr().out) == {
        "refusal": "cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)", "events_ok": False}


def test_probe_sends_the_request_and_reads_the_answer(monkeypatch) -> None:
    seen = {}

    def run(argv, input, capture_output, text, timeout):  # noqa: A002 - subprocess's name
        seen.update(argv=argv, request=json.loads(input), timeout=timeout)
        return subprocess.CompletedProcess(argv, 0, "noise\n" + json.dumps(
            {"refusal": "", "events_ok": True}) + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    assert _ipc_probe.probe(2, [H0, H1], [(1, 64, 128)], [E0]) == ("", True)
    assert seen == {"argv": [sys.executable, "-I", _ipc_probe.__file__],
                    "request": request((H0, H1), [(1, 64, 128)], (E0,), 2), "timeout": 60.0}


@pytest.mark.parametrize(("stdout", "stderr", "rc", "why"), [
    ("", "Traceback\nOSError: libcuda.so.1: cannot open shared object file\n", 1,
     "OSError: libcuda.so.1: cannot open shared object file"),
    ("", "", -11, "exit status -11"),  # killed by a signal
    ('{"refusal": 3}\n{"events_ok": true}\n', "", 0, "exit status 0"),
    ('{"refusal": 3, "events_ok": true}\n', "", 0, "exit status 0"),  # not a string
    ('{"refusal": "", "events_ok": 1}\n', "", 0, "exit status 0"),  # not a bool
    ("[1, 2]\n", "x\n", 0, "x"),
    ('{"refusal": ""\n', "", 1, "exit status 1"),  # cut short: not JSON
    ("", "E" * 300 + "\n", 1, "E" * 200),  # a long last line is cut at 200 characters
])
def test_a_probe_without_an_answer_refuses(monkeypatch, stdout, stderr, rc, why) -> None:
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, rc, stdout, stderr))
    assert _ipc_probe.probe(0, [H0], [(0, 0, 1)]) == (
        f"trying them in a separate process ended without an answer ({why})", False)


def test_a_probe_that_hangs_refuses(monkeypatch) -> None:
    def run(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    monkeypatch.setattr(subprocess, "run", run)
    assert _ipc_probe.probe(0, [H0], [(0, 0, 1)]) == (
        "trying them in a separate process took over 60 s", False)


@pytest.mark.interpreter  # the CPU twin of tests/test_ipc.py's GPU test, which runs the probe
def test_without_a_cuda_device_the_real_script_says_why() -> None:
    """The script itself, run as the probe runs it, on a machine without a GPU: without the
    driver's library, or with it and no device."""
    refusal, ok = _ipc_probe.probe(0, [H0], [(0, 0, 1)])
    assert refusal.startswith("trying them in a separate process ended without an answer "
                              "(OSError: libcuda.so.1: cannot open shared object file") or \
        refusal == "cuInit failed: CUDA_ERROR_NO_DEVICE (100)", refusal
    assert ok is False
