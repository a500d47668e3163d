"""Experiment: what the steps of a read's return cost on this host, each in a loop of 100000
calls (us per call, min of 5 loops): the clock reads the read and its timing make
(``time.perf_counter``, ``time.monotonic``), a ``pread``/``pwrite`` of the outbox's sizes on a file
in ``/dev/shm``, one ``getppid`` (a bare system call), and the ``ReadResult`` a read builds.
Prints the JSON (no paths in it).

    python bench/experiments/host_costs.py > host-costs.json
"""

from __future__ import annotations

import json
import os
import platform
import time
import timeit

from fkv.connector.transport._base import ReadResult


def per_call(fn, number: int = 100_000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    path = f"/dev/shm/fkv-host-costs-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 65600)
        record = bytes(40)
        rows = {
            "time.perf_counter": per_call(time.perf_counter),
            "time.monotonic": per_call(time.monotonic),
            "time.process_time": per_call(time.process_time, 20_000),
            "os.getppid": per_call(os.getppid),
            "os.pread 16 B (/dev/shm)": per_call(lambda: os.pread(fd, 16, 24)),
            "os.pwrite 42 B (/dev/shm)": per_call(lambda: os.pwrite(fd, record, 64)),
            "outbox put: pread + 2 pwrite": per_call(
                lambda: (os.pread(fd, 16, 24), os.pwrite(fd, record, 64),
                         os.pwrite(fd, record[:8], 16))),
            "ReadResult(...)": per_call(
                lambda: ReadResult(True, "r", 1, 2, 0.1, None, 0.1, "ipc", 0.0, (0.1,) * 32)),
        }
    finally:
        os.close(fd)
        os.unlink(path)
    clock = "/sys/devices/system/clocksource/clocksource0/current_clocksource"
    try:
        with open(clock) as f:
            source = f.read().strip()
    except OSError:
        source = None
    print(json.dumps({"experiment": "host_costs", "clocksource": source,
                      "python": platform.python_version(), "machine": platform.machine(),
                      "cpu_count": os.cpu_count(), "us_per_call": rows}, indent=1))


if __name__ == "__main__":
    main()
