"""Experiment: does a 256-token ``write_kv`` decode's per-call time (32 calls in a CUDA graph,
rotating inputs, do_bench's dirty 256 MB flush before each replay) depend on what the GPU did
just before?

The write bench's first decode case of a run, or the first after its prefill cases, has read
0.3-0.4 us below the others (bf16 NHD 2.14 against HND 2.50 in one run; with the decode cases in
reverse order, fp8 HND 2.10 against NHD 2.49), and ``write_decode_flush.py``'s first two
timings read 1.74 / 1.69 us where their repeats read 2.09 / 2.05. The suspect is the GPU's clock
state (a latency-bound kernel follows the SM clock; the flushes draw power).

The same calls (bf16 HND, library default; and the contiguous-copy floor) are timed over and over:
12 times back to back, then after 3 s idle, 6 more; after each timing NVML's SM and memory clocks,
power draw and clock-event reasons are read (pynvml, from nvidia-ml-py). ``STATE_MODE`` says
what is captured: ``new`` (default) a new graph for every timing, the old one freed; ``same`` one
graph per variant, captured once and timed every time; ``keep`` a new graph every time, every
old one kept alive. Run each mode in a process of its own.

    python bench/experiments/write_decode_state.py   # GPU; JSON to $OUT
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _record  # noqa: E402
import gpu_kernels_sweep as sweep  # noqa: E402
import write_decode_probe as probe  # noqa: E402
from write_decode_flush import FLUSH_BYTES, capture, per_call_us  # noqa: E402

import fkv  # noqa: E402
from fkv.bench.write import Shape, _inputs, _slot_sets  # noqa: E402


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def read() -> dict:
        out = {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
               "mem_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
               "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000}
        try:
            out["reasons"] = hex(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        except (AttributeError, pynvml.NVMLError):
            out["reasons"] = hex(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        return out
    return read


def main() -> None:
    nvml = _nvml()
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    shape = Shape()
    spec = fkv.KVCacheSpec(layout="HND", num_blocks=shape.num_blocks, block_size=shape.block_size,
                           num_kv_heads=shape.heads, head_size=shape.head_size, dtype="bfloat16")
    cache = sweep.fkv_alloc(spec, "cuda")
    out = torch.empty(2 * probe.TOKENS * spec.num_kv_heads * spec.head_size,
                      dtype=torch.bfloat16, device="cuda")
    kv = _inputs(spec, probe.TOKENS, probe.SETS, "cuda", seed=1)
    slots = _slot_sets("decode", probe.TOKENS, shape, probe.SETS, "cuda", seed=2)
    sets = [(k, v, s) for (k, v), s in zip(kv, slots)]
    variants = probe._variants(spec, cache, {}, out)
    graphs = {name: [variants[name](*x) for x in sets] for name in ("default", "contiguous")}
    for calls in graphs.values():  # compile
        calls[0]()
    torch.cuda.synchronize()
    time.sleep(3)
    mode = os.environ.get("STATE_MODE", "new")
    same = {name: capture(calls) for name, calls in graphs.items()} if mode == "same" else {}
    kept = []
    rows = []
    t0 = time.perf_counter()
    for step in range(18):
        if step == 12:
            time.sleep(3)
        for name, calls in graphs.items():
            graph = same.get(name)
            if mode == "keep":
                graph = capture(calls)
                kept.append(graph)
            us = per_call_us(calls, "write", buf, graph=graph)
            row = {"mode": mode, "step": step, "variant": name, "us": us,
                   "t_s": time.perf_counter() - t0, **(nvml() if nvml else {})}
            rows.append(row)
            print(row, flush=True)
    _record.write(f"write-decode-state-{mode}-exp.json", "write_decode_state", rows)


if __name__ == "__main__":
    main()
