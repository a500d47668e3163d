"""Experiment: is a small same-host copy of rows another process has just written faster on two
threads, and what does handing half of it to a thread cost?

A child process holds 256 MiB (the "prefill cache", on huge pages) and rewrites the rows of each
copy just before it (what a streamed read's last layer sees); this process copies them into a
buffer of its own (huge pages) with ``process_vm_readv``. Modes:

- ``one thread``: this thread copies every row (what ``SameHostCopy.copy`` does under 4 MiB);
- ``pool``: half the rows go to a ``ThreadPoolExecutor`` worker (sleeping until submitted), half
  are copied here, then the worker's future is awaited (``SameHostCopy.copy``'s split);
- ``spinning helper``: the worker does not sleep: it waits inside ``pthread_spin_lock`` (C, the
  GIL released) on a word this thread unlocks to hand it its half, and answers through a second
  word this thread spins on the same way; no futex wake on either side;
- ``spinning helper, copy only``: the same, the figure being from the first of the two copies'
  start to the last one's end (what two threads already running would take).

Median of 25 per case, microseconds.

    python bench/experiments/cma_split.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _holder import anonymous, holder  # noqa: E402
from _record import write  # noqa: E402

from fkv.connector.transport._cma import _call  # noqa: E402

SIZE, REPS, ROW = 256 << 20, 25, 16 << 10
CASES = (32, 64, 128)  # rows of 16 KiB: 0.5, 1 and 2 MiB


def _hold(conn) -> None:
    m, buf = anonymous(SIZE, True)
    conn.send((os.getpid(), buf.ctypes.data))
    while (msg := conn.recv()) is not None:
        for s in msg:
            buf[s * ROW:(s + 1) * ROW] += 1
        conn.send(True)
    del buf
    m.close()


class _Spinner:
    """A helper thread waiting in ``pthread_spin_lock`` for work (two glibc spinlock words used
    as flags: ``go`` handed over by unlocking it, ``done`` answered the same way)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None)
        self.lock, self.unlock = libc.pthread_spin_lock, libc.pthread_spin_unlock
        self.words = (ctypes.c_int * 32)()  # go at 0, done at 16: separate cache lines
        self.go = ctypes.byref(self.words, 0)
        self.done = ctypes.byref(self.words, 64)
        for word in (self.go, self.done):
            libc.pthread_spin_init(word, 0)  # glibc's x86-64 words: 1 unlocked, 0 or less held
            self.lock(word)
        self.job = None
        self.span = (0.0, 0.0)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.lock(self.go)  # spins in C until the owner unlocks it
            job = self.job
            if job is None:
                self.unlock(self.done)
                return
            t = time.perf_counter()
            _call(*job)
            self.span = (t, time.perf_counter())
            self.unlock(self.done)

    def hand(self, job) -> None:
        self.job = job
        self.unlock(self.go)

    def wait(self) -> None:
        self.lock(self.done)

    def close(self) -> None:
        self.hand(None)
        self.wait()
        self.thread.join()


def _mode(mode: str, n: int, conn, pid: int, base: int, dst: np.ndarray, pool, spinner,
          rng: np.random.Generator) -> dict:
    times, spans = [], []
    for _ in range(REPS):
        src = rng.permutation(SIZE // ROW)[:n]
        to = rng.permutation(SIZE // ROW)[:n]
        local = np.ascontiguousarray(np.stack([dst.ctypes.data + to * ROW, np.full(n, ROW)], 1),
                                     dtype=np.uint64)
        remote = np.ascontiguousarray(np.stack([base + src * ROW, np.full(n, ROW)], 1),
                                      dtype=np.uint64)
        conn.send(src.tolist())
        conn.recv()
        h = n // 2
        t = time.perf_counter()
        if mode == "one thread":
            assert _call(pid, local, remote)[0] == n * ROW
        elif mode == "pool":
            fut = pool.submit(_call, pid, local[h:], remote[h:])
            assert _call(pid, local[:h], remote[:h])[0] + fut.result()[0] == n * ROW
        else:
            spinner.hand((pid, local[h:], remote[h:]))
            t1 = time.perf_counter()
            _call(pid, local[:h], remote[:h])
            t2 = time.perf_counter()
            spinner.wait()
            s0, s1 = spinner.span
            spans.append(max(t2, s1) - min(t1, s0))
        times.append(time.perf_counter() - t)
        assert np.array_equal(dst[to[0] * ROW:to[0] * ROW + 64],
                              np.full(64, dst[to[0] * ROW], np.uint8))
    row = {"rows": n, "row_bytes": ROW, "mode": mode, "us": 1e6 * statistics.median(times),
           "us_p10_p90": [1e6 * q for q in statistics.quantiles(times, n=10)[::8]]}
    if spans:
        row["copy_only_us"] = 1e6 * statistics.median(spans)
    print(row, flush=True)
    return row


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    with holder(_hold, size=SIZE) as (conn, _, (pid, base)):
        mdst, dst = anonymous(SIZE, True)
        pool = cf.ThreadPoolExecutor(1)
        spinner = _Spinner()
        try:
            for n in CASES:
                for mode in ("one thread", "pool", "spinning helper"):
                    rows.append(_mode(mode, n, conn, pid, base, dst, pool, spinner, rng))
        finally:
            spinner.close()
            pool.shutdown()
            del dst
            mdst.close()
    write(f"cma-split-exp-{time.strftime('%Y%m%dT%H%M', time.gmtime())}.json",
          "a copy of just-written rows on one thread, split with a pool, or with a spinning helper",
          rows)


if __name__ == "__main__":
    main()
