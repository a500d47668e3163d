"""Experiment: what one ``publish`` costs the prefill's own thread, and how soon a same-host
decode rank hears of it (CPU, no GPU).

A streaming prefill calls ``server.publish`` after each layer, in its forward pass; a same-host
decode rank sleeps on the rank's publish board until the count moves. Until the thirteenth
session ``publish`` renewed the lease before it wrote the board, and the board's ``set`` hashed the
request id and wrote its words through numpy scalars on every call. Timed here, per source tree:

- ``publish_hot_us``: median ``publish`` of 32-layer streaming requests, calls back to back;
- ``publish_cold_us``: the same, each call after 30 ms of sleep (as a prefill whose layer
  compute ran on another device, or a host thread that just woke: this machine's first
  instructions after a sleep run several times slower);
- ``news_us``: from just before ``publish`` to the return of a decode-side ``BoardView.wait`` in
  another process that slept on the board (the same 30 ms before each publish);
- with ``--tail``: ``bench/experiments/stream_tail_cpu.py`` of the same tree right after
  (the full streamed read: news, the READ, the notification), its 16-block rows.

Each tree runs in its own child processes, alternately, three rounds, so both see the same
machine; the better (lower) round of each figure is kept, and every round is in the JSON:

    python bench/experiments/publish_path.py --tree before=PATH --tree after=. [--tail]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROUNDS = 3
CALLS = 200


def _board_waiter(name: str, salt: bytes, conn) -> None:
    from fkv.connector.transport._board import BoardView

    view = BoardView(name, salt)
    while conn.recv() is not None:
        seq = view.sequence()  # after the parent's last hold: only its publish moves it now
        conn.send(seq)
        while view.sequence() == seq:
            view.wait(seq, 0.1)
        conn.send(time.perf_counter())
    view.close()


def _child() -> dict:
    import fkv
    from fkv.connector import EngineDesc, serve

    spec = fkv.KVCacheSpec(layout="HND", num_blocks=1024, block_size=16, num_kv_heads=1,
                           head_size=8, dtype="float32", num_layers=32)
    engine = EngineDesc(engine_id="P", tp_size=1, tp_rank=0, total_num_kv_heads=1, model="m")
    out: dict = {}
    with serve(engine, spec, fkv.allocate(spec, "cpu"), lease=600.0) as server:
        for label, pause in (("publish_hot_us", 0.0), ("publish_cold_us", 0.03)):
            times = []
            for i in range(CALLS // 8):
                rid = f"{label}-{i}"
                server.hold(rid, [1], layers_ready=0)
                for layer in range(1, 9):
                    if pause:
                        time.sleep(pause)
                    t = time.perf_counter()
                    server.publish(rid, layer)
                    times.append(time.perf_counter() - t)
            out[label] = 1e6 * statistics.median(times)
        board = server._board
        a, b = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(target=_board_waiter,
                                               args=(board.name, board.salt, b), daemon=True)
        proc.start()
        news = []
        for i in range(CALLS // 8):
            rid = f"news-{i}"
            server.hold(rid, [1], layers_ready=0)
            for layer in range(1, 9):
                a.send(True)
                a.recv()          # the waiter read the sequence and now sleeps on it
                time.sleep(0.03)
                t = time.perf_counter()
                server.publish(rid, layer)
                news.append(a.recv() - t)
        a.send(None)
        proc.join(timeout=10)
        out["news_us"] = 1e6 * statistics.median(news)
        out["news_p90_us"] = 1e6 * statistics.quantiles(news, n=10)[8]
    return out


def _path(tree: str) -> str:
    """PYTHONPATH with ``tree`` first (what else is on it, e.g. installed wheels, after)."""
    rest = os.environ.get("PYTHONPATH", "")
    return os.path.abspath(tree) + (os.pathsep + rest if rest else "")


def _tail(path: str) -> dict:
    """stream_tail_cpu.py of ``path``'s tree: its 16-block rows (tail, news, one layer)."""
    env = {**os.environ, "PYTHONPATH": _path(path), "OUT": os.environ.get("TMPDIR", "/tmp")}
    script = os.path.join(os.path.abspath(path), "bench", "experiments", "stream_tail_cpu.py")
    subprocess.run([sys.executable, script], env=env, check=True, capture_output=True)
    got = json.loads((pathlib.Path(env["OUT"]) / "stream-tail-cpu-exp.json").read_text())
    rows = [r for r in got["rows"] if r["blocks"] == 16 and r["variant"] == "ahead"]
    return {"tail_ms": [r["tail_ms"] for r in rows], "news_ms": [r["news_ms"] for r in rows],
            "one_layer_ms": [r["one_layer_ms"] for r in rows]}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child()))
        return
    args = sys.argv[1:]
    tail = "--tail" in args
    trees = [args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--tree"]
    if not trees:
        raise SystemExit(__doc__)
    runs: dict[str, list] = {label: [] for label, _ in trees}
    for _ in range(ROUNDS):  # alternate the trees: the same machine state for both
        for label, path in trees:
            env = {**os.environ, "PYTHONPATH": _path(path)}
            got = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                                 capture_output=True, text=True).stdout
            run = json.loads(got.strip().splitlines()[-1])
            if tail:
                run["stream_tail_16_blocks"] = _tail(path)
            runs[label].append(run)
            print(label, run, flush=True)
    rows = []
    for label, reps in runs.items():
        row = {"tree": label}
        for key in ("publish_hot_us", "publish_cold_us", "news_us", "news_p90_us"):
            row[key] = min(r[key] for r in reps)
        if tail:
            row["stream_tail_16_blocks_ms"] = sorted(t for r in reps
                                                     for t in r["stream_tail_16_blocks"]["tail_ms"])
        rows.append(row)
        print(row, flush=True)
    out = pathlib.Path(os.environ.get("OUT", "/tmp")) / "publish-path-exp.json"
    out.write_text(json.dumps({"experiment": "publish's cost and a same-host reader's news (CPU)",
                               "cpus": os.cpu_count(), "trees": [t[0] for t in trees],
                               "rows": rows, "rounds": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
