"""Experiment: where a streamed read's last microseconds go, from its last layer landed to the
call's return, on the CPU (DRAM caches, NIXL and the same-host copy between two processes).

A child process serves a 1024-block HND cache of ``LAYERS`` layers and, per request, holds it as
streaming and publishes a layer every ``GAP_MS``; this process reads it with
``read(..., stream=True)`` (P TP=1 -> D TP=1, ``BLOCKS`` blocks). Wrappers stamp
``time.perf_counter()`` at the entry and exit of the steps after the last layer (the stream's
end, the done notification, the result, the telemetry record) and at the return; each stage is
the median over the timed requests of the time from the previous stamp. A wrapper costs a
fraction of a microsecond hot.

    python bench/experiments/stream_return.py [BLOCKS] [LAYERS] > stream-return.json
    GAP_MS=0 ...     # every layer published at once: the read never waits
    NO_YIELD=1 ...   # the stream's spin without its sched_yield system call
    SPIN_ALL=1 ...   # spin through each layer's whole wait (no futex sleep)
    YIELD_EVERY=N .. # the spin's sched_yield on every N-th read of the boards only
    TWICE=1 ...      # call the result step three times in a row, each timed: the first
                     # cold, the others on what the first brought back into the caches
    WARM=1 ...       # between two reads of a spin, also run what follows the last layer
                     # without its effects (a ReadResult, the telemetry lock, the outbox's
                     # pread): are those steps slow because their code and data went cold?
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

GAP_MS = float(os.environ.get("GAP_MS", "5.0"))
REPS, WARMUP = 40, 5


def _spec(layers: int) -> Any:
    import fkv

    return fkv.KVCacheSpec(layout="HND", num_blocks=1024, block_size=16, num_kv_heads=8,
                           head_size=128, dtype="bfloat16", num_layers=layers)


def _prefill(conn: Any, blocks: int, layers: int) -> None:
    import fkv
    from fkv.connector import EngineDesc, serve

    spec = _spec(layers)
    caches = fkv.allocate(spec)
    for c in caches:
        c.zero_()
    with serve(EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=8), spec,
               caches, lease=60.0) as server:
        conn.send(server.address)
        while True:
            rid = conn.recv()
            if rid is None:
                break
            server.hold(rid, list(range(blocks)), layers_ready=0)
            conn.send("held")
            conn.recv()
            for layer in range(layers):
                time.sleep(GAP_MS / 1e3)
                server.publish(rid, layer + 1)


def main() -> None:
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    child = ctx.Process(target=_prefill, args=(b, blocks, layers), daemon=True)
    child.start()
    import fkv
    from fkv.connector import EngineDesc, connect
    from fkv.connector.transport._client import Client
    from fkv.connector.transport._link import Link
    from fkv.telemetry import Telemetry

    stamps: list[tuple[str, float]] = []

    def stamp(owner: Any, attr: str, enter: bool = True) -> None:
        fn = getattr(owner, attr)

        def wrapped(*args: Any, **kw: Any) -> Any:
            if enter:
                stamps.append((f"{attr} in", time.perf_counter()))
            try:
                return fn(*args, **kw)
            finally:
                stamps.append((f"{attr} out", time.perf_counter()))
        setattr(owner, attr, wrapped)

    if os.environ.get("NO_YIELD") == "1":  # spin without the sched_yield system call
        from fkv.connector.transport import _stream
        _stream._yield = lambda: None
    if os.environ.get("SPIN_ALL") == "1":  # spin through the whole wait for each layer
        from fkv.connector.transport import _stream
        _stream.SPIN_AHEAD_FRACTION, _stream.SPIN_AHEAD_MAX = 1.0, 0.05
    warm_state: dict[str, Any] = {}

    def warm() -> None:
        from fkv.connector.transport._base import ReadResult

        os.sched_yield()
        client_ = warm_state.get("client")
        if client_ is None:
            return
        ReadResult(True, "w", 0, 0, 0.0, None, 0.0, "direct", 0.0, ())
        with client_.telemetry._lock:
            pass
        for box in client_._state.link.outboxes.values():
            if box._fd is not None:
                os.pread(box._fd, 16, 0)
        time.perf_counter()

    every = int(os.environ.get("YIELD_EVERY", "0"))
    if every > 1:
        from fkv.connector.transport import _stream
        count = [0]

        def some_yields() -> None:
            count[0] += 1
            if count[0] % every == 0:
                os.sched_yield()
        _stream._yield = some_yields
    if os.environ.get("WARM") == "1":
        from fkv.connector.transport import _stream
        _stream._yield = warm
    repeats: list[tuple[float, float, float]] = []
    if os.environ.get("TWICE") == "1":
        result_once = Client._result

        def result_thrice(self: Any, *args: Any, **kw: Any) -> Any:
            t = [time.perf_counter()]
            for _ in range(3):
                out = result_once(self, *args, **kw)
                t.append(time.perf_counter())
            repeats.append(tuple((t[i + 1] - t[i]) * 1e6 for i in range(3)))
            return out
        Client._result = result_thrice
    stamp(Client, "_stream", enter=False)
    stamp(Link, "notify")
    stamp(Client, "_result")
    stamp(Telemetry, "record_read")
    spec = _spec(layers)
    caches = fkv.allocate(spec)
    rows: dict[str, list[float]] = {}
    with connect(EngineDesc(engine_id="d", tp_size=1, tp_rank=0, total_num_kv_heads=8), spec,
                 caches, remote_address=a.recv(), timeout=30.0) as client:
        warm_state["client"] = client
        for rep in range(REPS + WARMUP):
            rid = f"r{rep}"
            a.send(rid)
            a.recv()
            stamps.clear()
            a.send("go")
            t0 = time.perf_counter()
            r = client.read(rid, list(range(blocks)), list(range(blocks)), stream=True,
                            timeout=30.0)
            end = time.perf_counter()
            if not r.ok:
                raise RuntimeError(r.error)
            if rep < WARMUP:
                continue
            prev = t0 + r.layer_seconds[-1]
            for name, t in [*stamps, ("return", end)]:
                rows.setdefault(name, []).append((t - prev) * 1e6)
                prev = t
        path = r.strategy
        a.send(None)
    child.join(10)
    print(json.dumps({"experiment": "stream_return", "blocks": blocks, "layers": layers,
                      "gap_ms": GAP_MS, "reps": REPS,
                      "spin_yields": os.environ.get("NO_YIELD") != "1",
                      "spin_whole_wait": os.environ.get("SPIN_ALL") == "1",
                      "warm_while_spinning": os.environ.get("WARM") == "1",
                      "yield_every": every, "path": path,
                      "python": platform.python_version(), "cpu_count": os.cpu_count(),
                      "us_since_previous_stamp_median": {k: round(statistics.median(v), 2)
                                                         for k, v in rows.items()},
                      "result_calls_in_a_row_us_median": [
                          round(statistics.median(r[i] for r in repeats[WARMUP:]), 2)
                          for i in range(3)] if repeats else None,
                      "total_us_median": round(statistics.median(
                          sum(v[i] for v in rows.values()) for i in range(REPS)), 2)},
                     indent=1))


if __name__ == "__main__":
    main()
