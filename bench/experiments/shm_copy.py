"""Experiment: would a same-host read copy rows faster from a mapping of the prefill's memory
than through ``process_vm_readv``?

A child process (the "prefill") holds 256 MiB twice: private anonymous memory on huge pages (what
``fkv.allocate`` gives a CPU cache today, read with ``process_vm_readv``) and a ``memfd`` it maps
shared (on huge pages where the kernel's ``shmem_enabled`` allows ``MADV_HUGEPAGE``). This
process opens the memfd through ``/proc/<pid>/fd`` and maps it read-only (``MAP_POPULATE``),
then copies random rows into a buffer of its own (huge pages):

- ``cma``: one ``process_vm_readv`` of every row (``SameHostCopy.copy`` under 4 MiB);
- ``shm memmove``: ``ctypes.memmove`` per row from the mapping (one copy, a Python loop);
- ``shm numpy``: ``dst[to] = src[rows]`` on 2-D views (numpy's gather, then its scatter);
- ``shm one block``: one ``memmove`` of the same number of bytes from one contiguous stretch
  (the copy without rows: what memcpy itself costs).

States: ``written`` (the child rewrote the rows just before, what a streamed read's last layer
sees), ``cold`` (this process wrote 256 MiB of another buffer first), ``warm`` (the same rows
copied just before). Median of 25 per case, microseconds.

    python bench/experiments/shm_copy.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _holder import anonymous, holder  # noqa: E402
from _record import write  # noqa: E402

from fkv.connector.transport._cma import _call  # noqa: E402

SIZE, REPS = 256 << 20, 25
CASES = ((32, 16 << 10), (64, 16 << 10), (256, 32 << 10))  # 0.5, 1 and 8 MiB
_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _shmem_mode() -> str:
    try:
        text = Path(_SHMEM).read_text()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def _huge_kib(pid: int) -> dict[str, int]:
    """AnonHugePages and ShmemPmdMapped of a process (kB), from smaps_rollup."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("AnonHugePages", "ShmemPmdMapped", "Shared_Hugetlb", "FilePmdMapped"):
            out[key] = int(line.split()[1])
    return out


def _hold(conn) -> None:
    m, anon = anonymous(SIZE, True)
    fd = os.memfd_create("fkv-shm-exp", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    sm = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED)
    sm.madvise(mmap.MADV_HUGEPAGE)
    shm = np.frombuffer(sm, dtype=np.uint8)
    shm[:] = 1
    conn.send((os.getpid(), anon.ctypes.data, fd))
    while (msg := conn.recv()) is not None:
        row, rows = msg
        for s in rows:
            anon[s * row:(s + 1) * row] += 1
            shm[s * row:(s + 1) * row] += 1
        conn.send(True)
    del anon, shm
    m.close()
    sm.close()


def main() -> None:
    rng = np.random.default_rng(0)
    rows_out = []
    with holder(_hold, size=SIZE) as (conn, _, (pid, base, fdnum)):
        fd = os.open(f"/proc/{pid}/fd/{fdnum}", os.O_RDONLY)
        sm = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ)
        src = np.frombuffer(sm, dtype=np.uint8)
        mdst, dst = anonymous(SIZE, True)
        mflush, flush = anonymous(SIZE, True)
        huge = {"child": _huge_kib(pid), "here": _huge_kib(os.getpid()),
                "shmem_enabled": _shmem_mode()}
        print(huge, flush=True)
        memmove = ctypes.memmove
        for n, row in CASES:
            per = SIZE // row
            s2, d2 = src.reshape(per, row), dst.reshape(per, row)
            for state in ("written", "cold", "warm"):
                for mode in ("cma", "shm memmove", "shm numpy", "shm one block"):
                    times = []
                    for _ in range(REPS):
                        srows = rng.permutation(per)[:n]
                        to = rng.permutation(per)[:n]
                        local = np.ascontiguousarray(
                            np.stack([dst.ctypes.data + to * row, np.full(n, row)], 1),
                            dtype=np.uint64)
                        remote = np.ascontiguousarray(
                            np.stack([base + srows * row, np.full(n, row)], 1), dtype=np.uint64)
                        first = int(srows[0]) * row
                        if state == "written":
                            conn.send((row, srows.tolist()))
                            conn.recv()
                        elif state == "cold":
                            flush += 1
                        else:  # warm: the same copy once, untimed
                            _call(pid, local, remote)
                            d2[to] = s2[srows]
                        sa, da = src.ctypes.data, dst.ctypes.data
                        t = time.perf_counter()
                        if mode == "cma":
                            assert _call(pid, local, remote)[0] == n * row
                        elif mode == "shm memmove":
                            for a, b in zip(to.tolist(), srows.tolist(), strict=True):
                                memmove(da + a * row, sa + b * row, row)
                        elif mode == "shm numpy":
                            d2[to] = s2[srows]
                        else:
                            memmove(da + int(to[0]) * row, sa + first, n * row)
                        times.append(time.perf_counter() - t)
                    r = {"rows": n, "row_bytes": row, "state": state, "mode": mode,
                         "us": 1e6 * statistics.median(times),
                         "us_p10_p90": [1e6 * q for q in statistics.quantiles(times, n=10)[::8]]}
                    print(r, flush=True)
                    rows_out.append(r)
        del src, s2, d2
        sm.close()
        os.close(fd)
    rows_out.append({"huge_pages_kib": huge})
    write("shm-copy-exp.json", "shm_copy", rows_out)


if __name__ == "__main__":
    main()
