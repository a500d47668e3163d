"""What the benchmarks share: the command-line parse step every one takes (:func:`parse_args`),
and timing helpers: do_bench medians, same-run ceilings, eager and graph per-call times, input
rotation. Result files (and their environment header) are
:mod:`fkv.bench.results`; how each figure is measured is docs/benchmarks.md.

On CUDA every time is ``triton.testing.do_bench(..., return_mode="median")``; on CPU (the
``--cpu-smoke`` paths, which only exercise the code) a short ``perf_counter`` median whose figure
means nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Cycle", "add_cpu_smoke_argument", "copy_ceiling_gbps", "eager_us", "environment",
           "graph_us", "parse_args", "read_ceiling_gbps", "time_ms", "write_json"]


def add_cpu_smoke_argument(parser: Any, what: str = "every code path and the correctness "
                           "checks run, the timings mean nothing") -> None:
    """``--cpu-smoke``, taken by the kernel benchmarks: tiny shapes on the CPU interpreter
    (:func:`parse_args` sets ``TRITON_INTERPRET=1`` for it); ``what`` says what such a run
    does."""
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"tiny shapes on the CPU interpreter: {what} (no result file "
                             f"unless --json or --results-dir)")


def parse_args(parser: Any, argv: list[str] | None) -> Any:
    """Parse a benchmark's command line, then, before anything runs: ``--plot`` without
    matplotlib exits with the install hint (not after a long run), and ``--cpu-smoke`` sets
    ``TRITON_INTERPRET=1`` (unless set), which must happen before triton is first imported."""
    args = parser.parse_args(argv)
    if getattr(args, "plot", None):
        from fkv.bench import plots

        plots.require(cli=True)
    if getattr(args, "cpu_smoke", False):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


def time_ms(fn: Callable[[], Any], rep: int, device: str = "cuda") -> float:
    """Median milliseconds per call of ``fn`` (do_bench on CUDA: events, L2 flushed between calls)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_ceiling_gbps(rep: int, device: str = "cuda", nbytes: int = 1 << 30) -> float:
    """Same-run copy ceiling: a ``nbytes`` device copy, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rep, device)
    del src, dst
    return 2 * nbytes / ms / 1e6


def read_ceiling_gbps(rep: int, device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Same-run read ceiling: a sum over ``nbytes`` of random float32."""
    import torch

    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    ms = time_ms(lambda: buf.sum(), rep, device)
    del buf
    return nbytes / ms / 1e6


class Cycle:
    """Rotate through input sets larger than L2 so repeated calls do not measure the cache."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items, self.i = list(items), 0

    def next(self) -> Any:
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def eager_us(fns: Sequence[Callable[[], Any]], device: str = "cuda", calls: int = 2000) -> float:
    """Wall µs per call of back-to-back calls, host launch path included (what an eager decode step
    pays): ``perf_counter`` around ``calls`` calls cycling through ``fns``, synchronized before and
    after; median of 3 runs."""
    import torch

    if device != "cuda":
        calls = 3
    seq = (list(fns) * -(-calls // len(fns)))[:calls]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for f in seq[:50]:
        f()
    runs = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        for f in seq:
            f()
        sync()
        runs.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(runs)


def settle_graphs(count: int = 2) -> None:
    """Capture and drop ``count`` throwaway CUDA graphs. On the H200 the first two graphs a process
    captures replayed 32 decode writes 0.35 us per call faster than every graph captured after
    them, for as long as they lived (clocks unchanged;
    bench/results/raw/write-decode-state-*-exp-20261202T1117.json; bench/NOTES.md, 2026-12-02 tenth
    session):
    a bench that captures these first times every graph of its run in the later, steady state."""
    import torch

    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for _ in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            x.add_(1)
        graph.replay()
        del graph
    torch.cuda.synchronize()


def capture_graph(calls: Sequence[Callable[[], Any]]) -> Any:
    """``calls`` captured in one CUDA graph, on a side stream; the first call runs once before
    the capture, so nothing compiles inside it."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    return graph


def graph_us(calls: Sequence[Callable[[], Any]], rep: int = 100) -> float:
    """GPU µs per call with no host in the way: ``calls`` captured in one CUDA graph (compiled
    before capture), replays timed with do_bench."""
    import triton.testing

    graph = capture_graph(calls)
    return triton.testing.do_bench(graph.replay, rep=rep, return_mode="median") * 1e3 / len(calls)


def environment(device: str) -> dict[str, Any]:
    """Deprecated: :func:`fkv.bench.results.environment` (kept until every bench writes through
    :mod:`fkv.bench.results`)."""
    from fkv.bench.results import environment as env

    return env(device)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Deprecated: a free-form JSON dump; benchmarks write :func:`fkv.bench.results.save`."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
