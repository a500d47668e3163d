"""Experiment: what a read's last steps cost after its copy (the outbox notification, the
``ReadResult``, the telemetry record), against the same steps after other work.

A child process holds 256 MiB (the "prefill cache"); this process holds a cache of its own, an
outbox and a client telemetry recorder. Each repetition first spins 2 ms on ``sched_yield`` (a
streamed read's wait), then, by state: nothing (``spin``); a copy of 32 rows of 16 KiB the child
has just rewritten (``just written copy``: a streamed read's last layer); a copy of rows copied
once before (``warm copy``); a 10 ms sleep (``sleep``). Then the three steps, each timed. Median of
35 (the first 5 of each state dropped).

    python bench/experiments/post_copy.py      # JSON to $OUT (or /tmp)
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

from fkv.connector.transport._base import ReadResult, Tally  # noqa: E402
from fkv.connector.transport._cma import SameHostCopy  # noqa: E402
from fkv.connector.transport._outbox import Outbox  # noqa: E402
from fkv.telemetry import Telemetry  # noqa: E402

SIZE, ROWS, ROW = 256 << 20, 32, 16 << 10
STATES = ("spin", "just written copy", "warm copy", "sleep")


def _hold(conn) -> None:
    buf = np.ones(SIZE, dtype=np.uint8)
    conn.send((os.getpid(), buf.ctypes.data))
    while (msg := conn.recv()) is not None:
        for s in msg:
            buf[s * ROW:(s + 1) * ROW] += 1
        conn.send(True)


def _state(state: str, conn, copier, box, telemetry, rng) -> dict:
    message = b"fkv1|request-000123|decode-engine|0|done"
    steps: dict[str, list[float]] = {"notify": [], "result": [], "record": [], "all": []}
    for i in range(40):
        src = rng.permutation(SIZE // ROW)[:ROWS]
        plan = np.zeros((ROWS, 6), dtype=np.int64)
        plan[:, 2] = src * ROW
        plan[:, 4] = rng.permutation(SIZE // ROW)[:ROWS] * ROW
        plan[:, 5] = ROW
        local, remote, nbytes = copier.vectors(0, plan)
        if state == "warm copy":
            copier.copy(0, local, remote, nbytes, float("inf"))
        if state == "just written copy":
            conn.send(src.tolist())
            conn.recv()
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            os.sched_yield()
        if state == "sleep":
            time.sleep(0.01)
        if "copy" in state:
            copier.copy(0, local, remote, nbytes, float("inf"))
        t0 = time.perf_counter()
        box.put(message)
        t1 = time.perf_counter()
        tally = Tally()
        result = ReadResult(True, "request-000123", nbytes, ROWS, t1 - t0, None, 0.0,
                            "direct", 0.0, (t1 - t0,) * 8)
        t2 = time.perf_counter()
        telemetry.record_read("direct", result.seconds, result.bytes, result.descriptors,
                              (("transfer", tally.transfer_seconds), ("pack", 0.0)))
        t3 = time.perf_counter()
        if i >= 5:
            for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                steps[k].append(1e6 * v)
        os.pwrite(box._fd, box._written.to_bytes(8, "little"), 24)  # the reader's count
    row = {"state": state, **{f"{k}_us": statistics.median(v) for k, v in steps.items()}}
    print(row, flush=True)
    return row


def main() -> None:
    rows = []
    with holder(_hold, size=SIZE) as (conn, peer, _):
        dst = np.ones(SIZE, dtype=np.uint8)
        copier = SameHostCopy([(dst.ctypes.data, SIZE)], None, {0: peer}, "exp")
        box, telemetry = Outbox(), Telemetry("client", "exp")
        rng = np.random.default_rng(0)
        try:
            for state in STATES:
                rows.append(_state(state, conn, copier, box, telemetry, rng))
        finally:
            box.close()
            copier.close()
    write(f"post-copy-exp-{time.strftime('%Y%m%dT%H%M', time.gmtime())}.json",
          "a read's last steps after its copy, against after other work", rows)


if __name__ == "__main__":
    main()
