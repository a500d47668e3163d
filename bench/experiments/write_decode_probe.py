"""Experiment: where a 256-token ``write_kv`` decode spends its time per call in a CUDA graph.

Issue 14's last item is this figure with the plain launch (the benchmark targets: no slower
than the engine's kernel; the issue: <= 2.2 us bf16, <= 2.5 us fp8). Earlier rounds timed tilings
with rotating inputs only; here every variant is timed with rotating inputs (32 sets, from DRAM
after do_bench's L2 flush) and with one input set (L2-warm), twice (forward and reverse order, to see the noise),
beside floors that leave a stage out:

- ``empty``: a kernel of the same grid that does nothing (the graph node alone);
- ``no-store``: the library kernel with every slot -1 (loads, no stores);
- ``contiguous``: a kernel of the same tiling that copies the inputs to a contiguous buffer (the
  scatter's share);
- the engine-style kernel of ``bench/gpu_kernels_sweep.py`` (same-run baseline);
- the library kernel: default, ``pdl=True``, forced tilings (1 token x 8 heads x w warps, and K and
  V in one program), streaming stores.

Then, when ``ncu`` is on the PATH, a child process launches the default kernel, the engine-style
kernel and the floors warm under ``ncu --cache-control none --clock-control none`` for their
durations, instruction counts and DRAM/L2 traffic (the graph per-call figure is node overhead plus
this duration).

    python bench/experiments/write_decode_probe.py            # GPU; JSON + ncu log to $OUT
    python bench/experiments/write_decode_probe.py --ncu-child  # (what ncu runs)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import _record  # noqa: E402  (bench/experiments/_record.py)
import gpu_kernels_sweep as sweep  # noqa: E402  (bench/gpu_kernels_sweep.py)

import fkv  # noqa: E402
from fkv.bench._common import graph_us  # noqa: E402
from fkv.bench.write import Shape, _inputs, _slot_sets  # noqa: E402
from fkv.ops import reference  # noqa: E402
from fkv.ops import write as write_mod  # noqa: E402

TOKENS = 256
SETS = 32
REP = 200
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _empty_kernel(x_ptr, n):
    if tl.program_id(0) >= n:  # never: keeps the kernel from being empty of arguments
        tl.store(x_ptr, 0)


@triton.jit
def _contiguous_kernel(key_ptr, value_ptr, out_ptr, num_tokens, HEADS: tl.constexpr,
                       D: tl.constexpr):
    t = tl.program_id(0)
    half = tl.program_id(1)
    off = tl.arange(0, HEADS)[:, None] * D + tl.arange(0, D)[None, :]
    src = tl.where(half == 0, key_ptr, value_ptr)
    x = tl.load(src + t * HEADS * D + off, eviction_policy="evict_first")
    tl.store(out_ptr + (half * num_tokens + t) * HEADS * D + off, x.to(out_ptr.dtype.element_ty))


def _spec(layout: str, dtype: str):
    s = Shape()
    return fkv.KVCacheSpec(layout=layout, num_blocks=s.num_blocks, block_size=s.block_size,
                           num_kv_heads=s.heads, head_size=s.head_size, dtype=dtype)


def _sets(spec):
    shape = Shape()
    kv = _inputs(spec, TOKENS, SETS, DEVICE, seed=1)
    slots = _slot_sets("decode", TOKENS, shape, SETS, DEVICE, seed=2)
    return [(k, v, s) for (k, v), s in zip(kv, slots)]


def _variants(spec, cache, scales, out):
    """name -> make_call(key, value, slots) for one spec."""
    def lib(tiling=None, fused=False, pdl=False, store=""):
        """tiling None: the library's own choice (fusion included); else forced, with K and V in
        one program or not. (Runs before 2026-12-02T0810 forced fusion off for None too, so their
        "default" and "pdl" rows of bf16 are one program per half.)"""
        def make(k, v, s):
            def call():
                saved = write_mod._STORE_MODIFIER
                write_mod._STORE_MODIFIER = store
                if tiling is None:
                    write_mod.write_kv(k, v, cache, s, spec, validate=False, pdl=pdl, **scales)
                else:
                    with sweep._Forced(tiling, fused):
                        write_mod.write_kv(k, v, cache, s, spec, validate=False, pdl=pdl,
                                           **scales)
                write_mod._STORE_MODIFIER = saved
            return call
        return make

    def empty(k, v, s):
        return lambda: _empty_kernel[(TOKENS, 2)](out, 1 << 30, num_warps=2)

    def contiguous(k, v, s):
        return lambda: _contiguous_kernel[(TOKENS, 2)](k, v, out, TOKENS, spec.num_kv_heads,
                                                       spec.head_size, num_warps=2)

    def no_store(k, v, s):
        pad = torch.full_like(s, -1)
        return lib()(k, v, pad)

    def engine(k, v, s):
        return sweep._engine_call(spec, cache, k, v, s, scales)

    d = spec.head_size
    variants = {"empty": empty, "contiguous": contiguous, "no-store": no_store,
                "engine-style": engine, "default": lib(), "pdl": lib(pdl=True)}
    if TOKENS != 256:  # the small token classes: the floors and the store modifier are T=256's
        variants = {"engine-style": engine, "default": lib(), "pdl": lib(pdl=True)}
    warps = (1, 2, 4, 8) if not spec.is_fp8 else (2, 4, 8)
    for w in warps:
        variants[f"(1, 8, {w})"] = lib(write_mod.WriteTiling(1, 8, d, w))
    for w in (2, 4, 8):
        variants[f"(1, 8, {w}) kv"] = lib(write_mod.WriteTiling(1, 8, d, w), fused=True)
    return variants


def _check(spec, cache, scales, make, sets) -> int:
    k, v, s = sets[0]
    ref = torch.empty_like(cache)
    for c in (cache, ref):
        c.view(torch.int8).fill_(-3)
    make(k, v, s)()
    reference.write_kv(k, v, ref, s, spec, validate=False, **scales)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return int((cache.view(torch.int8) != ref.view(torch.int8)).sum())


def timing() -> list[dict]:
    global TOKENS
    rows: list[dict] = []
    for TOKENS in [int(t) for t in os.environ.get("PROBE_TOKENS", "256").split(",")]:
        rows += _timing_tokens()
    return rows


def _cases():
    """(dtype, layout, spec, cache, scales, the contiguous kernel's output) of the four specs, one
    cache at a time (freed after its case)."""
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for layout in ("NHD", "HND"):
            spec = _spec(layout, dtype)
            cache = sweep.fkv_alloc(spec, DEVICE)
            out = torch.empty(2 * TOKENS * spec.num_kv_heads * spec.head_size,
                              dtype=torch.bfloat16, device=DEVICE)
            yield dtype, layout, spec, cache, sweep._scales(spec, DEVICE), out
            del cache
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


def _timing_tokens() -> list[dict]:
    rows: list[dict] = []
    for dtype, layout, spec, cache, scales, out in _cases():
        sets = _sets(spec)
        variants = _variants(spec, cache, scales, out)
        checks = {}
        for name, make in variants.items():
            if name in ("empty", "contiguous", "no-store"):
                continue
            checks[name] = _check(spec, cache, scales, make, sets)
        order = list(variants)
        times: dict[str, dict[str, list[float]]] = {n: {"rotating": [], "warm": []}
                                                    for n in order}
        for names in (order, order[::-1]):
            for name in names:
                make = variants[name]
                rot = graph_us([make(*x) for x in sets], REP)
                warm = graph_us([make(*sets[0])] * SETS, REP)
                times[name]["rotating"].append(rot)
                times[name]["warm"].append(warm)
        for name in order:
            row = {"tokens": TOKENS, "dtype": dtype, "layout": layout, "variant": name,
                   "rotating_us": times[name]["rotating"], "warm_us": times[name]["warm"],
                   "mismatches": checks.get(name)}
            rows.append(row)
            print(f"T={TOKENS:<4d} {dtype:14s} {layout} {name:16s} rotating "
                  f"{min(row['rotating_us']):5.2f} ({max(row['rotating_us']):5.2f})  warm "
                  f"{min(row['warm_us']):5.2f} ({max(row['warm_us']):5.2f})"
                  + (f"  MISMATCH {row['mismatches']}" if row["mismatches"] else ""),
                  flush=True)
    return rows


def ncu_child() -> None:
    """Warm launches for ncu: each variant 4 times (the last three are the warm ones)."""
    for dtype, layout, spec, cache, scales, out in _cases():
        k, v, s = _sets(spec)[0]
        variants = _variants(spec, cache, scales, out)
        for name in ("empty", "contiguous", "no-store", "engine-style", "default",
                     "(1, 8, 4)"):
            call = variants[name](k, v, s)
            for _ in range(4):
                call()
            torch.cuda.synchronize()
            print(f"NCU-ORDER {dtype} {layout} {name} x4", flush=True)


def smoke() -> None:
    """CPU (TRITON_INTERPRET=1): every library variant and the engine-style kernel against the
    reference on a small cache."""
    global TOKENS, SETS
    TOKENS, SETS = 8, 2
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for layout in ("NHD", "HND"):
            spec = fkv.KVCacheSpec(layout=layout, num_blocks=64, block_size=16, num_kv_heads=8,
                                   head_size=128, dtype=dtype)
            cache = sweep.fkv_alloc(spec, "cpu")
            scales = sweep._scales(spec, "cpu")
            kv = _inputs(spec, TOKENS, 1, "cpu", seed=1)
            slots = _slot_sets("decode", TOKENS, Shape(num_blocks=64), 1, "cpu", seed=2)
            sets = [(k, v, s) for (k, v), s in zip(kv, slots)]
            for name, make in _variants(spec, cache, scales, None).items():
                if name in ("empty", "contiguous", "no-store", "pdl"):
                    continue
                print(dtype, layout, name, _check(spec, cache, scales, make, sets), flush=True)


def main() -> None:
    if "--smoke" in sys.argv:
        smoke()
        return
    if "--ncu-child" in sys.argv:
        ncu_child()
        return
    out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
    rows = timing()
    ncu = shutil.which("ncu") if os.environ.get("PROBE_NCU", "1") != "0" else None
    if ncu:
        metrics = ",".join(["gpu__time_duration.sum", "smsp__inst_executed.sum",
                            "dram__bytes_read.sum", "dram__bytes_write.sum",
                            "lts__t_sectors_op_write.sum", "lts__t_sectors_op_read.sum",
                            "launch__registers_per_thread", "launch__grid_size",
                            "launch__block_size", "sm__cycles_active.avg"])
        # compile first (outside ncu), then profile the warm launches
        subprocess.run([sys.executable, __file__, "--ncu-child"], check=True)
        proc = subprocess.run([ncu, "--clock-control", "none", "--cache-control", "none",
                               "--csv", "--metrics", metrics, sys.executable, __file__,
                               "--ncu-child"], capture_output=True, text=True, timeout=400)
        (out_dir / "write-decode-ncu.csv").write_text(proc.stdout + "\n#stderr\n" + proc.stderr)
        print(proc.stdout[-6000:], proc.stderr[-2000:])
    _record.write("write-decode-probe-exp.json", "write_decode_probe", rows)


if __name__ == "__main__":
    main()
