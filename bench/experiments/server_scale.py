"""Experiment: what a prefill rank's server costs as it holds more requests and more decode
ranks wait on it (CPU, no GPU).

A prefill rank serving many requests at once holds each from its prefill until its decode ranks
read it; a streaming request calls ``publish`` once per layer, and each decode rank reading one
keeps a ``Status`` long poll parked on the rank. Until the twelfth session ``publish`` asked
``request_id in table.pending()`` three times (``pending()`` builds a set of every held id), the
server thread scanned every held request for an expired lease on each loop (every 2 ms when
idle), and it computed every parked poll's answer again on each loop. This times:

- ``publish_us``: median of one ``publish`` of a 32-layer streaming request (30 requests x 32
  layers) with 1, 1000 and 10000 requests held in the background; ``idle_cpu_pct``: CPU the
  process used over 2 s with nothing to do but hold them, in % of one core;
- ``parked_cpu_pct``: the same with 1 and 64 long polls parked (64 decode connections, each
  asking again as its 0.25 s wait ends, from another process), nothing published.

Each source tree runs in its own child process, alternately, so both see the same machine:

    python bench/experiments/server_scale.py --tree before=PATH --tree after=.   # JSON to $OUT
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import sys
import time

SIZES = (1, 1000, 10000)


PARKED = (1, 64)


def _pollers(address: str, n: int, stop_at: float) -> None:
    """n decode connections, each keeping one Status long poll parked on its own request."""
    from fkv.connector.transport import _side

    dealers = [_side.Dealer(None, address) for _ in range(n)]
    tokens = itertools.count(1)
    out = {}
    for i, d in enumerate(dealers):
        out[i] = next(tokens)
        d.send(_side.Status(token=out[i], request_id=f"s{i}", after=0, wait=0.25))
    while time.monotonic() < stop_at:
        for i, d in enumerate(dealers):
            if d.ready(out[i]) is not None:
                out[i] = next(tokens)
                d.send(_side.Status(token=out[i], request_id=f"s{i}", after=0, wait=0.25))
        time.sleep(0.001)
    for d in dealers:
        d.close()


def _parked(n: int) -> dict:
    import fkv
    from fkv.connector import EngineDesc, serve

    spec = fkv.KVCacheSpec(layout="HND", num_blocks=1024, block_size=16, num_kv_heads=1,
                           head_size=8, dtype="float32", num_layers=32)
    engine = EngineDesc(engine_id="P", tp_size=1, tp_rank=0, total_num_kv_heads=1, model="m")
    with serve(engine, spec, fkv.allocate(spec, "cpu"), lease=600.0) as server:
        for i in range(n):
            server.hold(f"s{i}", [i], layers_ready=0)
        stop = time.monotonic() + 6.0
        proc = mp.get_context("spawn").Process(target=_pollers, args=(server.address, n, stop))
        proc.start()
        time.sleep(3.0)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(2.0)
        cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        proc.join()
    return {"parked": n, "parked_cpu_pct": 100 * cpu}


def _child(sizes: tuple[int, ...]) -> dict:
    import fkv
    from fkv.connector import EngineDesc, serve

    spec = fkv.KVCacheSpec(layout="HND", num_blocks=65536, block_size=16, num_kv_heads=1,
                           head_size=8, dtype="float32", num_layers=32)
    engine = EngineDesc(engine_id="P", tp_size=1, tp_rank=0, total_num_kv_heads=1, model="m")
    rows = []
    with serve(engine, spec, fkv.allocate(spec, "cpu"), lease=600.0) as server:
        held = 0
        for n in sizes:
            while held < n:
                server.hold(f"bg{held}", [held % 65536], layers_ready=0)
                held += 1
            times = []
            for r in range(30):
                rid = f"x{n}-{r}"
                server.hold(rid, [1], layers_ready=0)
                for layer in range(1, 33):
                    t = time.perf_counter()
                    server.publish(rid, layer)
                    times.append(time.perf_counter() - t)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            time.sleep(2.0)
            cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
            rows.append({"held": n, "publish_us": 1e6 * statistics.median(times),
                         "publish_p90_us": 1e6 * statistics.quantiles(times, n=10)[8],
                         "idle_cpu_pct": 100 * cpu})
    return {"rows": rows, "parked": [_parked(n) for n in PARKED]}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(SIZES)))
        return
    trees = [a.split("=", 1) for a, flag in zip(sys.argv[2::2], sys.argv[1::2])
             if flag == "--tree"]
    if not trees:
        raise SystemExit(__doc__)
    runs: dict[str, list] = {label: [] for label, _ in trees}
    for _ in range(2):  # alternate the trees: the same machine state for both
        for label, path in trees:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
            out = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for label, reps in runs.items():  # the better of the two runs of each tree
        for i, n in enumerate(SIZES):
            rows.append({"tree": label, "held": n,
                         "publish_us": min(r["rows"][i]["publish_us"] for r in reps),
                         "publish_p90_us": min(r["rows"][i]["publish_p90_us"] for r in reps),
                         "idle_cpu_pct": min(r["rows"][i]["idle_cpu_pct"] for r in reps)})
            print(rows[-1], flush=True)
        for i, n in enumerate(PARKED):
            rows.append({"tree": label, "parked": n,
                         "parked_cpu_pct": min(r["parked"][i]["parked_cpu_pct"] for r in reps)})
            print(rows[-1], flush=True)
    out = pathlib.Path(os.environ.get("OUT", "/tmp")) / "server-scale-exp.json"
    out.write_text(json.dumps({"experiment": "a prefill server against the number of "
                                             "held requests and parked polls (CPU)",
                               "cpus": os.cpu_count(), "trees": [t[0] for t in trees],
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
