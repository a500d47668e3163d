"""Experiment: does launching one device-launchable CUDA graph make every graph of the process
replay its kernel nodes faster?

``graph_state.py``'s compare run (``raw/graph-state-20261204T1935/graph-compare-exp.json``):
graphs instantiated as torch does replayed 32 decode writes at 2.49 us per call the first time they
were timed, and at 2.13-2.17 every time after a graph instantiated for device launch (flag 4) had
been launched in between; their empty kernel nodes cost 0.95 us, where every other run's cost
1.28-1.30. This times the same torch graphs before and after such a "priming" launch.

Each mode is a fresh process: 256-token decode writes (library default and engine-style, bf16 NHD,
32 rotating input sets, do_bench's dirty 256 MB flush before each replay), an empty kernel of the
same grid and 32 torch ``add_`` calls on 1 MiB, each captured in one graph by torch
(``capture_graph``). Round ``before``: each graph timed three times. Then the mode's priming step;
round ``after``: the same graphs again; round ``new``: the same calls captured again, timed; round
``later``: after 5 s idle. Modes:

- ``launch``: a one-kernel graph instantiated for device launch, uploaded and launched once;
- ``upload``: the same, uploaded but never launched;
- ``instantiate``: the same, only instantiated;
- ``none``: no priming step (the control);
- ``first``: the priming launch before anything is captured (as an engine would at start-up);
  its ``before`` round is already primed;
- ``replay-empty`` / ``replay-write``: as ``graph_state.py``'s compare run did it: a 32-node
  device-launch graph of the empty kernel / of the write calls, timed like the others (110
  replays, each after the flush) as the priming step.

    python bench/experiments/graph_prime.py   # GPU; JSON to $OUT
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve()
MODES = ("none", "launch", "upload", "instantiate", "first")


def _prime(how: str) -> object:
    import torch

    from graph_state import _RawGraph

    x = torch.zeros(1, device="cuda")
    flags = 4 if how != "none" else 1
    g = _RawGraph([lambda: x.add_(1)], flags)  # flag 4: uploaded in _RawGraph
    if how in ("launch", "first"):
        g.replay()
        torch.cuda.synchronize()
    return g


def child(mode: str) -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    sys.path.insert(0, str(HERE.parents[1]))
    sys.path.insert(0, str(HERE.parent))
    import torch
    from graph_state import _per_call_us, decode_calls

    from fkv.bench._common import capture_graph

    keep = []
    if mode == "first":
        keep.append(_prime("first"))
    buf, calls = decode_calls(("default", "engine-style", "empty"))
    small = torch.zeros(1 << 18, device="cuda")
    calls["torch add"] = [lambda: small.add_(1)] * len(calls["default"])
    calls["torch add"][0]()
    torch.cuda.synchronize()
    graphs = {n: capture_graph(c) for n, c in calls.items()}
    rows = []

    def timed(round_name: str, which: dict) -> None:
        for n, g in which.items():
            us = [_per_call_us(g.replay, len(calls[n]), buf) for _ in range(3)]
            rows.append({"mode": mode, "round": round_name, "variant": n, "us": us})

    timed("before", graphs)
    if mode.startswith("replay-"):
        from graph_state import _RawGraph

        name = "empty" if mode == "replay-empty" else "default"
        primer = _RawGraph(calls[name], 4)
        keep.append(primer)
        rows.append({"mode": mode, "round": "primer", "variant": f"{name} (device launch)",
                     "us": [_per_call_us(primer.replay, len(calls[name]), buf)]})
    elif mode not in ("none", "first"):
        keep.append(_prime(mode))
    timed("after", graphs)
    timed("new", {n: capture_graph(c) for n, c in calls.items()})
    time.sleep(5)
    timed("later", graphs)
    for row in rows:
        print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    sys.path.insert(0, str(HERE.parent))
    import _record
    from graph_state import child_rows

    rows = []
    for mode in os.environ.get("GRAPH_PRIME_MODES", ",".join(MODES)).split(","):
        found = child_rows(HERE, mode)
        if isinstance(found, str):
            rows.append({"mode": mode, "error": found})
            continue
        for row in found:
            rows.append(row)
            print(f"{mode:12s} {row['round']:6s} {row['variant']:12s} "
                  + " ".join(f"{u:4.2f}" for u in row["us"]), flush=True)
    _record.write("graph-prime-exp.json", "graph_prime", rows)


if __name__ == "__main__":
    main()
