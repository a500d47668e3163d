"""Experiment: which bytes of a CUDA IPC memory handle the driver reads, and what a mapping of a
handle with one byte flipped is (the hostile-handle GPU test found a flip whose mapping opened
and passed the size check, then faulted the decode process's context when read).

An exporter (``tests/_ipc_fuzz_worker.py export``) holds an allocation filled with a known
pattern. Phase 1, one process: each of the 64 bytes flipped (xor 0xFF), ``cuIpcOpenMemHandle``'s
result, and for a handle that opens, the mapped base and what ``cuMemGetAddressRange`` says of it.
Phase 2, a process per handle that opened (a fault ends its process): the mapping read 64 KiB at a
time from its base to the announced size, the first chunk that fails or differs from the pattern.

    python bench/experiments/ipc_handle_flips.py   # GPU; JSON to $OUT
"""

from __future__ import annotations

import ctypes
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve()
WORKER = HERE.parents[2] / "tests" / "_ipc_fuzz_worker.py"
CHUNK = 64 << 10


def _open(handle: bytes) -> dict:
    from fkv.connector.transport import _ipc

    lib = _ipc._driver()
    base = ctypes.c_uint64()
    rc = lib.cuIpcOpenMemHandle_v2(ctypes.byref(base), _ipc._Handle.from_buffer_copy(handle),
                                   _ipc._LAZY_ENABLE_PEER_ACCESS)
    if rc:
        return {"rc": rc}
    start, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc2 = lib.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(size), base.value)
    return {"rc": 0, "base": base.value, "range_rc": rc2, "range_start": start.value,
            "size": size.value}


def child(role: str, info_line: str, index: int) -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    sys.path.insert(0, str(WORKER.parent))
    import torch

    import _ipc_fuzz_worker as w
    from fkv.connector.transport import _ipc

    torch.cuda.synchronize()  # the primary context, current
    info = json.loads(info_line)
    handle = bytes.fromhex(info["handles"][0])
    flipped = (lambda i: handle if i < 0 else handle[:i] + bytes([handle[i] ^ 0xFF])
               + handle[i + 1:])
    if role == "open":
        rows = []
        for i in range(-1, 64):
            got = _open(flipped(i))
            if got["rc"] == 0:
                _ipc._driver().cuIpcCloseMemHandle(got["base"])
            rows.append({"flip": i, **got})
        print("ROW " + json.dumps(rows), flush=True)
        return
    got = _open(flipped(index))
    want = w.pattern(w.ALLOC)
    first = info["first_offset"]
    keep: list = []
    mapped = _ipc._bytes_tensor(got["base"], got["size"], 0, keep)
    result = {"flip": index, **got, "first_bad": None, "error": None, "read": 0}
    for off in range(0, got["size"], CHUNK):
        try:
            chunk = mapped[off:off + CHUNK].cpu()
        except Exception as e:  # noqa: BLE001 - the fault is the finding
            result.update(first_bad=off, error=f"{type(e).__name__}: {str(e)[:200]}")
            break
        lo = off - first
        if 0 <= lo and lo + len(chunk) <= len(want) and not torch.equal(chunk,
                                                                        want[lo:lo + len(chunk)]):
            result.update(first_bad=off, error="bytes differ from the pattern")
            break
        result["read"] = off + len(chunk)
    print("ROW " + json.dumps(result), flush=True)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    sys.path.insert(0, str(HERE.parent))
    import _record

    exporter = subprocess.Popen([sys.executable, str(WORKER), "export"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    line = exporter.stdout.readline().strip()
    rows: list = []

    def run(role: str, index: int) -> list:
        proc = subprocess.run([sys.executable, str(HERE), "--child", role, line, str(index)],
                              capture_output=True, text=True, timeout=120)
        found = [json.loads(ln[4:]) for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if not found:
            return [{"role": role, "flip": index, "rc_process": proc.returncode,
                     "stderr": proc.stderr[-800:]}]
        return found[0] if role == "open" else found

    try:
        opened = run("open", 0)
        rows.append({"phase": "open", "info": json.loads(line), "rows": opened})
        for r in opened:
            print("open", json.dumps(r), flush=True)
        for r in opened:
            if r.get("rc") == 0:
                got = run("read", r["flip"])
                rows.append({"phase": "read", "rows": got})
                print("read", json.dumps(got), flush=True)
    finally:
        exporter.stdin.close()
        exporter.wait(timeout=60)
    _record.write("ipc-handle-flips-exp.json", "ipc_handle_flips", rows)


if __name__ == "__main__":
    main()
