"""Experiment: what makes some CUDA graphs replay their kernel nodes ~0.35 us faster for their
whole life?

The tenth session found (``write_decode_state.py``) that the first two graphs one process
captured replayed 32 decode writes at 2.10 us per call and every later graph at 2.45-2.47, the
clocks unchanged, while ``write_decode_first_graph.py``'s fresh processes found all three of
their graphs slow. The trigger was not found. Issue 14's engine figure (2.18 us bf16 NHD) looks
like a fast graph; the library's steady figure (2.50) is a slow one.

Each mode runs in a fresh process: it compiles a 256-token bf16 NHD ``write_kv`` decode (the
library default, 32 rotating input sets, a 32768-block cache) and an empty kernel of the same
grid, captures six graphs (write, empty, write, empty, write, empty) of 32 calls each, then
times every graph three times over, interleaved (median of 100 replays, do_bench's dirty 256 MB
flush before each replay). Modes:

- ``plain``: ``torch.cuda.graph`` as engines use it;
- ``sleep``: 3 s idle between the compile and the captures (``write_decode_state.py``'s order);
- ``conn1`` / ``conn32``: ``CUDA_DEVICE_MAX_CONNECTIONS`` 1 / 32;
- ``eager``: ``CUDA_MODULE_LOADING=EAGER``;
- ``flags0`` / ``flags1`` / ``upload`` / ``prio`` / ``device``: the captured graph (kept) is
  instantiated here through the CUDA driver with flags 0, 1 (auto-free on launch), 1|2
  (instantiate-and-upload), 1|8 (node priority; captured on a high-priority stream) or 4 (device
  launch, uploaded before the first launch), and launched with ``cuGraphLaunch``;
- ``hiprio``: torch's graphs, replayed on a high-priority stream;
- ``state``: ``write_decode_state.py``'s set-up and order (write and contiguous-copy graphs);
- ``compare-<dtype>-<layout>``: the library default, the engine-style kernel, the contiguous copy
  and the empty kernel, each captured twice, once instantiated as torch does (flags 1) and once
  for device launch (flags 4), the two alternating (``GRAPH_STATE_MODES=compare`` runs the four
  dtype and layout pairs);
- ``mix-*``: which part of the compare run's set-up gives its fast state (``mix``'s docstring);
  ``GRAPH_STATE_MODES=mix`` runs them all, with ``mix-engine`` (``engine``'s docstring).
- ``recipe-<dtype>-<layout>`` / ``control-<dtype>-<layout>``: the library default and the
  engine-style kernel in torch's graphs (``capture_graph``), with (``recipe``) or without a
  one-node device-launch graph (an ``add_``) instantiated before their capture and launched once
  after it, never timed (``recipe``'s docstring); ``recipe-engine`` / ``control-engine``: 40
  torch graphs of the library's bf16 NHD writes on one shared pool, as an engine captures, with
  and without it. ``GRAPH_STATE_MODES=recipe`` runs all ten, control before recipe;
  ``helper-*``: ``control-*`` captured inside ``fkv.ops.graph_primer()`` (the same recipe as the
  library ships it); ``late-*``: ``helper-*`` after two graphs were captured and dropped
  (``settle_graphs``); ``percase-<dtype>-<layout>``: ``percase``'s docstring.

    python bench/experiments/graph_state.py   # GPU; JSON to $OUT
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
MODES = ("plain", "sleep", "conn1", "conn32", "eager", "flags0", "flags1", "upload", "prio",
         "device", "hiprio", "state")
ENV = {"conn1": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
       "conn32": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"},
       "eager": {"CUDA_MODULE_LOADING": "EAGER"}}
FLAGS = {"flags0": 0, "flags1": 1, "upload": 1 | 2, "prio": 1 | 8, "device": 4}


def _cuda():
    """The CUDA driver library (torch's runtime made the primary context current; runtime
    graph and stream handles are the driver's)."""
    return ctypes.CDLL("libcuda.so.1")


class _RawGraph:
    """A graph captured by torch (kept), instantiated and launched here with ``flags``."""

    def __init__(self, calls, flags: int, stream_priority: int = 0):
        import torch

        self.rt = _cuda()
        self.rt.cuGraphInstantiateWithFlags.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                          ctypes.c_ulonglong]
        self.rt.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.rt.cuGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        stream = torch.cuda.Stream(priority=stream_priority)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls[0]()
        torch.cuda.synchronize()
        self.torch_graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(self.torch_graph, stream=stream):
            for call in calls:
                call()
        torch.cuda.synchronize()
        exe = ctypes.c_void_p()
        rc = self.rt.cuGraphInstantiateWithFlags(ctypes.byref(exe),
                                                   self.torch_graph.raw_cuda_graph(), flags)
        if rc:
            raise RuntimeError(f"cuGraphInstantiateWithFlags({flags}) returned {rc}")
        self.exe = exe
        if flags & 4:
            rc = self.rt.cuGraphUpload(self.exe, torch.cuda.current_stream().cuda_stream)
            if rc:
                raise RuntimeError(f"cuGraphUpload returned {rc}")
            torch.cuda.synchronize()

    def replay(self):
        import torch

        rc = self.rt.cuGraphLaunch(self.exe, torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"cuGraphLaunch returned {rc}")


def _per_call_us(replay, ncalls: int, buf, rep: int = 100) -> float:
    import torch

    times = []
    for _ in range(rep + 10):
        buf.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times[10:]) * 1e3 / ncalls


def decode_calls(names, dtype: str = "bfloat16", layout: str = "NHD"):
    """do_bench's 256 MB flush buffer and, per variant of ``write_decode_probe`` in ``names``,
    its 32 decode-write calls over rotating inputs (a 32768-block cache), each variant run once
    (compiled)."""
    sys.path.insert(0, str(HERE.parents[2]))
    sys.path.insert(0, str(HERE.parents[1]))
    sys.path.insert(0, str(HERE.parent))
    import torch
    import gpu_kernels_sweep as sweep
    import write_decode_probe as probe

    import fkv
    from fkv.bench.write import Shape, _inputs, _slot_sets

    buf = torch.empty((256 << 20) // 4, dtype=torch.int32, device="cuda")
    shape = Shape()
    spec = fkv.KVCacheSpec(layout=layout, num_blocks=shape.num_blocks,
                           block_size=shape.block_size, num_kv_heads=shape.heads,
                           head_size=shape.head_size, dtype=dtype)
    cache = sweep.fkv_alloc(spec, "cuda")
    out = torch.empty(2 * probe.TOKENS * spec.num_kv_heads * spec.head_size,
                      dtype=torch.bfloat16, device="cuda")
    kv = _inputs(spec, probe.TOKENS, probe.SETS, "cuda", seed=1)
    slots = _slot_sets("decode", probe.TOKENS, shape, probe.SETS, "cuda", seed=2)
    variants = probe._variants(spec, cache, sweep._scales(spec, "cuda"), out)
    calls = {n: [variants[n](k, v, s) for (k, v), s in zip(kv, slots)] for n in names}
    for c in calls.values():
        c[0]()
    torch.cuda.synchronize()
    return buf, calls


def compare(mode: str) -> None:
    """The four kernels in both kinds of graph (module docstring)."""
    _, dtype, layout = mode.split("-")
    names = ("default", "engine-style", "contiguous", "empty")
    buf, calls = decode_calls(names, dtype, layout)
    graphs = [(n, f, _RawGraph(calls[n], f)) for n in names for f in (1, 4)]
    us = {(n, f): [] for n, f, _ in graphs}
    for _ in range(3):
        for n, f, g in graphs:
            us[n, f].append(_per_call_us(g.replay, len(calls[n]), buf))
    for (n, f), u in us.items():
        print("ROW " + json.dumps({"mode": mode, "dtype": dtype, "layout": layout, "variant": n,
                                   "graph": "device launch" if f == 4 else "torch", "us": u}),
              flush=True)


def mix(mode: str) -> None:
    """What puts graphs in the fast state of the compare run: the library's write and the empty
    kernel (bf16 NHD), each in a graph instantiated as torch's (flag 1 through the driver, or
    ``torch`` itself: ``capture_graph``) and one for device launch (flag 4). ``mix-control``:
    the compare run's order, every graph timed; ``mix-untimed``: only the flag-1 graphs timed;
    ``mix-4first`` / ``mix-1first``: every graph of one kind instantiated before the other's;
    ``mix-torch``: torch's graphs in place of flag 1; ``mix-torch-untimed``: those, alone timed;
    ``mix-recipe``: a one-node device-launch graph instantiated before torch's graphs and launched
    once after their capture, then torch's graphs alone timed."""
    names = ("default", "empty")
    buf, calls = decode_calls(names)  # (puts the repository on sys.path)
    from fkv.bench._common import capture_graph

    torch_graphs = mode.startswith("mix-torch") or mode == "mix-recipe"
    host = (lambda n: capture_graph(calls[n])) if torch_graphs else \
        (lambda n: _RawGraph(calls[n], 1))
    if mode == "mix-recipe":
        # one single-node device-launch graph instantiated before torch's graphs, launched once
        # after them, never timed: a recipe an engine could follow at start-up
        primer = _RawGraph(calls["empty"][:1], 4)
        made = {(n, 1): capture_graph(calls[n]) for n in names}
        primer.replay()
        import torch

        torch.cuda.synchronize()
        made["primer", 4] = primer
    elif mode == "mix-4first":
        made = {(n, 4): _RawGraph(calls[n], 4) for n in names}
        made.update({(n, 1): host(n) for n in names})
    elif mode == "mix-1first":
        made = {(n, 1): host(n) for n in names}
        made.update({(n, 4): _RawGraph(calls[n], 4) for n in names})
    else:
        made = {}
        for n in names:
            made[n, 1] = host(n)
            made[n, 4] = _RawGraph(calls[n], 4)
    order = [(n, f) for n in names for f in (1, 4)]
    if mode.endswith("untimed") or mode == "mix-recipe":
        order = [(n, 1) for n in names]
    us = {key: [] for key in order}
    for _ in range(3):
        for key in order:
            us[key].append(_per_call_us(made[key].replay, len(calls[key[0]]), buf))
    for (n, f), u in us.items():
        kind = "device launch" if f == 4 else ("torch" if torch_graphs else "flag 1")
        print("ROW " + json.dumps({"mode": mode, "variant": n, "graph": kind, "us": u}),
              flush=True)


def engine(mode: str) -> None:
    """As an engine captures its decode graphs: 40 torch graphs of the 32 writes on one shared
    memory pool, then an empty-kernel graph; the first, 20th and 40th write graphs and the empty
    one timed three times each."""
    buf, calls = decode_calls(("default", "empty"))
    import torch

    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for _ in range(40):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            for call in calls["default"]:
                call()
        graphs.append(g)
    from fkv.bench._common import capture_graph

    empty = capture_graph(calls["empty"])
    timed = {"write 1st": graphs[0], "write 20th": graphs[19], "write 40th": graphs[39],
             "empty": empty}
    us = {k: [] for k in timed}
    for _ in range(3):
        for k, g in timed.items():
            us[k].append(_per_call_us(g.replay, 32, buf))
    for k, u in us.items():
        print("ROW " + json.dumps({"mode": mode, "variant": k, "graph": "torch pool", "us": u}),
              flush=True)


def _primer():
    """A one-node graph (an ``add_`` on a scalar) captured by torch and instantiated here for
    device launch (flag 4) and uploaded: the recipe's primer."""
    import torch

    x = torch.zeros(1, device="cuda")
    return _RawGraph([lambda: x.add_(1)], 4)


def recipe(mode: str) -> None:
    """``mix-recipe`` as a start-up recipe for the library and the engine-style kernel: the
    primer instantiated first, torch's graphs captured, the primer launched once (``recipe-*``,
    or ``helper-*`` through ``fkv.ops.graph_primer``) or not at all (``control-*``), then every
    torch graph timed three times, interleaved."""
    import contextlib

    import torch

    from fkv.bench._common import capture_graph

    kind, rest = mode.split("-", 1)
    if kind == "percase":
        percase(mode)
        return
    dtype, layout = ("bfloat16", "NHD") if rest == "engine" else rest.split("-")
    names = ("default",) if rest == "engine" else ("default", "engine-style")
    buf, calls = decode_calls(names, dtype, layout)
    if kind in ("helper", "late"):
        import fkv.ops

        if kind == "late":  # two graphs captured (and dropped) before the primer
            from fkv.bench._common import settle_graphs

            settle_graphs()
        scope = fkv.ops.graph_primer()
    elif kind == "recipe":
        @contextlib.contextmanager
        def scope():
            primer = _primer()
            yield
            primer.replay()
            torch.cuda.synchronize()
            _KEEP.append(primer)

        scope = scope()
    else:
        scope = contextlib.nullcontext()
    with scope:
        if rest == "engine":
            pool = torch.cuda.graph_pool_handle()
            graphs = {}
            for i in range(40):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    for call in calls["default"]:
                        call()
                graphs[f"write {i + 1}"] = g
            timed = {k: graphs[k] for k in ("write 1", "write 20", "write 40")}
            sizes = dict.fromkeys(timed, len(calls["default"]))
        else:
            timed = {n: capture_graph(calls[n]) for n in names}
            sizes = {n: len(calls[n]) for n in names}
    us = {k: [] for k in timed}
    for _ in range(3):
        for k, g in timed.items():
            us[k].append(_per_call_us(g.replay, sizes[k], buf))
    for k, u in us.items():
        print("ROW " + json.dumps({"mode": mode, "dtype": dtype, "layout": layout, "variant": k,
                                   "graph": "torch", "us": u}), flush=True)


_KEEP: list = []


def percase(mode: str) -> None:
    """As a bench measures: three rounds of (capture one graph of the library's writes inside its
    own ``fkv.ops.graph_primer()``, time it three times at once); the process's first capture is
    the first primer's."""
    import fkv.ops
    from fkv.bench._common import capture_graph

    _, dtype, layout = mode.split("-")
    buf, calls = decode_calls(("default",), dtype, layout)
    for i in range(3):
        with fkv.ops.graph_primer():
            g = capture_graph(calls["default"])
        us = [_per_call_us(g.replay, len(calls["default"]), buf) for _ in range(3)]
        print("ROW " + json.dumps({"mode": mode, "dtype": dtype, "layout": layout,
                                   "variant": f"round {i + 1}", "graph": "torch", "us": us}),
              flush=True)


def child(mode: str) -> None:
    if mode.startswith(("recipe-", "control-", "helper-", "late-", "percase-")):
        recipe(mode)
        return
    if mode.startswith("compare-"):
        compare(mode)
        return
    if mode == "mix-engine":
        engine(mode)
        return
    if mode.startswith("mix-"):
        mix(mode)
        return
    second = "contiguous" if mode == "state" else "empty"
    buf, calls = decode_calls(("default", second))  # (puts the repository on sys.path)
    import torch

    from fkv.bench._common import capture_graph

    if mode in ("sleep", "state"):
        time.sleep(3)
    order = ["default", second] * 3
    graphs = []
    for name in order:
        if mode in FLAGS:
            g = _RawGraph(calls[name], FLAGS[mode], stream_priority=-1 if mode == "prio" else 0)
        else:
            g = capture_graph(calls[name])
        graphs.append((name, g))
    replay_stream = torch.cuda.Stream(priority=-1) if mode == "hiprio" else None
    us = [[] for _ in graphs]
    for _ in range(3):
        for i, (name, g) in enumerate(graphs):
            if replay_stream is not None:
                with torch.cuda.stream(replay_stream):
                    us[i].append(_per_call_us(g.replay, len(calls[name]), buf))
            else:
                us[i].append(_per_call_us(g.replay, len(calls[name]), buf))
    print("ROW " + json.dumps({"mode": mode, "graphs": [n for n, _ in graphs], "us": us}),
          flush=True)


def child_rows(script, mode: str, env=None) -> list[dict] | str:
    """``script --child mode`` run in a fresh process: its ``ROW`` lines decoded, or (printed
    too) the end of its error output."""
    proc = subprocess.run([sys.executable, str(script), "--child", mode], env=env,
                          capture_output=True, text=True, timeout=300)
    found = [json.loads(ln[4:]) for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if proc.returncode or not found:
        print(mode, "FAILED", proc.stdout[-1500:], proc.stderr[-2500:], flush=True)
        return proc.stderr[-1500:]
    return found


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    sys.path.insert(0, str(HERE.parent))
    import _record

    rows = []
    modes = os.environ.get("GRAPH_STATE_MODES", ",".join(MODES)).split(",")
    if modes == ["compare"]:
        modes = [f"compare-{d}-{lay}" for d in ("bfloat16", "float8_e4m3fn")
                 for lay in ("NHD", "HND")]
    if modes == ["recipe"]:
        modes = [f"{kind}-{rest}" for rest in [f"{d}-{lay}" for d in ("bfloat16", "float8_e4m3fn")
                                               for lay in ("NHD", "HND")] + ["engine"]
                 for kind in ("control", "recipe")]
    if modes == ["mix"]:
        modes = ["mix-control", "mix-untimed", "mix-4first", "mix-1first", "mix-torch",
                 "mix-torch-untimed", "mix-engine"]
    for repeat in range(int(os.environ.get("GRAPH_STATE_REPEATS", "1"))):
        for mode in modes:
            found = child_rows(HERE, mode, {**os.environ, **ENV.get(mode, {})})
            if isinstance(found, str):
                rows.append({"mode": mode, "repeat": repeat, "error": found})
                continue
            for row in found:
                row = {**row, "repeat": repeat}
                rows.append(row)
                if "variant" in row:
                    print(f"{mode} {row['variant']:13s} {row['graph']:13s} "
                          f"{min(row['us']):4.2f}/{max(row['us']):4.2f}", flush=True)
                else:
                    print(f"{mode:7s} " + "  ".join(f"{n[:3]} {min(u):4.2f}/{max(u):4.2f}"
                                                    for n, u in zip(row["graphs"], row["us"])),
                          flush=True)
    _record.write(os.environ.get("GRAPH_STATE_FILE", "graph-state-exp.json"), "graph_state", rows)


if __name__ == "__main__":
    main()
