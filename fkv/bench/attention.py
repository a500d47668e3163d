"""Benchmark ``fkv.ops.paged_attention`` (H200 targets; docs/benchmarks.md), results to bench/results/.

Decode: B=64 x ctx 8192, B=256 x 2048, B=8 x 32768, B=16 x 4096 (Hq 32, Hkv 8, D 128, bf16,
N=16), NHD and HND, against torch SDPA on dense contiguous K/V of the same size in the same run (the fastest of
the default dispatch and each fused backend that runs GQA: flash, cuDNN, efficient), and a read
ceiling (a ``sum`` over 2 GiB) in the same run. Bytes = the K+V read once (q and the output are
< 0.1 % and not counted), so GB/s compares directly with the dense baseline; target >= 0.92x the
dense GB/s. Prefill: B=4 x 4096 new tokens (no context), against SDPA dense causal; target
paged time <= 1.2x the dense time. Block tables are random permutations of the cache's blocks
with one padding column of stale ids (as engines allocate them).

Before timing, each case is checked: the kernel against ``fkv.ops.reference.paged_attention`` and
against SDPA over the same K/V gathered into dense tensors. Timings are
``triton.testing.do_bench(return_mode="median")`` (L2 flushed between calls; every call streams
the whole cache, far beyond L2). The kernel is timed with ``validate=False`` (the values were
validated by the correctness call; validation costs one device sync per call).

    python bench/bench_attention.py                           # full run (CUDA) -> bench/results/
    python bench/bench_attention.py --json attention.json --plot attention.png
    python bench/bench_attention.py --quick                   # one decode shape, shorter timing
    python bench/bench_attention.py --sweep                   # also try tiles/warps/stages/splits
    python bench/bench_attention.py --cpu-smoke               # tiny shapes, CPU interpreter:
                                                              # the code path only, no timing
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from fkv.bench import results
from fkv.cli import non_negative_int
from fkv.bench._common import add_cpu_smoke_argument, parse_args, read_ceiling_gbps, time_ms

__all__ = ["main"]

DECODE_TARGET = 0.92   # x dense SDPA GB/s (issue 14)
PREFILL_TARGET = 1.2   # paged time / dense causal SDPA time (issue 14)


@dataclass
class Shape:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    decode: tuple[tuple[int, int], ...] = ((64, 8192), (256, 2048), (8, 32768), (16, 4096))
    prefill: tuple[int, int] = (4, 4096)


@dataclass
class Result:
    kind: str                  # "decode" | "prefill"
    batch: int
    tokens: int                # context per sequence (decode) / new tokens per sequence (prefill)
    layout: str
    bytes: int = 0             # K+V bytes read once
    ms: float = 0.0
    gbps: float = 0.0
    sdpa_ms: float = 0.0
    sdpa_gbps: float = 0.0
    ratio: float = 0.0         # decode: GB/s / dense GB/s; prefill: time / dense time
    pct_of_read_ceiling: float = 0.0
    meets_target: bool = False
    max_err_vs_reference: float = 0.0
    max_err_vs_sdpa: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.kind} B={self.batch} x {self.tokens} {self.layout}"


class Problem:
    """A filled paged cache (all blocks used, random order), queries and the dense equivalents."""

    def __init__(self, shape: Shape, layout: str, batch: int, seq_len: int, q_len: int,
                 device: str, seed: int = 0, dense: bool = True) -> None:
        import torch

        import fkv
        from fkv.ops.reference._attention import _keys_values

        n = shape.block_size
        blocks_per_seq = -(-seq_len // n)
        self.spec = fkv.KVCacheSpec(layout=layout, num_blocks=batch * blocks_per_seq,
                                    block_size=n, num_kv_heads=shape.num_kv_heads,
                                    head_size=shape.head_size, dtype="bfloat16")
        torch.manual_seed(seed)
        (self.cache,) = fkv.allocate(self.spec, device=device)
        self.cache.normal_()
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.spec.num_blocks, generator=g)
        table = perm.reshape(batch, blocks_per_seq)
        # one padding column of stale ids, as engines allocate block tables (never read)
        spare = torch.randint(0, self.spec.num_blocks, (batch, 1), generator=g)
        self.block_table = torch.cat([table, spare], 1).to(torch.int32).to(device)
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        self.q = torch.randn(batch * q_len, shape.num_q_heads, shape.head_size, device=device,
                             dtype=torch.bfloat16)
        self.query_start_loc = None
        if q_len > 1:
            self.query_start_loc = (torch.arange(batch + 1, device=device) * q_len).to(torch.int32)
        self.out = torch.empty_like(self.q)
        self.batch, self.seq_len, self.q_len = batch, seq_len, q_len
        self.bytes = 2 * batch * seq_len * shape.num_kv_heads * shape.head_size * 2
        if not dense:
            return
        # Dense K/V [B, Hkv, L, D] holding the same logical values (for the cross-check and SDPA).
        keys, values = _keys_values(self.cache, self.spec)
        idx = self.block_table.long()

        def dense(x):
            return x[idx].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()

        self.k_dense, self.v_dense = dense(keys), dense(values)
        self.q_dense = self.q.view(batch, q_len, shape.num_q_heads, shape.head_size).transpose(1, 2)
        self.q_dense = self.q_dense.contiguous()

    def kernel(self, config=None, validate: bool = False):
        from fkv.ops import paged_attention

        return paged_attention(self.q, self.cache, self.spec, self.block_table, self.seq_lens,
                               query_start_loc=self.query_start_loc, out=self.out,
                               validate=validate, config=config)

    def sdpa(self, backend=None):
        return _sdpa(self.q_dense, self.k_dense, self.v_dense, causal=self.q_len > 1,
                     backend=backend)

    def free_dense_copies(self) -> None:
        del self.k_dense, self.v_dense


def _sdpa(q, k, v, causal: bool, backend=None):
    import torch.nn.functional as F

    # Decode: the one query is the last position and sees every key (no mask needed).
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _sdpa_backends(p: Problem, want) -> dict[str, Any]:
    """The fused SDPA backends that run this case (GQA, no expansion) and agree with ``want``."""
    import warnings

    from torch.nn.attention import SDPBackend

    found = {}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = p.sdpa(backend)
        except RuntimeError:
            continue
        if (got.float() - want).abs().max().item() <= 3e-2:
            found[name] = backend
    return found


def _check(p: Problem, res: Result, device: str) -> None:
    """Kernel vs the fp32 reference and vs SDPA on the same data; SystemExit on a mismatch."""
    import torch

    from fkv.ops import reference

    got = p.kernel(validate=True).float()
    ref = reference.paged_attention(p.q, p.cache, p.spec, p.block_table, p.seq_lens,
                                    query_start_loc=p.query_start_loc).float()
    dense = p.sdpa().transpose(1, 2).reshape(p.q.shape).float()
    res.max_err_vs_reference = (got - ref).abs().max().item()
    res.max_err_vs_sdpa = (got - dense).abs().max().item()
    bad = not torch.isfinite(got).all() or res.max_err_vs_reference > 3e-2 or res.max_err_vs_sdpa > 3e-2
    if bad:
        raise SystemExit(f"MISMATCH in {res.name}: max |kernel - reference| "
                         f"{res.max_err_vs_reference:.3g}, max |kernel - SDPA| "
                         f"{res.max_err_vs_sdpa:.3g} (bf16 tolerance 3e-2)")


def _default_config_for(shape: Shape, kind: str, batch: int, tokens: int) -> Any:
    """The launcher's default configuration for one case (as ``paged_attention`` picks it)."""
    import torch

    from fkv.ops.attention import _num_sms, attention_config

    q_tokens = batch if kind == "decode" else batch * tokens
    n = shape.block_size
    return attention_config(num_seqs=batch, num_q_tokens=q_tokens, num_q_heads=shape.num_q_heads,
                            num_kv_heads=shape.num_kv_heads, head_size=shape.head_size,
                            max_context=-(-tokens // n) * n, itemsize=2,
                            num_sms=_num_sms(torch.device("cuda" if torch.cuda.is_available()
                                                          else "cpu")),
                            varlen=kind != "decode")


class Variant(NamedTuple):
    """One timed alternative: a launch configuration plus module-level knobs of the launcher."""

    config: Any
    knobs: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> dict[str, Any]:
        import attrs

        return attrs.asdict(self.config) | dict(self.knobs)


@contextlib.contextmanager
def _knobs(knobs: tuple[tuple[str, Any], ...]):
    """Set ``fkv.ops.attention`` tuning knobs (e.g. ``_HEADS_FIRST``) for the duration."""
    from fkv.ops import attention

    old = {name: getattr(attention, name) for name, _ in knobs}
    try:
        for name, value in knobs:
            setattr(attention, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(attention, name, value)


def _sweep_variants(kind: str, default: Any) -> list[Variant]:
    """The alternatives ``--sweep`` times for one case (the default itself excluded).

    Around the defaults chosen from the H200 sweeps (bench/NOTES.md): decode split counts next
    to the default and other tilings; prefill the neighbours of 256 rows x 64 keys on 8 warps and
    the earlier 128-row defaults; both: the launcher knobs off.
    """
    import attrs

    out = []
    if kind == "decode":
        n = default.num_splits
        for splits in sorted({max(1, n - 1), n + 1, max(1, n // 2), 2 * n}):
            out.append(Variant(attrs.evolve(default, num_splits=splits)))
        for tile, warps, stages in ((128, 4, 2), (64, 4, 2), (32, 4, 2)):
            out.append(Variant(attrs.evolve(default, tile_n=tile, num_warps=warps,
                                            num_stages=stages)))
    else:
        for block_q, tile, warps, stages in ((64, 64, 8, 2), (64, 64, 8, 4), (64, 128, 8, 3),
                                             (64, 32, 8, 3), (32, 64, 4, 3), (32, 32, 4, 3),
                                             (32, 128, 8, 3), (32, 64, 8, 3)):
            out.append(Variant(attrs.evolve(default, block_q=block_q, tile_n=tile,
                                            num_warps=warps, num_stages=stages)))
    out.append(Variant(default, (("_FMA_SCORES", False),)))
    out.append(Variant(default, (("_HEADS_FIRST", False),)))
    base = Variant(default)
    return [v for i, v in enumerate(out) if v != base and v not in out[:i]]


def _case_variants(kind: str, default: Any, sweep: bool) -> list[Variant]:
    return [Variant(default)] + (_sweep_variants(kind, default) if sweep else [])


def _run(res: Result, shape: Shape, ceiling: float, rep: int, device: str,
         sweep: list[dict] | None) -> None:
    import attrs

    q_len = 1 if res.kind == "decode" else res.tokens
    p = Problem(shape, res.layout, res.batch, res.tokens, q_len, device)
    _check(p, res, device)
    res.bytes = p.bytes
    cfg = _default_config_for(shape, res.kind, res.batch, res.tokens)
    res.config = attrs.asdict(cfg)
    from fkv.ops import _attention_gluon

    before = _attention_gluon.launches()
    res.ms = time_ms(lambda: p.kernel(), rep, device)
    # which kernel the default launch ran: the warp-specialized Gluon tile or the Triton kernel
    res.extra["kernel"] = "gluon-ws" if _attention_gluon.launches() > before else "triton"
    if cfg.warp_specialized:  # the Triton kernel on the same tile, same run
        res.extra["triton_tile_ms"] = time_ms(
            lambda: p.kernel(config=attrs.evolve(cfg, warp_specialized=False)), rep, device)
    # Baseline: the fastest fused SDPA backend that runs GQA on this case (default dispatch too).
    want = p.sdpa().float()
    times = {"default": time_ms(lambda: p.sdpa(), rep, device)}
    backends = _sdpa_backends(p, want)
    for name, backend in backends.items():
        times[name] = time_ms(lambda: p.sdpa(backend), rep, device)
    res.extra["sdpa_ms_by_backend"] = times
    res.extra["sdpa_baseline"] = min(times, key=times.get)
    res.sdpa_ms = min(times.values())
    res.extra["ms_repeat"] = time_ms(lambda: p.kernel(), rep, device)  # noise estimate
    if device == "cuda":
        # Replayed in a CUDA graph: no host launch overhead (the engines' decode path).
        best = backends.get(res.extra["sdpa_baseline"])
        res.extra["ms_graph"] = _graph_ms(lambda: p.kernel(), rep)
        res.extra["sdpa_ms_graph"] = _graph_ms(lambda: p.sdpa(best), rep)
    res.gbps, res.sdpa_gbps = p.bytes / res.ms / 1e6, p.bytes / res.sdpa_ms / 1e6
    res.pct_of_read_ceiling = 100 * res.gbps / ceiling
    if res.kind == "decode":
        res.ratio = res.gbps / res.sdpa_gbps
        res.meets_target = res.ratio >= DECODE_TARGET
    else:
        res.ratio = res.ms / res.sdpa_ms
        res.meets_target = res.ratio <= PREFILL_TARGET
        flops = 4 * res.batch * shape.num_q_heads * shape.head_size * res.tokens * (res.tokens + 1) / 2
        res.extra["tflops"] = flops / res.ms / 1e9
        res.extra["sdpa_tflops"] = flops / res.sdpa_ms / 1e9
    if sweep is not None:
        p.free_dense_copies()
        _sweep(p, res, cfg, rep, device, sweep)
    del p


def _graph_ms(fn, rep: int) -> float:
    import triton.testing

    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def _sweep(p: Problem, res: Result, default: Any, rep: int, device: str, rows: list[dict]) -> None:
    """Time every variant; each is checked against the default's output first."""
    want = p.kernel().float().clone()
    best = (res.ms, "default")
    for var in _sweep_variants(res.kind, default):
        row: dict[str, Any] = {"case": res.name, "variant": var.describe()}
        try:
            with _knobs(var.knobs):
                err = (p.kernel(config=var.config).float() - want).abs().max().item()
                ms = time_ms(lambda: p.kernel(config=var.config), max(10, rep // 4), device)
        except Exception as e:  # a variant that does not fit (shared memory, registers): record it
            rows.append(row | {"error": str(e)[:200]})
            continue
        gbps = p.bytes / ms / 1e6
        row |= {"ms": ms, "gbps": gbps, "max_err_vs_default": err,
                "speedup_vs_default": res.ms / ms}
        rows.append(row)
        if err > 3e-2:
            row["error"] = "MISMATCH vs default output"
        elif ms < best[0]:
            best = (ms, var.describe())
        print(f"  sweep {res.name}: {var.describe()} {ms:.3f} ms {gbps:.0f} GB/s "
              f"x{res.ms / ms:.3f} err {err:.2g}", flush=True)
    res.extra["sweep_best"] = {"ms": best[0], "variant": best[1],
                               "speedup_vs_default": res.ms / best[0]}


def _compile_task(task: tuple) -> str:
    """Worker of ``--jobs``: build one case's cache and run each variant once (fills Triton's
    on-disk cache, so the timing process only loads compiled kernels)."""
    shape, kind, batch, tokens, layout, variants, device = task
    import torch

    q_len = 1 if kind == "decode" else tokens
    p = Problem(shape, layout, batch, tokens, q_len, device, dense=False)
    errors = []
    for var in variants:
        try:
            with _knobs(var.knobs):
                p.kernel(config=var.config)
        except Exception as e:
            errors.append(f"{var.describe()}: {str(e)[:120]}")
    if device == "cuda":
        torch.cuda.synchronize()
    return f"compiled {kind} B={batch} x {tokens} {layout}: {len(variants)} variants" + (
        f", errors: {errors}" if errors else "")


def _precompile(cases: list[Result], shape: Shape, sweep: bool, jobs: int, device: str) -> None:
    """Compile every variant the run will time in ``jobs`` processes (spawned, CUDA each)."""
    import multiprocessing
    import time

    tasks = []
    for res in cases:
        default = _default_config_for(shape, res.kind, res.batch, res.tokens)
        variants = _case_variants(res.kind, default, sweep)
        for i in range(0, len(variants), 3):
            tasks.append((shape, res.kind, res.batch, res.tokens, res.layout, variants[i:i + 3],
                          device))
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(jobs, len(tasks))) as pool:
        for msg in pool.imap_unordered(_compile_task, tasks):
            print(msg, flush=True)
    print(f"precompiled {len(tasks)} tasks in {time.perf_counter() - start:.1f} s", flush=True)


def _table(cases: list[Result], ceiling: float) -> str:
    lines = [f"paged_attention (read ceiling {ceiling:.0f} GB/s; baseline = torch SDPA on dense "
             f"K/V, same run; graph = both replayed in CUDA graphs)",
             f"{'case':32s} {'ms':>8s} {'GB/s':>7s} {'SDPA ms':>8s} {'SDPA GB/s':>9s} "
             f"{'ratio':>6s} {'%read':>6s} {'graph':>6s} target"]
    for r in cases:
        target = (f">= {DECODE_TARGET}x dense" if r.kind == "decode"
                  else f"<= {PREFILL_TARGET}x dense time")
        g = r.extra.get("ms_graph")
        graph = 0.0
        if g:
            graph = r.extra["sdpa_ms_graph"] / g if r.kind == "decode" else g / r.extra["sdpa_ms_graph"]
        lines.append(f"{r.name:32s} {r.ms:8.3f} {r.gbps:7.0f} {r.sdpa_ms:8.3f} {r.sdpa_gbps:9.0f} "
                     f"{r.ratio:6.3f} {r.pct_of_read_ceiling:5.1f}% {graph:6.3f} "
                     f"{'OK ' if r.meets_target else 'MISS'} ({target})")
    return "\n".join(lines)


_EXTRA_METRICS = {"ms_repeat": "repeat_ms", "ms_graph": "graph_ms", "sdpa_ms_graph": "sdpa_graph_ms",
                  "tflops": "tflops", "sdpa_tflops": "sdpa_tflops",
                  "triton_tile_ms": "triton_tile_ms"}


def to_run(done: list[Result], shape: Shape, ceiling: float, device: str,
           config: dict[str, Any] | None = None, env: dict[str, Any] | None = None,
           sweep: list[dict] | None = None) -> results.Run:
    """The result file of a run: one case per ``Result`` (id = ``Result.name``). The ratio to
    dense SDPA is ``gbps_vs_sdpa_x`` for decode (higher is better) and ``time_vs_sdpa_x`` for
    prefill (lower is better)."""
    run = results.Run("attention", env=env, device=device, config={
        "shape": asdict(shape), **(config or {}),
        "targets": {"decode": f">= {DECODE_TARGET}x dense SDPA GB/s",
                    "prefill": f"<= {PREFILL_TARGET}x dense causal SDPA time"}})
    run.ceiling("read_gbps", ceiling)
    for r in done:
        ratio = "gbps_vs_sdpa_x" if r.kind == "decode" else "time_vs_sdpa_x"
        metrics = {"ms": r.ms, "gbps": r.gbps, "sdpa_ms": r.sdpa_ms, "sdpa_gbps": r.sdpa_gbps,
                   ratio: r.ratio, "pct_of_read_ceiling": r.pct_of_read_ceiling,
                   "reference_max_err": r.max_err_vs_reference, "sdpa_max_err": r.max_err_vs_sdpa}
        metrics |= {new: r.extra[old] for old, new in _EXTRA_METRICS.items() if old in r.extra}
        extra = {k: v for k, v in r.extra.items() if k not in _EXTRA_METRICS}
        run.add(r.name, params={"kind": r.kind, "batch": r.batch, "tokens": r.tokens,
                                "layout": r.layout, "bytes": r.bytes},
                metrics=metrics, extra={"meets_target": r.meets_target, "config": r.config,
                                        **extra})
    if sweep is not None:
        run.extra["sweep"] = sweep
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fkv bench attention", description=__doc__.split("\n")[0])
    results.add_output_arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help="one decode shape (B=64 x 8192) and the prefill case, shorter timing")
    parser.add_argument("--sweep", action="store_true",
                        help="also time other tiles/warps/stages/splits/grid order (best per case)")
    parser.add_argument("--jobs", type=non_negative_int, default=None,
                        help="compile every timed variant first in this many processes (default: "
                             "min(12, CPUs) on CUDA, 0 = compile in the timing process on CPU)")
    parser.add_argument("--compile-only", action="store_true",
                        help="precompile (with --jobs) and exit: run it alongside other work")
    add_cpu_smoke_argument(parser)
    args = parse_args(parser, argv)  # before triton is first imported

    import torch

    if args.cpu_smoke:
        device, rep, ceiling_bytes = "cpu", 1, 16 << 20
        shape = Shape(num_q_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                      decode=((2, 100), (1, 300)), prefill=(2, 40))
    elif torch.cuda.is_available():
        device, rep, ceiling_bytes = "cuda", 40 if args.quick else 100, 2 << 30
        shape = Shape()
    else:
        print("fkv bench attention needs a CUDA device (--cpu-smoke runs the code path on CPU)",
              file=sys.stderr)
        return 2
    if args.quick:
        shape.decode = shape.decode[:1]
    cases = [Result("decode", b, ctx, layout) for b, ctx in shape.decode for layout in ("NHD", "HND")]
    cases += [Result("prefill", shape.prefill[0], shape.prefill[1], layout) for layout in ("NHD", "HND")]
    jobs = args.jobs if args.jobs is not None else (min(12, os.cpu_count() or 1)
                                                    if device == "cuda" else 0)
    if jobs > 0 or args.compile_only:
        _precompile(cases, shape, args.sweep, max(1, jobs), device)
    if args.compile_only:
        return 0
    ceiling = read_ceiling_gbps(rep, device, ceiling_bytes)
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    sweep: list[dict] | None = [] if args.sweep else None
    done: list[Result] = []
    path, created = None, None
    config = {"mode": "cpu-smoke" if args.cpu_smoke else "cuda", "quick": args.quick,
              "sweep": args.sweep, "rep": rep}
    env = results.environment(device)
    for res in cases:
        _run(res, shape, ceiling, rep, device, sweep)
        done.append(res)
        graph = ""
        if "ms_graph" in res.extra:
            graph = f"; graph {res.extra['ms_graph']:.3f} ms vs SDPA {res.extra['sdpa_ms_graph']:.3f}"
        print(f"{res.name}: {res.ms:.3f} ms, {res.gbps:.0f} GB/s, x{res.ratio:.3f} vs SDPA "
              f"({res.sdpa_gbps:.0f} GB/s, {res.extra['sdpa_baseline']}), err vs ref "
              f"{res.max_err_vs_reference:.2g}{graph}", flush=True)
        # after every case, into the same file: a run cut short keeps what it measured
        run = to_run(done, shape, ceiling, device, config, env, sweep)
        run.created = created = created or run.created   # one run, one timestamp: its file name
        if path is None:
            path = results.save(run, args, by_default=not args.cpu_smoke)
        else:
            results.write(run, json_path=path)
        if device == "cuda":
            torch.cuda.empty_cache()
    print(_table(cases, ceiling))
    if args.plot:
        from fkv.bench import plots

        plots.plot_attention(to_run(done, shape, ceiling, device, config, env).to_file(), args.plot)
        print(f"plot: {args.plot}")
    return 0
