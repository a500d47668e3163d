"""Experiment: what transparent huge pages on both caches do to a same-host copy
(``SameHostCopy.copy``, one ``process_vm_readv`` per call).

A child process holds 512 MiB (the "prefill cache"); this process copies N random rows of it into
a 512 MiB cache of its own. Each buffer is anonymous memory, either left to the kernel's default
(4 KiB pages where transparent huge pages are ``madvise``) or marked ``MADV_HUGEPAGE`` before its
first touch; ``AnonHugePages`` of both processes is recorded. States: ``cold`` (512 MiB of
another buffer written between copies), ``just written`` (the child rewrites the rows it is about
to be read from, on its own core, and answers only then: what a streamed read of the layer a
prefill just wrote sees), ``warm`` (the same rows copied once before). Median of 15.

    python bench/experiments/cma_huge.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _holder import anonymous, holder  # noqa: E402
from _record import write  # noqa: E402

from fkv.connector.transport._cma import SameHostCopy  # noqa: E402

SIZE, REPS = 512 << 20, 15
CASES = [(32, 16 << 10), (32, 32 << 10), (256, 32 << 10)]  # (rows, row bytes)


def _huge_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def _hold(conn, huge: bool) -> None:
    m, buf = anonymous(SIZE, huge)
    conn.send((os.getpid(), buf.ctypes.data, _huge_kib()))
    while (msg := conn.recv()) is not None:
        src, size = msg  # rewrite these rows now, then answer
        for s in src:
            buf[s * size:(s + 1) * size] += 1
        conn.send(True)
    del buf
    m.close()


def _case(src_huge: bool, dst_huge: bool, rng: np.random.Generator) -> list[dict]:
    rows = []
    with holder(_hold, src_huge, size=SIZE) as (a, peer, (_, _, child_huge)):
        mdst, dst = anonymous(SIZE, dst_huge)
        mscratch, scratch = anonymous(SIZE, False)
        copier = SameHostCopy([(dst.ctypes.data, SIZE)], None, {0: peer}, "exp")
        copier.threads = 1
        try:
            for n, size in CASES:
                for state in ("cold", "just written", "warm"):
                    rows.append(_row(copier, a, rng, n, size, state, src_huge, dst_huge,
                                     child_huge, scratch))
        finally:
            copier.close()
            del dst, scratch
            mdst.close()
            mscratch.close()
    return rows


def _row(copier, conn, rng, n, size, state, src_huge, dst_huge, child_huge, scratch) -> dict:
    times = []
    for _ in range(REPS):
        src = rng.permutation(SIZE // size)[:n]
        to = rng.permutation(SIZE // size)[:n]
        plan = np.zeros((n, 6), dtype=np.int64)
        plan[:, 2], plan[:, 4], plan[:, 5] = src * size, to * size, size
        local, remote, nbytes = copier.vectors(0, plan)
        scratch += 1
        if state == "warm":
            copier.copy(0, local, remote, nbytes, float("inf"))
        if state == "just written":
            conn.send((src.tolist(), size))
            conn.recv()
        t = time.perf_counter()
        copier.copy(0, local, remote, nbytes, float("inf"))
        times.append(time.perf_counter() - t)
    row = {"src_pages": "huge" if src_huge else "4k", "dst_pages": "huge" if dst_huge else "4k",
           "rows": n, "row_bytes": size, "state": state,
           "copy_ms": 1e3 * statistics.median(times), "copy_ms_min": 1e3 * min(times),
           "src_anon_huge_kib": child_huge, "dst_anon_huge_kib": _huge_kib()}
    print(row, flush=True)
    return row


def main() -> None:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print("transparent_hugepage:", f.read().strip())
    rng = np.random.default_rng(0)
    rows = []
    for src_huge, dst_huge in ((False, False), (True, True), (True, False), (False, True)):
        rows += _case(src_huge, dst_huge, rng)
    write(f"cma-huge-exp-{time.strftime('%Y%m%dT%H%M', time.gmtime())}.json",
          "SameHostCopy.copy with 4 KiB or transparent huge pages on either side", rows)


if __name__ == "__main__":
    main()
