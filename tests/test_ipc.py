"""The ipc path's pure parts on CPU: when it is refused and why, and its wire fields (round trip
and fuzz). The mapping itself runs in the GPU tests (tests/test_transport.py, ``-m gpu``), and so
do hostile handles (below: a prefill peer's corrupt, random, dead or misplaced IPC handles)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fkv
from fkv.connector import EngineDesc, decode_untrusted, encode
from fkv.connector.transport import _ipc
from fkv.connector.wire import IpcInfo
from fkv.errors import FkvWireError

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
