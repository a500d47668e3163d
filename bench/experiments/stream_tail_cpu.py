"""Experiment: where a streamed read's tail goes on the CPU (DRAM, NIXL between two processes).

One prefill process (P TP=1) and one decode rank in this process (D TP=1), HND 8 x 128 bf16,
1024-block caches of 8 layers. Each request is held with 7 layers published; 30 ms later the
prefill publishes the last one while the decode's streamed read waits for it. The tail is
publish -> read returned; ``spans`` says, per step of the decode (the path's read, the READ's
creation and post, its wait, the notification, the result and its telemetry; inside them NIXL's
own calls and the notification's message), where it started
and how long it took after the last layer's news reached the decode; ``publish_call_ms`` is the
prefill's own ``publish`` call, and ``woke_*`` split the news at the return of the decode's
futex sleep. "one layer" is a non-streamed read of the same size / 8. ``--tree PATH`` is not an
option: run it under ``PYTHONPATH=PATH`` to time another tree's fkv.

``--paced``: the request is held with 4 layers published and the prefill publishes the other 4
one every 10 ms (a steady pace, which a reader on the board learns and spins ahead of); the tail
is still from the last publish.

Variants: ``ahead`` (the default: the awaited layer's READs are computed during the wait,
``PlanPath.layer_reads``) and ``at news`` (that step patched out: the READs are computed once the
layer's news arrived, as before).

    python bench/experiments/stream_tail_cpu.py        # JSON to $OUT (or /tmp)
    python bench/experiments/stream_tail_cpu.py --staging   # decode NHD: the staging path
    python bench/experiments/stream_tail_cpu.py --ahead-only   # the default variant only
    python bench/experiments/stream_tail_cpu.py --ahead-only --paced
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import threading
import time

HEADS = 8
LAYERS = 8
BLOCKS = 1024
STAGING = "--staging" in sys.argv
AHEAD_ONLY = "--ahead-only" in sys.argv  # two "ahead" rows per size, no "at news" rows
PACED = "--paced" in sys.argv  # 4 layers published at the hold, 4 more one every PACE_S
PACE_S = 0.01
# --spin-yield none|sleep0: what the reader does between two reads of a spin ahead (default: the
# library's, sched_yield)
SPIN_YIELD = sys.argv[sys.argv.index("--spin-yield") + 1] if "--spin-yield" in sys.argv else None


def _spec(layout: str = "HND"):
    import fkv

    return fkv.KVCacheSpec(layout=layout, num_blocks=BLOCKS, block_size=16, num_kv_heads=HEADS,
                           head_size=128, dtype="bfloat16", num_layers=LAYERS)


def _engine(name: str):
    from fkv.connector import EngineDesc

    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=HEADS, model="m")


def _prefill(conn) -> None:
    import fkv
    from fkv.connector import serve

    spec = _spec()
    with serve(_engine("P"), spec, fkv.allocate(spec, "cpu"), lease=600.0) as server:
        conn.send(server.address)
        cpu, last = [], None  # the process's CPU seconds from one hold to the next
        while (msg := conn.recv()) is not None:
            if msg[0] == "hold":
                now = time.process_time()
                if last is not None:
                    cpu.append(now - last)
                last = now
                server.hold(msg[1], msg[2], layers_ready=msg[3])
                conn.send(True)
            else:
                first = msg[2] - (LAYERS // 2 if PACED else 1) + 1
                for k in range(first, msg[2] + 1):
                    time.sleep(PACE_S if PACED else 0.03)  # the layer's compute
                    t = time.perf_counter()
                    server.publish(msg[1], k)
                conn.send((t, time.perf_counter() - t))
        conn.send(statistics.median(cpu) if cpu else None)


def _measure(client, conn, n: int, reps: int, tag: str) -> dict:
    import numpy as np

    from fkv.connector.transport import _agent, _link, _plan_path
    from fkv.connector.transport._stream import Watch

    rng = np.random.default_rng(n)
    heard: list[float] = []
    spins: list[bool] = []  # per news: heard while spinning ahead of the predicted publish
    spans: dict[str, list] = collections.defaultdict(list)
    saved = []

    def wrap(owner, name, label):
        f = getattr(owner, name)
        saved.append((owner, name, f))

        def timed(*a, **kw):
            spun = getattr(a[0], "spun_news", 0) if label == "news" else 0
            t = time.perf_counter()
            out = f(*a, **kw)
            spans[label].append((t, time.perf_counter()))
            if label == "news":
                heard.append(time.perf_counter())
                spins.append(getattr(a[0], "spun_news", 0) > spun)
            return out
        setattr(owner, name, timed)

    from fkv import telemetry
    from fkv.connector.transport import _board, _client

    wrap(Watch, "beyond", "news")
    wrap(_board, "_futex_wait", "futex wait")
    wrap(_client.Client, "_result", "result")
    wrap(telemetry.Telemetry, "record_read" if hasattr(telemetry.Telemetry, "record_read")
         else "record", "telemetry")  # an older tree records through record
    wrap(_plan_path.PlanPath, "read", "path read")
    wrap(_agent.Agent, "read", "READ create + post")
    wrap(_plan_path, "wait_reads", "READ wait")
    wrap(_link.Link, "notify", "notify")
    wrap(_link.Link, "notif", "notify: message built")
    try:  # trees with same-host outboxes: the notification written there instead of sent
        from fkv.connector.transport import _outbox

        wrap(_outbox.Outbox, "put", "notify: outbox write")
    except ImportError:
        pass
    # NIXL's own calls inside the steps above
    from fkv.connector.transport._base import load_nixl

    nixl_agent = load_nixl().nixl_agent
    wrap(nixl_agent, "make_prepped_xfer", "READ create (NIXL)")
    wrap(nixl_agent, "transfer", "READ post (NIXL)")
    wrap(nixl_agent, "send_notif", "notify: send (NIXL)")
    wrap(nixl_agent, "get_new_notifs", "notify: progress (NIXL)")
    wrap(_plan_path.PlanPath, "_run_staging", "staging move")
    tails, news, pubs, wakes, steps = [], [], [], [], collections.defaultdict(list)
    last_spun: list[bool] = []
    try:
        for i in range(reps + 5):
            local = rng.permutation(BLOCKS)[:n].tolist()
            remote = rng.permutation(BLOCKS)[:n].tolist()
            rid = f"{tag}-{n}-{i}"
            conn.send(("hold", rid, remote, LAYERS // 2 if PACED else LAYERS - 1))
            conn.recv()
            box: dict = {}

            def run(rid=rid, local=local, remote=remote, box=box):
                box["r"] = client.read(rid, local, remote, stream=True)
                box["end"] = time.perf_counter()

            th = threading.Thread(target=run)
            th.start()
            conn.send(("pub", rid, LAYERS))
            published, publish_s = conn.recv()
            th.join()
            assert box["r"].ok, box["r"].error
            if i >= 5:
                tails.append(1e3 * (box["end"] - published))
                news.append(1e3 * (heard[-1] - published))
                last_spun.append(spins[-1])
                pubs.append(1e3 * publish_s)
                woke = [b for a, b in spans["futex wait"] if b <= heard[-1]]
                if woke:  # when the last sleep before the news ended, after the publish began
                    wakes.append((1e3 * (woke[-1] - published), 1e3 * (heard[-1] - woke[-1])))
                for label, v in spans.items():
                    after = [(a, b) for a, b in v if a >= heard[-1]]
                    if label not in ("news", "futex wait") and after:
                        steps[label].append((1e3 * (after[0][0] - heard[-1]),
                                             1e3 * sum(b - a for a, b in after)))
            spans.clear()
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    one = []
    for i in range(reps):
        local = rng.permutation(BLOCKS)[:n].tolist()
        remote = rng.permutation(BLOCKS)[:n].tolist()
        rid = f"{tag}-{n}-whole-{i}"
        conn.send(("hold", rid, remote, None))
        conn.recv()
        t = time.perf_counter()
        assert client.read(rid, local, remote).ok
        one.append(1e3 * (time.perf_counter() - t) / LAYERS)
    med = statistics.median
    watch = getattr(client._state, "_watch", None)  # noqa: SLF001 - an experiment's look inside
    return {"spun_news": getattr(watch, "spun_news", None),  # news heard spinning ahead, so far
            "variant": tag, "blocks": n, "reps": reps, "tail_ms": med(tails),
            "tail_p10_p90_ms": statistics.quantiles(tails, n=10)[::8],
            "news_ms": med(news), "publish_call_ms": med(pubs),
            # the last layer's news heard spinning ahead: how often, and the news then / else
            "last_news_spun": sum(last_spun),
            "news_spun_ms": med(x for x, s in zip(news, last_spun, strict=True) if s)
            if any(last_spun) else None,
            "news_slept_ms": med(x for x, s in zip(news, last_spun, strict=True) if not s)
            if not all(last_spun) else None,
            # the decode's last futex sleep before the news: it returned this long after the
            # publish began, then this long before the news (None: the news came without a sleep)
            "woke_after_publish_ms": med(w[0] for w in wakes) if wakes else None,
            "woke_to_news_ms": med(w[1] for w in wakes) if wakes else None,
            "one_layer_ms": med(one),
            "tail_over_layer_x": med(tails) / med(one),
            "after_news_ms": {k: {"starts": med(x[0] for x in v), "takes": med(x[1] for x in v)}
                              for k, v in steps.items()}}


def main() -> None:
    import fkv
    from fkv.connector import connect
    from fkv.connector.transport import _plan_path

    if SPIN_YIELD is not None:
        from fkv.connector.transport import _stream

        _stream._yield = {"none": lambda: None, "sleep0": lambda: time.sleep(0)}[SPIN_YIELD]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(b,), daemon=True)
    proc.start()
    address = a.recv()
    # --staging: the decode cache in NHD against the prefill's HND (the plan's staging path)
    spec = _spec("NHD" if STAGING else "HND")
    client = connect(_engine("D"), spec, fkv.allocate(spec, "cpu"), remote_address=address)
    rows = []
    strategy = client.plan.strategy
    ahead = _plan_path.PlanPath.layer_reads
    try:
        for n in (16, 256):
            for tag in ("ahead",) * 2 if STAGING or AHEAD_ONLY else ("ahead", "at news",
                                                                       "ahead", "at news"):
                _plan_path.PlanPath.layer_reads = ahead if tag == "ahead" else (
                    lambda self, rows, layer: None)
                rows.append(_measure(client, a, n, 30, tag))
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()
                       if k != "after_news_ms"}, flush=True)
    finally:
        _plan_path.PlanPath.layer_reads = ahead
        a.send(None)
        prefill_cpu = a.recv()
        client.close()
    name = "stream-tail-cpu-staging-exp.json" if STAGING else "stream-tail-cpu-exp.json"
    if PACED:
        name = name.replace("-exp", "-paced-exp")
    if SPIN_YIELD is not None:
        name = name.replace("-exp", f"-{SPIN_YIELD}-exp")
    out = pathlib.Path(os.environ.get("OUT", "/tmp")) / name
    out.write_text(json.dumps({"experiment": "streamed read tail on the CPU: READs computed ahead",
                               "strategy": strategy, "paced": PACED,
                               "spin_yield": SPIN_YIELD or "sched_yield",
                               "cpus": os.cpu_count(), "rows": rows,
                               # the prefill process (all its threads), one request to the next,
                               # median over every request of the run (streamed and whole)
                               "prefill_cpu_ms_per_request": 1e3 * prefill_cpu}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
