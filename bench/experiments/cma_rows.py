"""Experiment: what one ``process_vm_readv`` per row costs against one call for all rows.

NIXL's UCX backend copies a same-host CPU READ over its ``cma`` transport one descriptor at a
time; fkv's same-host copies (``fkv/connector/transport/_cma.py``) pass up to 1024 rows to one
call. A child process holds 64 MiB; this process copies N rows of 16 KiB (a 16-block layer of a
decode rank in HND at TP 1 -> 2 is 32 such rows; 256 rows is 8 layers), scattered on both
sides, 50 times each way, and reports the median and the minimum.

    python bench/experiments/cma_rows.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import write  # noqa: E402

from fkv.connector.transport._cma import _call  # noqa: E402

SIZE, ROW, REPS = 64 << 20, 16 << 10, 50


def _hold(q: mp.Queue, done: mp.Event) -> None:
    buf = np.random.default_rng(1).integers(0, 255, size=SIZE, dtype=np.uint8)
    q.put((mp.current_process().pid, buf.ctypes.data))
    done.wait()


def main() -> None:
    q, done = mp.Queue(), mp.Event()
    child = mp.Process(target=_hold, args=(q, done))
    child.start()
    pid, base = q.get()
    dst = np.zeros(SIZE, dtype=np.uint8)
    rng = np.random.default_rng(0)
    rows = []
    for n in (32, 256):
        src_rows = rng.permutation(SIZE // ROW)[:n].astype(np.uint64)
        dst_rows = rng.permutation(SIZE // ROW)[:n].astype(np.uint64)
        remote = np.stack([base + src_rows * ROW, np.full(n, ROW, np.uint64)], axis=1)
        local = np.stack([dst.ctypes.data + dst_rows * ROW, np.full(n, ROW, np.uint64)], axis=1)
        for mode in ("one call", "a call per row"):
            times = []
            for _ in range(REPS):
                t = time.perf_counter()
                if mode == "one call":
                    assert _call(pid, local, remote)[0] == n * ROW
                else:
                    for i in range(n):
                        assert _call(pid, local[i:i + 1], remote[i:i + 1])[0] == ROW
                times.append(time.perf_counter() - t)
            row = {"rows": n, "row_bytes": ROW, "mode": mode,
                   "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                   "gbps": n * ROW / statistics.median(times) / 1e9}
            print(row, flush=True)
            rows.append(row)
    done.set()
    child.join()
    write(f"cma-rows-exp-{time.strftime('%Y%m%dT%H%M', time.gmtime())}.json",
          "process_vm_readv: one call for N rows of 16 KiB against a call per row", rows)


if __name__ == "__main__":
    main()
