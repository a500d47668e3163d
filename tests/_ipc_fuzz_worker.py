"""Both sides of the hostile CUDA IPC tests (tests/test_ipc.py, ``-m gpu``), each in its own
process: CUDA refuses to open a process's own IPC handles, and a handle that broke a CUDA
context must break a throwaway process, not the test runner.

``python _ipc_fuzz_worker.py export`` (the prefill side) fills one CUDA allocation with a known
byte pattern, exports two cache regions inside it and two interprocess events, prints one JSON
line (the rank's ``IpcInfo`` fields, hex for bytes, and the allocation's size), then waits for
stdin to close.

``python _ipc_fuzz_worker.py map`` (the decode side) reads two such lines on stdin, a live
exporter's and one whose process has exited, maps altered copies of them the way a decode rank
does (``_ipc.Mapping``, which first tries them in a probe process, and ``IpcPath._open_events``)
and prints one JSON line: per case what
happened (``mapped`` with whether every view holds the exporter's bytes, ``refused`` with the
error's type and message) and whether this process's CUDA context still computes right after it.
"""

from __future__ import annotations

import json
import random
import sys
import types

import torch

import fkv
from fkv.connector import EngineDesc, decode_untrusted, encode
from fkv.connector.transport import _ipc
from fkv.connector.transport._ipc_path import IpcPath
from fkv.connector.wire import IpcInfo
from fkv.tensors import _inverse, torch_dtype

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128,
                       num_layers=2)
ENGINE = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=8)
RB = SPEC.region_bytes
OFFSETS = (0, RB + 512)  # the two regions inside one allocation
ALLOC = 3 * RB


def pattern(n: int) -> torch.Tensor:
    """The exporter's bytes: byte i of the allocation is (7 i + 3) mod 251."""
    return ((torch.arange(n, dtype=torch.int64) * 7 + 3) % 251).to(torch.uint8)


def export() -> None:
    dev = torch.device("cuda:0")
    buf = pattern(ALLOC).to(dev)
    events = [torch.cuda.Event(interprocess=True) for _ in range(2)]
    for event in events:
        event.record()
    torch.cuda.synchronize()
    regions = [(buf.data_ptr() + off, RB) for off in OFFSETS]
    info = _ipc.export_regions(regions, dev)
    base, size = _ipc.ctypes.c_uint64(), _ipc.ctypes.c_size_t()
    _ipc._driver().cuMemGetAddressRange_v2(_ipc.ctypes.byref(base), _ipc.ctypes.byref(size),
                                           buf.data_ptr())
    print(json.dumps({"host": info.host, "device_uuid": info.device_uuid, "pid": info.pid,
                      "handles": [h.hex() for h in info.handles], "offsets": list(info.offsets),
                      "events": [bytes(e.ipc_handle()).hex() for e in events],
                      "regions": regions, "first_offset": info.offsets[0],
                      "alloc_size": size.value}), flush=True)
    sys.stdin.read()  # alive (and the memory mapped) until the test closes our stdin


def _peer(info: dict, **change) -> object:
    fields = {"host": info["host"], "device_uuid": info["device_uuid"], "pid": info["pid"],
              "handles": tuple(bytes.fromhex(h) for h in info["handles"]),
              "offsets": tuple(info["offsets"]),
              "events": tuple(bytes.fromhex(e) for e in info["events"])}
    fields.update(change)
    regions = [tuple(r) for r in info["regions"]]
    return decode_untrusted(encode(ENGINE, SPEC, regions, ipc=IpcInfo(**fields)))


def _expected(info: dict, offsets) -> list[torch.Tensor]:
    """The layer views a right mapping shows: the exporter's pattern at each region's offset."""
    every = pattern(ALLOC)
    inv = _inverse(SPEC.stride_order)
    base = info["first_offset"]
    return [every[off - base:off - base + RB].view(torch_dtype(SPEC.dtype))
            .view(SPEC.physical_shape).permute(inv) for off in offsets]


def _context_ok() -> bool:
    x = torch.arange(1000, dtype=torch.float32, device="cuda:0")
    return float((x * 2).sum()) == 999000.0 and torch.cuda.synchronize() is None


def _map(peer, expected) -> dict:
    try:
        mapping = _ipc.Mapping(peer, torch.device("cuda:0"))
    except Exception as e:  # noqa: BLE001 - the case's outcome
        return {"outcome": "refused", "error": type(e).__name__, "message": str(e)}
    try:
        same = all(torch.equal(view.cpu(), want) for view, want in zip(mapping.views, expected,
                                                                      strict=True))
        return {"outcome": "mapped", "same_bytes": same}
    finally:
        mapping.close()


def _events(peer) -> dict:
    """What a streaming decode rank makes of the peer's events (its memory handles are right)."""
    try:
        mapping = _ipc.Mapping(peer, torch.device("cuda:0"))
    except Exception as e:  # noqa: BLE001 - the case's outcome
        return {"outcome": "refused", "error": type(e).__name__, "message": str(e)}
    host = types.SimpleNamespace(mappings={0: mapping},
                                 local=types.SimpleNamespace(device=torch.device("cuda:0")))
    try:
        got = IpcPath._open_events(host, [peer])
    except Exception as e:  # noqa: BLE001 - the case's outcome
        return {"outcome": "raised", "error": type(e).__name__, "message": str(e)}
    finally:
        mapping.close()
    if not got:
        return {"outcome": "no events (count finished writes)", "probe": mapping.events_ok}
    return {"outcome": "opened", "probe": mapping.events_ok,
            "done": [bool(e.query()) for e in got[0]]}


def map_cases() -> None:
    live, dead = (json.loads(line) for line in sys.stdin.read().splitlines()[:2])
    handles = tuple(bytes.fromhex(h) for h in live["handles"])
    events = tuple(bytes.fromhex(e) for e in live["events"])
    right = _expected(live, live["offsets"])
    rng = random.Random(14)
    cases: list[tuple[str, str, dict, object]] = [("real", "map", {}, right)]
    for i in range(64):
        flipped = tuple(h[:i] + bytes([h[i] ^ 0xFF]) + h[i + 1:] for h in handles)
        cases.append((f"flip {i}", "map", {"handles": flipped}, right))
    for k in range(16):
        junk = rng.randbytes(64)
        cases.append((f"random {k}", "map", {"handles": (junk, junk)}, right))
    cases += [("zeros", "map", {"handles": (bytes(64), bytes(64))}, right),
              ("an event handle as memory", "map", {"handles": (events[0], events[0])}, right),
              ("offset past the allocation", "map",
               {"offsets": (live["offsets"][0], live["alloc_size"] - RB + 1)}, right),
              ("dead exporter", "map-dead", {}, right),
              ("real events", "events", {}, None),
              ("a memory handle as events", "events", {"events": (handles[0], handles[0])}, None),
              ("zero events", "events", {"events": (bytes(64), bytes(64))}, None),
              ("dead exporter's events", "events-dead", {}, None)]
    for i in range(0, 64, 4):
        flipped = tuple(e[:i] + bytes([e[i] ^ 0xFF]) + e[i + 1:] for e in events)
        cases.append((f"event flip {i}", "events", {"events": flipped}, None))
    out = []
    for name, kind, change, expected in cases:
        if kind == "map-dead":
            peer = _peer(dead)
        elif kind == "events-dead":  # the live rank's memory, the exited one's events
            peer = _peer(live, events=tuple(bytes.fromhex(e) for e in dead["events"]))
        else:
            peer = _peer(live, **change)
        got = _map(peer, expected) if kind.startswith("map") else _events(peer)
        got.update(case=name, context_ok=_context_ok())
        out.append(got)
        if not got["context_ok"]:
            break
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    {"export": export, "map": map_cases}[sys.argv[1]]()
