"""Experiment: how much of a 256-token ``write_kv`` decode's per-call time (32 calls in a CUDA
graph, rotating inputs) is the L2 state the timing leaves behind, and how much the cache's size.

do_bench flushes L2 before each replay by zeroing a 256 MB buffer, so every replay starts with
L2 full of *dirty* lines: each line the graph allocates (inputs read, cache lines written) first
writes one of those back to DRAM. A scatter into fresh cache lines allocates twice the lines a
copy into one reused buffer does, so the hypothesis is that part of the gap between the two
(about 0.4 us in the ninth session's probe) is someone else's write-back. The other suspect is
address translation: 256 random slots of a 32768-block cache touch a few hundred 2 MiB pages per
call, a small cache a handful.

Each variant (the contiguous copy floor, the library default, the engine-style kernel) is timed
per call in a 32-call graph with three L2 states before each replay:

- ``write``: a 256 MB ``zero_`` (do_bench's flush: L2 full of dirty lines);
- ``read``: a 256 MB read (L2 full of clean lines; the dirty ones were written back untimed);
- ``none``: nothing (the previous replay's lines; rotating inputs are still from DRAM after 32
  sets x 1 MiB had gone through);

and with the standing 32768-block cache and a 512-block one (same slots' distribution).

    python bench/experiments/write_decode_flush.py   # GPU; JSON to $OUT
"""

from __future__ import annotations

import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _record  # noqa: E402
import gpu_kernels_sweep as sweep  # noqa: E402
import write_decode_probe as probe  # noqa: E402

import fkv  # noqa: E402
from fkv.bench._common import capture_graph as capture  # noqa: E402
from fkv.bench.write import Shape, _inputs, _slot_sets  # noqa: E402

REP = 200
FLUSH_BYTES = 256 << 20


def per_call_us(calls, flush: str, buf: torch.Tensor, rep: int = REP,
                graph: torch.cuda.CUDAGraph | None = None) -> float:
    """Median µs per call of a graph of ``calls`` (captured here unless ``graph`` is given)
    replayed ``rep`` times, L2 set by ``flush`` before each replay (untimed)."""
    if graph is None:
        graph = capture(calls)
    sink = torch.empty((), dtype=buf.dtype, device=buf.device)
    times = []
    for i in range(rep + 10):
        if flush == "write":
            buf.zero_()
        elif flush == "read":
            torch.amax(buf, dim=0, out=sink)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times[10:]) * 1e3 / len(calls)


def main() -> None:
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    rows = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for layout in ("NHD", "HND"):
            for blocks in (32768, 512):
                shape = Shape(num_blocks=blocks)
                spec = fkv.KVCacheSpec(layout=layout, num_blocks=blocks,
                                       block_size=shape.block_size, num_kv_heads=shape.heads,
                                       head_size=shape.head_size, dtype=dtype)
                cache = sweep.fkv_alloc(spec, "cuda")
                out = torch.empty(2 * probe.TOKENS * spec.num_kv_heads * spec.head_size,
                                  dtype=torch.bfloat16, device="cuda")
                scales = sweep._scales(spec, "cuda")
                kv = _inputs(spec, probe.TOKENS, probe.SETS, "cuda", seed=1)
                slots = _slot_sets("decode", probe.TOKENS, shape, probe.SETS, "cuda", seed=2)
                sets = [(k, v, s) for (k, v), s in zip(kv, slots)]
                variants = probe._variants(spec, cache, scales, out)
                names = ["contiguous", "default", "engine-style"]
                got = {(n, f): [] for n in names for f in ("write", "read", "none")}
                for order in (names, names[::-1]):
                    for name in order:
                        calls = [variants[name](*x) for x in sets]
                        for flush in ("write", "read", "none"):
                            got[name, flush].append(per_call_us(calls, flush, buf))
                for (name, flush), us in got.items():
                    rows.append({"dtype": dtype, "layout": layout, "num_blocks": blocks,
                                 "variant": name, "flush": flush, "us": us})
                    print(f"{dtype:14s} {layout} {blocks:6d} {name:13s} {flush:5s} "
                          f"{min(us):5.2f} ({max(us):5.2f})", flush=True)
                del cache, kv, slots, sets
                torch.cuda.empty_cache()
    _record.write("write-decode-flush-exp.json", "write_decode_flush", rows)


if __name__ == "__main__":
    main()
