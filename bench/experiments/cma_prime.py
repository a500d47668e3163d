"""Experiment: what priming a same-host copy buys, and what it costs (``SameHostCopy.prime``).

A child process holds 512 MiB (the "prefill cache"); this process copies N random rows of it
into a 512 MiB cache of its own with ``SameHostCopy.copy`` (``process_vm_readv``), after 512 MiB
of another buffer were written (cold caches). ``primed``: ``SameHostCopy.prime`` on the same
vectors first (untimed in the copy's figure, timed on its own: ``prime_ms``); ``primed, 2 ms
spin``: then 2 ms of ``sched_yield`` in a loop (what a streamed read does between its prime and
the layer's publish) before the copy; ``warm``: the same rows copied once before. Median of 15.

    python bench/experiments/cma_prime.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _holder import holder  # noqa: E402
from _record import write  # noqa: E402

from fkv.connector.transport._cma import SameHostCopy  # noqa: E402

SIZE, REPS = 512 << 20, 15
CASES = [(32, 16 << 10), (32, 32 << 10), (128, 16 << 10)]  # (rows, row bytes)


def _hold(conn) -> None:
    buf = np.ones(SIZE, dtype=np.uint8)
    conn.send((os.getpid(), buf.ctypes.data))
    conn.recv()


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    with holder(_hold, size=SIZE) as (_, peer, _hello):
        dst = np.ones(SIZE, dtype=np.uint8)
        scratch = np.ones(SIZE, dtype=np.uint8)
        copier = SameHostCopy([(dst.ctypes.data, SIZE)], None, {0: peer}, "exp")
        try:
            for n, size in CASES:
                for state in ("cold", "primed", "primed, 2 ms spin", "warm"):
                    times, primes = [], []
                    for _ in range(REPS):
                        src = rng.permutation(SIZE // size)[:n]
                        to = rng.permutation(SIZE // size)[:n]
                        plan = np.zeros((n, 6), dtype=np.int64)  # plan rows: rank, region, offset..
                        plan[:, 2], plan[:, 4], plan[:, 5] = src * size, to * size, size
                        local, remote, nbytes = copier.vectors(0, plan)
                        scratch += 1
                        if state == "warm":
                            copier.copy(0, local, remote, nbytes, float("inf"))
                        if state.startswith("primed"):
                            t = time.perf_counter()
                            assert copier.prime(0, local, remote, nbytes)
                            primes.append(time.perf_counter() - t)
                            if "spin" in state:
                                end = time.perf_counter() + 0.002
                                while time.perf_counter() < end:
                                    os.sched_yield()
                        t = time.perf_counter()
                        copier.copy(0, local, remote, nbytes, float("inf"))
                        times.append(time.perf_counter() - t)
                    row = {"rows": n, "row_bytes": size, "state": state,
                           "copy_ms": 1e3 * statistics.median(times),
                           "prime_ms": 1e3 * statistics.median(primes) if primes else None}
                    print(row, flush=True)
                    rows.append(row)
        finally:
            copier.close()
    write(f"cma-prime-exp-{time.strftime('%Y%m%dT%H%M', time.gmtime())}.json",
          "SameHostCopy.copy of cold rows, primed (SameHostCopy.prime) or not", rows)


if __name__ == "__main__":
    main()
