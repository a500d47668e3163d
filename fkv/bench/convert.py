"""Benchmark ``fkv.ops.convert`` and ``gather``/``scatter`` (H200 targets; docs/benchmarks.md).

Cases (bf16, N=16, H=8, D=128, 16384 blocks; two layers so cross-layer buffers mean something):

- convert, whole cache, every pair of {NHD, HND} x {per-layer, cross-layer} (triton backend), and
  flash_attn NHD <-> triton HND (backend change). Bytes = cache read + cache written.
  Baseline: torch permute + ``copy_`` per layer. Target >= 3400 GB/s.
- gather of 2048 random blocks x heads 0-3 of 8 into a staging buffer, from NHD and HND (and a
  layer of a cross-layer cache). Bytes = selected K/V read + staging written. Baseline: torch
  index + slice + transpose + ``copy_``. Target >= 3000 GB/s.
- scatter of the same staging buffers back into NHD and HND caches (no target; the inverse).

Every case is checked bit for bit against ``fkv.ops.reference`` (outputs poisoned first), and the
baseline against the same reference, before timing. Reported per case: GB/s, % of a device-copy
ceiling measured in the same run, ratio to the same-run torch baseline, and a second timing of the
kernel (noise). ``do_bench`` flushes L2 (256 MB) before each call; gather/scatter also rotate
through several id sets and staging buffers (> 512 MB in all).

    python bench/bench_convert.py                          # full run (CUDA) -> bench/results/
    python bench/bench_convert.py --json convert.json --plot convert.png
    python bench/bench_convert.py --quick                  # fewer cases, shorter timing
    python bench/bench_convert.py --layers 32 --only convert --results-dir bench/results/raw
                                                           # model scale: 32 GiB caches
    python bench/bench_convert.py --sweep                  # also try tile sizes / warps
    python bench/bench_convert.py --cpu-smoke              # tiny shapes on the CPU interpreter:
                                                           # correctness path only, no timing
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from fkv.bench import results
from fkv.cli import positive_int
from fkv.bench._common import (Cycle, add_cpu_smoke_argument, copy_ceiling_gbps, eager_us,
                               graph_us, parse_args, time_ms)

__all__ = ["main"]

L2_ROTATE_BYTES = 512 << 20
TARGETS = {"convert": 3400.0, "gather": 3000.0, "scatter": 0.0}


@dataclass
class Shape:
    num_blocks: int = 16384
    block_size: int = 16
    heads: int = 8
    head_size: int = 128
    num_layers: int = 2
    gather_blocks: int = 2048
    gather_heads: tuple[int, int] = (0, 4)


@dataclass
class Case:
    op: str            # "convert" | "gather" | "scatter"
    src: str           # spec label, e.g. "triton NHD" or "triton HND xl"
    dst: str = ""      # convert only
    bytes: int = 0
    ms: float = 0.0
    ms_repeat: float = 0.0
    gbps: float = 0.0
    pct_of_copy: float = 0.0
    baseline_ms: float = 0.0
    baseline_gbps: float = 0.0
    speedup_vs_baseline: float = 0.0
    target_gbps: float = 0.0
    meets_target: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.op} {self.src}" + (f" -> {self.dst}" if self.dst else "")


def _spec(label: str, shape: Shape):
    import fkv

    backend, layout, *xl = label.split()
    return fkv.KVCacheSpec(backend=backend, layout=layout, num_blocks=shape.num_blocks,
                           block_size=shape.block_size, num_kv_heads=shape.heads,
                           head_size=shape.head_size, num_layers=shape.num_layers,
                           cross_layer=bool(xl))


def _bits(t):
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _fill(views, seed: int) -> None:
    import torch

    g = torch.Generator(device=views[0].device).manual_seed(seed)
    for v in views:
        _bits(v).copy_(torch.randint(-(1 << 15), 1 << 15, v.shape, generator=g,
                                     device=v.device, dtype=torch.int16))


def _same(a, b) -> bool:
    import torch

    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


# -- baselines (plain torch, built once per case) --------------------------------------------------
def _convert_baseline(src, src_spec, out, dst_spec):
    """torch permute + copy_ per layer (the logical views carry both layouts' strides)."""
    sa, da = src_spec.logical_axes, dst_spec.logical_axes
    perm = [sa.index(a) for a in da]
    pairs = [(_bits(o), _bits(s).permute(perm)) for s, o in zip(src, out)]

    def run():
        for o, s in pairs:
            o.copy_(s)

    return run


def _canonical(view, spec):
    axes = spec.logical_axes
    return _bits(view).permute([axes.index(a) for a in ("B", "two", "N", "H", "C")])


def _gather_baseline(cache, spec, heads):
    """torch index + slice: the chosen blocks' head range, transposed to [n, 2, h, N, D]."""
    canon = _canonical(cache, spec)[:, :, :, heads[0]:heads[1]]

    def run(ids, out):
        _bits(out).copy_(canon[ids].transpose(2, 3))

    return run


def _scatter_baseline(cache, spec, heads):
    canon = _canonical(cache, spec)

    def run(ids, staging):
        canon[ids, :, :, heads[0]:heads[1]] = _bits(staging).transpose(2, 3)

    return run


# -- cases ------------------------------------------------------------------------------------------
def _finish(case: Case, ceiling: float) -> None:
    case.gbps = case.bytes / case.ms / 1e6
    case.baseline_gbps = case.bytes / case.baseline_ms / 1e6 if case.baseline_ms else 0.0
    case.pct_of_copy = 100 * case.gbps / ceiling if ceiling else 0.0
    case.speedup_vs_baseline = case.baseline_ms / case.ms if case.baseline_ms else 0.0
    case.target_gbps = TARGETS[case.op]
    case.meets_target = case.gbps >= case.target_gbps


def _run_convert(case: Case, shape: Shape, device: str, ceiling: float, rep: int | None) -> None:
    import fkv
    from fkv.ops import reference
    from fkv.ops.relayout import convert

    src_spec, dst_spec = _spec(case.src, shape), _spec(case.dst, shape)
    src = fkv.allocate(src_spec, device=device)
    _fill(src, seed=1)
    out = fkv.allocate(dst_spec, device=device)
    ref = fkv.allocate(dst_spec, device=device)
    _fill(out, seed=2)
    _fill(ref, seed=3)
    convert(src, src_spec, dst_spec, out=out)
    reference.convert(src, src_spec, dst_spec, out=ref)
    if not _same(out, ref):
        raise SystemExit(f"MISMATCH: fkv.ops.convert differs from the reference ({case.name})")
    baseline = _convert_baseline(src, src_spec, out, dst_spec)
    _fill(out, seed=4)
    baseline()
    if not _same(out, ref):
        raise SystemExit(f"MISMATCH: the torch baseline differs from the reference ({case.name})")
    del ref
    case.bytes = 2 * src_spec.region_bytes * src_spec.num_regions
    if rep is None:
        return
    case.ms = time_ms(lambda: convert(src, src_spec, dst_spec, out=out), rep)
    case.baseline_ms = time_ms(baseline, rep)
    case.ms_repeat = time_ms(lambda: convert(src, src_spec, dst_spec, out=out), rep)
    _finish(case, ceiling)


def _run_staging(case: Case, shape: Shape, device: str, ceiling: float, rep: int | None) -> None:
    import torch

    import fkv
    from fkv.ops import reference
    from fkv.ops.relayout import gather, scatter

    spec = _spec(case.src, shape)
    caches = fkv.allocate(spec, device=device)
    _fill(caches, seed=5)
    cache = caches[-1]  # a cross-layer cache's last layer: a view at a non-zero offset
    heads = shape.gather_heads
    n, h = shape.gather_blocks, heads[1] - heads[0]
    stage_shape = (n, 2, h, spec.block_size, spec.head_size)
    stage_bytes = 2 * n * h * spec.block_size * spec.head_size * spec.itemsize
    count = max(2, min(16, -(-L2_ROTATE_BYTES // (2 * stage_bytes))))
    g = torch.Generator().manual_seed(6)
    ids = [torch.randperm(spec.num_blocks, generator=g)[:n].to(device) for _ in range(count)]
    stages = [torch.empty(stage_shape, dtype=cache.dtype, device=device) for _ in range(count)]
    for s in stages:
        _fill([s], seed=7)
    case.bytes = 2 * stage_bytes

    if case.op == "gather":
        baseline = _gather_baseline(cache, spec, heads)
        expected = reference.gather(cache, spec, ids[0], heads=heads)
        gather(cache, spec, ids[0], heads=heads, out=stages[0])
        if not torch.equal(_bits(stages[0]), _bits(expected)):
            raise SystemExit(f"MISMATCH: fkv.ops.gather differs from the reference ({case.name})")
        _fill([stages[0]], seed=8)
        baseline(ids[0], stages[0])
        if not torch.equal(_bits(stages[0]), _bits(expected)):
            raise SystemExit(f"MISMATCH: the torch baseline differs from the reference "
                             f"({case.name})")
        pairs = Cycle(list(zip(ids, stages)))

        def kernel():
            i, s = pairs.next()
            gather(cache, spec, i, heads=heads, out=s)

        def base():
            i, s = pairs.next()
            baseline(i, s)
    else:
        other = fkv.allocate(spec, device=device)
        _fill(other, seed=9)
        baseline = _scatter_baseline(other[-1], spec, heads)
        expected = fkv.allocate(spec, device=device)
        for e, o in zip(expected, other):
            _bits(e).copy_(_bits(o))
        scatter(stages[0], other[-1], spec, ids[0], heads=heads)
        reference.scatter(stages[0], expected[-1], spec, ids[0], heads=heads)
        if not _same(other, expected):
            raise SystemExit(f"MISMATCH: fkv.ops.scatter differs from the reference ({case.name})")
        _fill(other, seed=9)
        baseline(ids[0], stages[0])
        if not _same(other, expected):
            raise SystemExit(f"MISMATCH: the torch baseline differs from the reference "
                             f"({case.name})")
        del expected
        pairs = Cycle(list(zip(ids, stages)))

        def kernel():
            i, s = pairs.next()
            scatter(s, other[-1], spec, i, heads=heads)

        def base():
            i, s = pairs.next()
            baseline(i, s)
    if rep is None:
        return
    case.ms = time_ms(kernel, rep)
    case.baseline_ms = time_ms(base, rep)
    case.ms_repeat = time_ms(kernel, rep)
    _finish(case, ceiling)
    case.extra["eager_us"] = eager_us([kernel], "cuda", 500)
    case.extra["eager_gbps"] = case.bytes / case.extra["eager_us"] / 1e3
    case.extra["baseline_eager_us"] = eager_us([base], "cuda", 500)
    try:  # the ids are on the GPU: no validation, no sync, so the op is capturable
        case.extra["graph_us"] = graph_us([kernel] * 8)
        case.extra["graph_gbps"] = case.bytes / case.extra["graph_us"] / 1e3
    except RuntimeError as e:
        case.extra["graph_error"] = str(e).splitlines()[0]


def _cases(quick: bool) -> list[Case]:
    layouts = ["triton NHD", "triton HND", "triton NHD xl", "triton HND xl"]
    if quick:
        pairs = [("triton NHD", "triton HND"), ("triton HND", "triton NHD"),
                 ("triton NHD", "triton NHD xl"), ("triton HND xl", "triton HND")]
    else:
        pairs = list(itertools.permutations(layouts, 2))
        pairs += [("flash_attn NHD", "triton HND"), ("triton HND", "flash_attn NHD")]
    cases = [Case("convert", a, b) for a, b in pairs]
    sources = layouts[:2] if quick else layouts
    cases += [Case("gather", s) for s in sources]
    cases += [Case("scatter", s) for s in layouts[:2]]
    return cases


def _run(case: Case, shape: Shape, device: str, ceiling: float, rep: int | None) -> None:
    if case.op == "convert":
        _run_convert(case, shape, device, ceiling, rep)
    else:
        _run_staging(case, shape, device, ceiling, rep)


def _sweep(shape: Shape, ceiling: float, rep: int) -> list[dict]:
    """Throughput over the kernel's tile budget and warps on one convert and one gather case."""
    from fkv.ops import _move_kernel as mk
    from fkv.ops import relayout

    saved = mk.MAX_TILE_BYTES, mk.NUM_WARPS
    rows = []
    try:
        for tile_bytes, warps in itertools.product((4096, 8192, 16384, 32768), (2, 4, 8)):
            mk.MAX_TILE_BYTES, mk.NUM_WARPS = tile_bytes, warps
            relayout._FAST.clear()  # repeat-call entries hold the launch site of the old constants
            for case in (Case("convert", "triton NHD", "triton HND"), Case("gather", "triton NHD"),
                         Case("gather", "triton HND")):
                _run(case, shape, "cuda", ceiling, rep)
                rows.append({"max_tile_bytes": tile_bytes, "num_warps": warps, "case": case.name,
                             "gbps": case.gbps})
                print(f"  sweep tile={tile_bytes:5d} warps={warps} {case.name}: "
                      f"{case.gbps:7.0f} GB/s", flush=True)
    finally:
        mk.MAX_TILE_BYTES, mk.NUM_WARPS = saved
        relayout._FAST.clear()
    return rows


def _table(cases: list[Case], ceiling: float) -> str:
    lines = [f"convert / gather / scatter (copy ceiling {ceiling:.0f} GB/s; baselines: torch "
             f"permute+copy, index+slice)",
             f"{'case':40s} {'GB/s':>7s} {'again':>7s} {'%copy':>6s} {'x base':>7s} "
             f"{'base GB/s':>9s} {'target':>8s}  eager/graph"]
    for c in cases:
        again = c.bytes / c.ms_repeat / 1e6 if c.ms_repeat else 0.0
        target = f"{c.target_gbps:.0f} {'ok' if c.meets_target else 'MISS'}" if c.target_gbps else "-"
        e = c.extra
        tail = ""
        if "eager_us" in e:
            tail = (f"eager {e['eager_us']:.1f} µs ({e['eager_gbps']:.0f} GB/s; torch "
                    f"{e['baseline_eager_us']:.1f} µs)")
        if "graph_us" in e:
            tail += f", graph {e['graph_us']:.1f} µs ({e['graph_gbps']:.0f} GB/s)"
        lines.append(f"{c.name:40s} {c.gbps:7.0f} {again:7.0f} {c.pct_of_copy:5.1f}% "
                     f"{c.speedup_vs_baseline:6.2f}x {c.baseline_gbps:9.0f} {target:>8s}  {tail}")
    return "\n".join(lines)


def _cpu_smoke(args: argparse.Namespace) -> int:
    """The correctness path (kernels and baselines vs the reference) on tiny shapes, interpreter
    (``parse_args`` set ``TRITON_INTERPRET=1``)."""
    shape = Shape(num_blocks=24, block_size=4, heads=4, head_size=16, gather_blocks=6,
                  gather_heads=(1, 3))
    cases = []
    for case in _cases(quick=False):
        _run(case, shape, "cpu", 0.0, None)
        cases.append(case)
        print(f"ok  {case.name}")
    run = to_run(cases, shape, None, "cpu", config={"mode": "cpu-smoke (correctness only)"})
    results.save(run, args, by_default=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fkv bench convert", description=__doc__.split("\n")[0])
    results.add_output_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="fewer cases, shorter timing")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep the tile budget and warps on one convert and gathers")
    parser.add_argument("--only", metavar="SUBSTR", default="",
                        help="run only the cases whose name contains this (e.g. 'gather')")
    parser.add_argument("--layers", type=positive_int, default=Shape.num_layers, metavar="L",
                        help=f"layers of every cache (default {Shape.num_layers}; 32 with the "
                             f"default blocks is a 32 GiB cache, model scale)")
    parser.add_argument("--blocks", type=positive_int, default=Shape.num_blocks, metavar="NB",
                        help=f"blocks of every cache (default {Shape.num_blocks})")
    add_cpu_smoke_argument(parser, "only the correctness path runs, nothing is timed")
    args = parse_args(parser, argv)
    if args.cpu_smoke:
        return _cpu_smoke(args)

    import torch

    if not torch.cuda.is_available():
        print("fkv bench convert needs a CUDA device (use --cpu-smoke for the correctness path)",
              file=sys.stderr)
        return 2
    rep = 40 if args.quick else 200
    if args.layers < 1 or args.blocks < max(Shape.gather_blocks, 1):
        parser.error(f"--layers must be >= 1 and --blocks >= {Shape.gather_blocks} (the gathers' "
                     f"blocks)")
    shape = Shape(num_layers=args.layers, num_blocks=args.blocks)
    ceiling = copy_ceiling_gbps(rep)
    cases = [c for c in _cases(args.quick) if args.only in c.name]
    for case in cases:
        _run(case, shape, "cuda", ceiling, rep)
        print(f"  {case.name}: {case.gbps:.0f} GB/s ({case.pct_of_copy:.1f}% of copy, "
              f"{case.speedup_vs_baseline:.2f}x torch)", flush=True)
        torch.cuda.empty_cache()
    sweep = _sweep(shape, ceiling, rep) if args.sweep else []
    run = to_run(cases, shape, ceiling, "cuda",
                 config={"mode": "cuda", "quick": args.quick, "only": args.only, "rep": rep})
    run.extra = {"sweep": sweep}
    results.save(run, args)
    print(_table(cases, ceiling))
    if args.plot:
        from fkv.bench import plots

        plots.plot_convert(run.to_file(), args.plot)
        print(f"plot: {args.plot}")
    return 0


_METRICS = ("ms", "gbps", "pct_of_copy", "baseline_ms", "baseline_gbps",
            "target_gbps")
_EXTRA_METRICS = ("eager_us", "eager_gbps", "baseline_eager_us", "graph_us", "graph_gbps")


def to_run(cases: list[Case], shape: Shape, ceiling: float | None, device: str,
           config: dict[str, Any] | None = None, env: dict[str, Any] | None = None
           ) -> results.Run:
    """The result file of a run: one case per ``Case`` (id = ``Case.name``); a correctness-only
    run (no ``ceiling``) records the cases it checked, without metrics."""
    run = results.Run("convert", config={"shape": asdict(shape), **(config or {})}, env=env,
                      device=device)
    if ceiling is not None:
        run.ceiling("copy_gbps", ceiling)
    for c in cases:
        params = {"op": c.op, "src": c.src, "dst": c.dst, "bytes": c.bytes}
        if ceiling is None:
            run.add(c.name, params=params, extra={"checked": True})
            continue
        metrics = {k: getattr(c, k) for k in _METRICS}
        metrics["repeat_ms"] = c.ms_repeat
        metrics["speedup_x"] = c.speedup_vs_baseline
        metrics |= {k: c.extra[k] for k in _EXTRA_METRICS if k in c.extra}
        extra = {k: v for k, v in c.extra.items() if k not in _EXTRA_METRICS}
        run.add(c.name, params=params, metrics=metrics,
                extra={"meets_target": c.meets_target, **extra})
    return run


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
