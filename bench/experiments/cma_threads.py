"""Experiment: same-host copies of cold rows, one thread against several.

``cma_rows.py`` copies the same rows again and again (warm caches and TLBs); a streamed read's
last layer is cold: the prefill computed the layer in between. Here a child process holds
512 MiB (a cache of 8 layers x 1024 blocks x 64 KiB), this process copies N random rows into a
512 MiB cache of its own with ``process_vm_readv``, split into K contiguous slices copied by K
threads of a pool started beforehand (ctypes releases the GIL for the call), and 512 MiB of
another buffer are written before each copy (cold caches) or not (warm). ``cold, primed``:
cold, then (untimed, as a streamed read could while it waits for the layer) the destination
rows are read and 8 bytes of every remote 4 KiB page are copied into a scratch buffer (``remote
primed``, ``local primed``: one of the two). Median of 12.

    python bench/experiments/cma_threads.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import write  # noqa: E402

from fkv.connector.transport._cma import _call  # noqa: E402

SIZE, REPS = 512 << 20, 12
CASES = [(32, 16 << 10), (32, 32 << 10), (512, 16 << 10), (256, 32 << 10)]  # (rows, row bytes)


def _hold(q: mp.Queue, done: mp.Event) -> None:
    buf = np.ones(SIZE, dtype=np.uint8)
    q.put((mp.current_process().pid, buf.ctypes.data))
    done.wait()


def main() -> None:
    q, done = mp.Queue(), mp.Event()
    child = mp.Process(target=_hold, args=(q, done))
    child.start()
    pid, base = q.get()
    dst = np.ones(SIZE, dtype=np.uint8)  # written: its pages exist before the first copy
    scratch = np.ones(SIZE, dtype=np.uint8)
    pools = {k: cf.ThreadPoolExecutor(k) for k in (2, 4, 8)}
    for pool in pools.values():  # start every worker thread
        list(pool.map(lambda _: None, range(16)))
    rng = np.random.default_rng(0)
    rows = []
    for n, size in CASES:
        for state in ("cold", "cold, primed", "cold, remote primed", "cold, local primed",
                      "warm"):
            for k in (1, 2, 4):
                times = []
                for _ in range(REPS):
                    src = rng.permutation(SIZE // size)[:n].astype(np.uint64)
                    to = rng.permutation(SIZE // size)[:n].astype(np.uint64)
                    remote = np.stack([base + src * size, np.full(n, size, np.uint64)], axis=1)
                    local = np.stack([dst.ctypes.data + to * size, np.full(n, size, np.uint64)],
                                     axis=1)
                    if state == "warm":
                        _call(pid, local, remote)
                    else:
                        scratch += 1
                    if state in ("cold, primed", "cold, remote primed"):
                        pages = (remote[:, :1] + np.arange(0, size, 4096, dtype=np.uint64)).ravel()
                        probe = np.stack([pages, np.full(pages.size, 8, np.uint64)], axis=1)
                        mine = np.stack([scratch.ctypes.data + 8 * np.arange(pages.size,
                                                                            dtype=np.uint64),
                                         np.full(pages.size, 8, np.uint64)], axis=1)
                        for i in range(0, pages.size, 1024):
                            _call(pid, mine[i:i + 1024], probe[i:i + 1024])
                    if state in ("cold, primed", "cold, local primed"):
                        int(sum(int(dst[int(a - dst.ctypes.data):int(a - dst.ctypes.data)
                                        + size].sum()) for a, _ in local))
                    parts = np.array_split(np.arange(n), k)
                    t = time.perf_counter()
                    if k == 1:
                        assert _call(pid, local, remote)[0] == n * size
                    else:
                        futs = [pools[k].submit(_call, pid, local[p[0]:p[-1] + 1],
                                                remote[p[0]:p[-1] + 1]) for p in parts]
                        assert sum(f.result()[0] for f in futs) == n * size
                    times.append(time.perf_counter() - t)
                row = {"rows": n, "row_bytes": size, "state": state, "threads": k,
                       "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                       "gbps": n * size / statistics.median(times) / 1e9}
                print(row, flush=True)
                rows.append(row)
    done.set()
    child.join()
    write(f"cma-threads-exp-{time.strftime('%Y%m%dT%H%M', time.gmtime())}.json",
          "process_vm_readv of cold or warm rows, one thread against a pool of K", rows)


if __name__ == "__main__":
    main()
