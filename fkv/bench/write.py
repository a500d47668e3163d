"""Benchmark ``fkv.ops.write_kv`` (H200 targets; method in docs/benchmarks.md), results to bench/results/.

Cases: prefill 65536 and 8192 tokens (runs of consecutive slots in random blocks), decode 256
tokens (random slots); NHD and HND; bf16 cache, and fp8 (e4m3fn) cache fed bf16 with per-tensor
scales. 32768 blocks, N=16, H=8, D=128. Bytes = key + value read + cache bytes written.

Every case is checked byte-for-byte against ``fkv.ops.reference.write_kv`` (cache poisoned first)
before timing. Reported per case: GB/s, % of a device copy ceiling measured in the same run, and
the ratio to a torch ``index_put_`` baseline timed in the same run. Decode also reports the eager
cost per call with the launch overhead included (a back-to-back loop), and the replay cost inside
CUDA graphs (one call per graph, and per call in a graph of many calls), beside an engine-style
kernel (``fkv.bench._engine_style``) in the same graphs; and once more with every decode graph
captured inside ``fkv.ops.graph_primer()`` in a fresh child process (``primed_decode``: the
graph state the primer gives; ``write_kv``'s bytes checked against the reference there too).

    python bench/bench_write.py                              # full run (CUDA) -> bench/results/
    python bench/bench_write.py --json write.json --plot write.png
    python bench/bench_write.py --quick                      # fewer cases, shorter timing
    python bench/bench_write.py --sweep                      # also try other tile sizes/warps
    python bench/bench_write.py --cpu-smoke                  # tiny shapes on the CPU interpreter:
                                                             # correctness path only, no timing
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from fkv.bench import results
from fkv.bench._common import (Cycle, add_cpu_smoke_argument, copy_ceiling_gbps, eager_us,
                               graph_us, parse_args, settle_graphs, time_ms)

__all__ = ["main"]

L2_ROTATE_BYTES = 512 << 20  # inputs rotated through at least this many bytes (H200 L2: 50 MB)


@dataclass
class Shape:
    num_blocks: int = 32768
    block_size: int = 16
    heads: int = 8
    head_size: int = 128
    prefill: tuple[int, ...] = (65536, 8192)
    decode: int = 256


@dataclass
class Case:
    kind: str          # "prefill" | "decode"
    tokens: int
    layout: str
    dtype: str         # cache dtype
    bytes: int = 0
    ms: float = 0.0
    gbps: float = 0.0
    pct_of_copy: float = 0.0
    baseline_ms: float = 0.0
    baseline_gbps: float = 0.0
    speedup_vs_baseline: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.kind} {self.tokens} {self.layout} {self.dtype}"


def _slot_sets(kind: str, tokens: int, shape: Shape, count: int, device: str, seed: int) -> list:
    """Slot mappings: prefill = whole runs of consecutive slots in random blocks (sequences that
    start at a random offset of their first block); decode = one random slot per token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n, nb = shape.block_size, shape.num_blocks
    out = []
    for _ in range(count):
        if kind == "prefill":
            start = int(torch.randint(0, n, (1,), generator=g))
            blocks = torch.randperm(nb, generator=g)[: (start + tokens + n - 1) // n]
            slots = (blocks[:, None] * n + torch.arange(n)).flatten()[start:start + tokens]
        else:
            blocks = torch.randperm(nb, generator=g)[:tokens]
            slots = blocks * n + torch.randint(0, n, (tokens,), generator=g)
        out.append(slots.to(device))
    return out


def _inputs(spec, tokens: int, count: int, device: str, seed: int) -> list:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    shape = (tokens, spec.num_kv_heads, spec.head_size)
    return [(torch.randn(shape, generator=g, device=device).bfloat16(),
             torch.randn(shape, generator=g, device=device).bfloat16()) for _ in range(count)]


def _poison(cache) -> None:
    import torch

    bits = cache.view({1: torch.int8, 2: torch.int16}[cache.element_size()])
    bits.copy_(torch.randint(-100, 100, bits.shape, dtype=bits.dtype, device=bits.device))


def _torch_baseline(spec, cache):
    """The same-run baseline: torch ``index_put_`` into the K and V halves (fp8: x / scale cast).

    Views are built once here; per call it only does slot arithmetic, the cast and index_put_.
    """
    import torch

    axes = spec.logical_axes
    view = cache.permute([axes.index(a) for a in ("two", "B", "N", "H", "C")])
    bits_dtype = torch.uint8 if spec.is_fp8 else torch.int16
    k_half, v_half = view[0].view(bits_dtype), view[1].view(bits_dtype)
    n = spec.block_size
    target = cache.dtype

    def run(key, value, slots, k_scale=None, v_scale=None):
        block, offset = slots // n, slots % n
        if k_scale is not None:
            key, value = (key.float() / k_scale).to(target), (value.float() / v_scale).to(target)
        k_half.index_put_((block, offset), key.view(bits_dtype))
        v_half.index_put_((block, offset), value.view(bits_dtype))

    return run


def _check_case(spec, kind: str, tokens: int, shape: Shape, device: str) -> None:
    """Kernel and baseline against the reference, byte for byte, on poisoned caches."""
    import torch

    import fkv
    from fkv.ops import reference, write_kv

    (key, value), = _inputs(spec, tokens, 1, device, seed=123)
    slots = _slot_sets(kind, tokens, shape, 1, device, seed=123)[0]
    scales = _scales(spec, device)
    outs = []
    for fn in ("kernel", "reference", "baseline"):
        (cache,) = fkv.allocate(spec, device=device)
        torch.manual_seed(0)
        _poison(cache)
        if fn == "kernel":
            write_kv(key, value, cache, slots, spec, validate=False, **scales)
        elif fn == "reference":
            reference.write_kv(key, value, cache, slots, spec, validate=False, **scales)
        else:
            _torch_baseline(spec, cache)(key, value, slots, **scales)
        outs.append(cache.view(torch.uint8) if spec.is_fp8 else cache.view(torch.int16))
        del cache
    for name, out in zip(("write_kv", "torch baseline"), (outs[0], outs[2])):
        if not torch.equal(out, outs[1]):
            bad = int((out != outs[1]).sum())
            raise SystemExit(f"MISMATCH: {name} differs from fkv.ops.reference.write_kv in {bad} "
                             f"elements ({kind} {tokens} tokens, {spec!r})")


def _scales(spec, device: str) -> dict:
    import torch

    if not spec.is_fp8:
        return {}
    return {"k_scale": torch.tensor([0.05], device=device),
            "v_scale": torch.tensor([0.04], device=device)}


def _graph_us(make_call, sets: list, rep: int) -> tuple[float, float]:
    """(µs per replay of a one-call graph, µs per call inside a graph of len(sets) calls)."""
    return graph_us([make_call(sets[0])], rep), graph_us([make_call(x) for x in sets], rep)


def _run_case(case: Case, shape: Shape, ceiling: float, rep: int, device: str = "cuda") -> None:
    import fkv
    from fkv.ops import write_kv

    spec = fkv.KVCacheSpec(layout=case.layout, num_blocks=shape.num_blocks,
                           block_size=shape.block_size, num_kv_heads=shape.heads,
                           head_size=shape.head_size, dtype=case.dtype)
    _check_case(spec, case.kind, case.tokens, shape, device)
    per_token = 2 * shape.heads * shape.head_size
    case.bytes = case.tokens * per_token * (2 + spec.itemsize)
    count = max(2, min(64, -(-L2_ROTATE_BYTES // case.bytes)))
    if device != "cuda":
        count = 2
    data = _inputs(spec, case.tokens, count, device, seed=1)
    slots = _slot_sets(case.kind, case.tokens, shape, count, device, seed=2)
    sets = [(k, v, s) for (k, v), s in zip(data, slots)]
    scales = _scales(spec, device)
    (cache,) = fkv.allocate(spec, device=device)
    _poison(cache)
    baseline = _torch_baseline(spec, cache)

    def kernel_call(item):
        k, v, s = item
        return lambda: write_kv(k, v, cache, s, spec, validate=False, **scales)

    def baseline_call(item):
        k, v, s = item
        return lambda: baseline(k, v, s, **scales)

    def pdl_call(item):
        k, v, s = item
        return lambda: write_kv(k, v, cache, s, spec, validate=False, pdl=True, **scales)

    cyc = Cycle(sets)
    case.ms = time_ms(lambda: kernel_call(cyc.next())(), rep, device)
    case.baseline_ms = time_ms(lambda: baseline_call(cyc.next())(), rep, device)
    case.gbps = case.bytes / case.ms / 1e6
    case.baseline_gbps = case.bytes / case.baseline_ms / 1e6
    case.pct_of_copy = 100 * case.gbps / ceiling
    case.speedup_vs_baseline = case.baseline_ms / case.ms
    calls = 2000 if case.kind == "decode" else 200
    case.extra["kernel_us"] = case.ms * 1e3
    case.extra["eager_us"] = eager_us([kernel_call(x) for x in sets], device, calls)
    case.extra["eager_gbps"] = case.bytes / case.extra["eager_us"] / 1e3
    case.extra["baseline_eager_us"] = eager_us([baseline_call(x) for x in sets], device, calls)
    if case.kind == "decode" and device == "cuda":
        from fkv.bench._engine_style import engine_style_call

        graph_sets = sets[: min(len(sets), GRAPH_CALLS)]
        case.extra["graph1_us"], case.extra["graph_per_call_us"] = _graph_us(
            kernel_call, graph_sets, rep)
        case.extra["engine_graph_per_call_us"] = graph_us(
            [engine_style_call(spec, cache, k, v, s, scales) for k, v, s in graph_sets], rep)
        case.extra.update(_decode_graph_variants(kernel_call, pdl_call, graph_sets, rep, device))
        try:
            case.extra["baseline_graph_per_call_us"] = _graph_us(baseline_call, graph_sets, rep)[1]
        except RuntimeError as e:  # the baseline is not ours to make capturable
            case.extra["baseline_graph_per_call_us"] = None
            case.extra["baseline_graph_error"] = str(e).splitlines()[0]
    _judge(case)
    del cache, data, slots, sets


GRAPH_CALLS = 32  # decode calls per timed graph (input sets rotate through them)
PRIMED_TIMEOUT_S = 900  # the primed child's whole run (compiles, captures, checks, timings)


def _decode_setup(case: Case, shape: Shape, device: str) -> tuple[Any, Any, list, dict]:
    """(spec, a poisoned cache, ``GRAPH_CALLS`` input sets (key, value, slots), scales) of a
    decode case, seeded as ``_run_case`` seeds them."""
    import fkv

    spec = fkv.KVCacheSpec(layout=case.layout, num_blocks=shape.num_blocks,
                           block_size=shape.block_size, num_kv_heads=shape.heads,
                           head_size=shape.head_size, dtype=case.dtype)
    data = _inputs(spec, case.tokens, GRAPH_CALLS, device, seed=1)
    slots = _slot_sets(case.kind, case.tokens, shape, GRAPH_CALLS, device, seed=2)
    (cache,) = fkv.allocate(spec, device=device)
    _poison(cache)
    return spec, cache, [(k, v, s) for (k, v), s in zip(data, slots)], _scales(spec, device)


def primed_decode(names: list[str], shape: Shape, rep: int) -> dict[str, dict[str, Any]]:
    """The decode cases ``names`` with every graph captured inside one
    :func:`fkv.ops.graph_primer` block, as the library documents the recipe: this must be the
    process's first capture (``fkv bench write`` runs it in a child process, ``_primed_child``).

    Per case, two graphs of ``GRAPH_CALLS`` calls over rotating inputs: ``write_kv`` and the
    engine-style kernel (``fkv.bench._engine_style``). After the primer has launched, the
    ``write_kv`` graph is replayed once on its poisoned cache and the cache compared byte for
    byte with ``fkv.ops.reference.write_kv`` applied to a copy in the same order (a mismatch
    raises); then every graph is timed three times, interleaved over all graphs of all cases
    (do_bench medians), and each figure is the median of its three. Returns, per case name,
    ``graph_per_call_primed_us``, ``engine_graph_per_call_primed_us`` and the rounds."""
    import statistics

    import torch
    import triton.testing

    import fkv.ops
    from fkv.bench._common import capture_graph
    from fkv.bench._engine_style import engine_style_call
    from fkv.ops import reference, write_kv

    todo = []
    with fkv.ops.graph_primer():
        for name in names:
            kind, tokens, layout, dtype = name.split()
            case = Case(kind, int(tokens), layout, dtype)
            spec, cache, sets, scales = _decode_setup(case, shape, "cuda")
            own = capture_graph([(lambda k=k, v=v, s=s: write_kv(k, v, cache, s, spec,
                                                                 validate=False, **scales))
                                 for k, v, s in sets])
            engine = capture_graph([engine_style_call(spec, cache, k, v, s, scales)
                                    for k, v, s in sets])
            todo.append((name, spec, cache, sets, scales, own, engine))
    for name, spec, cache, sets, scales, own, _ in todo:
        before = cache.clone()
        own.replay()
        for k, v, s in sets:
            reference.write_kv(k, v, before, s, spec, validate=False, **scales)
        torch.cuda.synchronize()
        ints = torch.int8 if spec.itemsize == 1 else torch.int16
        bad = int((cache.view(ints) != before.view(ints)).sum())
        if bad:
            raise SystemExit(f"MISMATCH: the primed write_kv graph differs from "
                             f"fkv.ops.reference.write_kv in {bad} elements ({name})")
        del before
    rounds: dict[tuple[str, str], list[float]] = {}
    for _ in range(3):
        for name, *_, own, engine in todo:
            for what, graph in (("own", own), ("engine", engine)):
                us = triton.testing.do_bench(graph.replay, rep=rep, return_mode="median") * 1e3
                rounds.setdefault((name, what), []).append(us / GRAPH_CALLS)
    return {name: {"graph_per_call_primed_us": statistics.median(rounds[name, "own"]),
                   "engine_graph_per_call_primed_us": statistics.median(rounds[name, "engine"]),
                   "primed_rounds_us": rounds[name, "own"],
                   "engine_primed_rounds_us": rounds[name, "engine"]}
            for name, *_ in todo}


def _primed_child(request: str) -> None:
    """Child-process entry of :func:`primed_decode`: ``request`` is JSON ``{"names", "shape",
    "rep"}``; the answer is one JSON line on stdout, prefixed ``PRIMED ``."""
    import json

    req = json.loads(request)
    out = primed_decode(req["names"], Shape(**{k: tuple(v) if isinstance(v, list) else v
                                               for k, v in req["shape"].items()}), req["rep"])
    print("PRIMED " + json.dumps(out), flush=True)


def _run_primed(cases: list[Case], shape: Shape, rep: int) -> None:
    """:func:`primed_decode` for the decode cases of ``cases`` in a fresh process (whose first
    graph capture is the primer's); its figures go into each case's ``extra``, or
    ``primed_error`` when the child failed."""
    import json
    import subprocess

    decode = [c for c in cases if c.kind == "decode"]
    if not decode:
        return
    request = json.dumps({"names": [c.name for c in decode], "shape": asdict(shape), "rep": rep})
    code = f"from fkv.bench.write import _primed_child; _primed_child({request!r})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=PRIMED_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess([], None, "", f"no answer in {PRIMED_TIMEOUT_S} s")
    mismatch = [line for line in proc.stderr.splitlines() if line.startswith("MISMATCH: ")]
    if mismatch:  # wrong bytes stop the bench, as in the parent's own checks
        raise SystemExit(mismatch[-1])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PRIMED ")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        exited = "timed out" if proc.returncode is None else f"exited {proc.returncode}"
        error = f"child {exited}: {' | '.join(tail)}"
        print(f"  primed decode graphs: {error}", file=sys.stderr, flush=True)
        for c in decode:
            c.extra["primed_error"] = error
        return
    found = json.loads(lines[-1][len("PRIMED "):])
    for c in decode:
        c.extra.update(found[c.name])
        print(f"  {c.name}: primed graph {found[c.name]['graph_per_call_primed_us']:.2f} us "
              f"per call (engine-style "
              f"{found[c.name]['engine_graph_per_call_primed_us']:.2f})", flush=True)


def _decode_graph_variants(kernel_call, pdl_call, sets: list, rep: int, device: str
                           ) -> dict[str, float]:
    """Per call in a graph of ``len(sets)`` calls: with ``pdl=True``; one input set in every call
    (L2-warm, what replaying one decode step measures); and each call after a plain 1 MiB
    elementwise kernel (what a rotary embedding is before an engine's cache write), as the pair's
    time minus the plain kernel's alone, with and without PDL."""
    import torch

    plain = [torch.ones(1 << 19, dtype=torch.bfloat16, device=device) for _ in sets]
    plain_calls = [(lambda b=b: b.mul_(1.0)) for b in plain]
    alone = graph_us(plain_calls, rep)
    out = {"graph_per_call_pdl_us": graph_us([pdl_call(x) for x in sets], rep),
           "graph_per_call_warm_us": graph_us([kernel_call(sets[0])] * len(sets), rep),
           "graph_per_call_warm_pdl_us": graph_us([pdl_call(sets[0])] * len(sets), rep),
           "plain_kernel_us": alone}
    for key, make in (("after_plain_us", kernel_call), ("after_plain_pdl_us", pdl_call)):
        pairs = [c for x, p in zip(sets, plain_calls, strict=True) for c in (p, make(x))]
        out[key] = graph_us(pairs, rep) * 2 - alone
    return out


# Targets on an H200 (docs/benchmarks.md) (bf16; fp8 cases are judged by the same numbers for reference).
TARGETS = {("prefill", 65536): 3600.0, ("prefill", 8192): 2500.0}
DECODE_TARGET_US = {"eager_us": 8.0, "graph_per_call_us": 2.2}


def _judge(case: Case) -> None:
    if case.kind == "prefill" and (case.kind, case.tokens) in TARGETS:
        target = TARGETS[(case.kind, case.tokens)]
        case.extra["target"] = f">= {target:.0f} GB/s"
        case.extra["meets_target"] = case.gbps >= target
    elif case.kind == "decode" and all(k in case.extra for k in DECODE_TARGET_US):
        case.extra["target"] = "eager <= 8 us/call, <= 2.2 us per call replayed in a graph"
        case.extra["meets_target"] = all(case.extra[k] <= v for k, v in DECODE_TARGET_US.items())


def _set_constants(tile: int, tile_fp8: int, per_warp: int, store: str) -> None:
    """Set write_kv's tiling/store constants and drop everything cached from the old ones (the
    per-signature launch sites hold the constexprs they were made with)."""
    from fkv.ops import write as write_mod

    write_mod._TILE_ELEMENTS, write_mod._TILE_ELEMENTS_FP8 = tile, tile_fp8
    write_mod._ELEMENTS_PER_WARP = per_warp
    write_mod._STORE_MODIFIER = store
    write_mod.write_tiling.cache_clear()
    write_mod.write_constexprs.cache_clear()
    write_mod._PREPARED.clear()


def _sweep(shape: Shape, ceiling: float, rep: int, device: str) -> list[dict]:
    """Prefill throughput over tile sizes, warps and the store cache modifier (bf16 and fp8)."""
    from fkv.ops import write as write_mod

    saved = (write_mod._TILE_ELEMENTS, write_mod._TILE_ELEMENTS_FP8, write_mod._ELEMENTS_PER_WARP,
             write_mod._STORE_MODIFIER)
    configs = [(8192, 2048, ""), (16384, 2048, ""), (16384, 4096, ""), (32768, 4096, ""),
               (8192, 2048, ".cs"), (16384, 4096, ".cs")]
    rows = []
    try:
        for tile, per_warp, store in configs:
            _set_constants(tile, tile, per_warp, store)
            for tokens, layout, dtype in [(shape.prefill[0], "NHD", "bfloat16"),
                                          (shape.prefill[0], "HND", "bfloat16"),
                                          (shape.prefill[0], "HND", "float8_e4m3fn")]:
                case = Case("prefill", tokens, layout, dtype)
                _run_case(case, shape, ceiling, max(20, rep // 4), device)
                rows.append({"tile_elements": tile, "elements_per_warp": per_warp,
                             "store": store, "tokens": tokens, "layout": layout, "dtype": dtype,
                             "gbps": case.gbps, "eager_gbps": case.extra["eager_gbps"]})
                print(f"  sweep tile={tile:5d} per_warp={per_warp:4d} store={store or '-':3s} "
                      f"{tokens:6d} {layout} {dtype:13s}: {case.gbps:7.0f} GB/s "
                      f"(eager {case.extra['eager_gbps']:5.0f})", flush=True)
    finally:
        _set_constants(*saved)
    return rows


def _host_profile(device: str) -> dict[str, float]:
    """µs per call of the pieces of a decode write_kv's host path (the host's speed matters: the
    same code costs more on a slower host), printed as a table and returned for the JSON."""
    import time

    import torch

    import fkv
    from fkv.ops import _launch, write as write_mod

    spec = fkv.KVCacheSpec(num_blocks=1024, block_size=16, num_kv_heads=8, head_size=128)
    (cache,) = fkv.allocate(spec, device=device)
    key = torch.randn(256, 8, 128, device=device).bfloat16()
    value = torch.randn(256, 8, 128, device=device).bfloat16()
    slots = torch.randperm(spec.num_blocks * spec.block_size, device=device)[:256]
    small = torch.zeros(16, device=device)
    for _ in range(3):  # the first calls launch normally and keep the compiled variant
        write_mod.write_kv(key, value, cache, slots, spec, validate=False)
    prep = write_mod._PREPARED[write_mod._signature(key, value, cache, slots, spec, None, None)]
    args = (key, value, cache, slots, key, key, 256)
    grid = (32, 2, 1)

    def per_call(fn, n=20000):
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        if device != "cuda":  # --cpu-smoke: the interpreter runs every launch, keep it short
            n = 3
        for _ in range(min(n, 200)):
            fn()
        best = float("inf")
        for _ in range(3):
            sync()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best = min(best, (time.perf_counter() - start) * 1e6 / n)
        return best

    def normal():
        prep.site.normal(grid, args)

    def one(k, v, s):
        return lambda: write_mod.write_kv(k, v, cache, s, spec, validate=False)

    rotating = [one(torch.randn_like(key), torch.randn_like(value), slots.roll(i))
                for i in range(64)]

    def fast_off():
        _launch.ENABLED = False
        try:
            write_mod.write_kv(key, value, cache, slots, spec, validate=False)
        finally:
            _launch.ENABLED = True

    direct = {}
    if prep.site.variants:  # Triton's compiled launcher alone, arguments prepared in advance
        (run, function, packed, _), = list(prep.site.variants.values())[:1]
        stream = torch.cuda.current_stream().cuda_stream
        ptrs = [a.data_ptr() for a in args[:6]]
        full = (*ptrs, 256, *prep.site.fixed)
        direct["Triton compiled launcher alone (ints)"] = per_call(
            lambda: run(32, 2, 1, stream, function, packed, None, None, None, *full), 5000)
        full_t = (*args, *prep.site.fixed)
        direct["Triton compiled launcher alone (tensors)"] = per_call(
            lambda: run(32, 2, 1, stream, function, packed, None, None, None, *full_t), 5000)
    rows = {
        **direct,
        "python call (empty function)": per_call(lambda: None),
        "tensor.stride()": per_call(key.stride),
        "tensor.data_ptr()": per_call(key.data_ptr),
        "tensor.shape[1:]": per_call(lambda: key.shape[1:]),
        "tensor.device": per_call(lambda: key.device),
        "torch op (small.add_(1))": per_call(lambda: small.add_(1), 5000),
        "write_kv _signature": per_call(lambda: write_mod._signature(key, value, cache, slots, spec,
                                                                      None, None)),
        "launch site key (data_ptr()s included)": per_call(lambda: prep.site.launcher.key(
            0, [a.data_ptr() for a in args[:6]], args)),
        "direct launch (site call)": per_call(lambda: prep.site(grid, args), 5000),
        "write_kv, direct launch": per_call(lambda: write_mod.write_kv(
            key, value, cache, slots, spec, validate=False), 5000),
        "write_kv, direct, 64 rotating inputs": eager_us(rotating, device, 5000),
        "Triton normal launch (kernel[grid])": per_call(normal, 2000),
        "write_kv, FKV fast launch off": per_call(fast_off, 2000),
    }
    print("host path, µs per call (best of 3):")
    for name, us in rows.items():
        print(f"  {name:38s} {us:7.2f}")
    return rows


def _cases(shape: Shape, quick: bool) -> list[Case]:
    dtypes = ("bfloat16", "float8_e4m3fn")
    cases = []
    for dtype in dtypes:
        for tokens in shape.prefill[:1] if quick and dtype != "bfloat16" else shape.prefill:
            for layout in ("NHD", "HND"):
                cases.append(Case("prefill", tokens, layout, dtype))
        for layout in ("NHD", "HND"):
            cases.append(Case("decode", shape.decode, layout, dtype))
    return cases


def _table(cases: list[Case], ceiling: float) -> str:
    lines = [f"write_kv (copy ceiling {ceiling:.0f} GB/s; baseline = torch index_put_; eager = "
             f"back-to-back calls, host included)",
             f"{'case':34s} {'GB/s':>7s} {'%copy':>6s} {'x base':>7s} {'base GB/s':>9s} "
             f"{'eager':>6s}  µs/call"]
    for c in cases:
        e = c.extra
        dec = f"eager {e['eager_us']:.1f} (torch {e['baseline_eager_us']:.1f}), kernel {e['kernel_us']:.1f}"
        if "graph1_us" in e:
            dec += (f", graph {e['graph1_us']:.1f}, per call in a graph "
                    f"{e['graph_per_call_us']:.2f} (engine-style "
                    f"{e['engine_graph_per_call_us']:.2f})")
        if "graph_per_call_primed_us" in e:
            dec += (f", primed {e['graph_per_call_primed_us']:.2f} (engine-style "
                    f"{e['engine_graph_per_call_primed_us']:.2f})")
        if "graph_per_call_pdl_us" in e:
            dec += (f" (pdl {e['graph_per_call_pdl_us']:.2f}; one input set "
                    f"{e['graph_per_call_warm_us']:.2f}, pdl {e['graph_per_call_warm_pdl_us']:.2f};"
                    f" after a plain kernel {e['after_plain_us']:.2f}, pdl "
                    f"{e['after_plain_pdl_us']:.2f})")
        lines.append(f"{c.name:34s} {c.gbps:7.0f} {c.pct_of_copy:5.1f}% {c.speedup_vs_baseline:6.2f}x "
                     f"{c.baseline_gbps:9.0f} {e['eager_gbps']:6.0f}  {dec}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fkv bench write", description=__doc__.split("\n")[0])
    results.add_output_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="fewer cases, shorter timing")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep tile sizes and warps on the prefill cases")
    parser.add_argument("--host-profile", action="store_true",
                        help="also time the pieces of the decode host path")
    parser.add_argument("--only", metavar="SUBSTR", default="",
                        help="run only the cases whose name contains this (e.g. 'decode')")
    add_cpu_smoke_argument(parser)
    args = parse_args(parser, argv)  # before triton is first imported

    import torch

    if args.cpu_smoke:
        device, rep, ceiling_bytes = "cpu", 1, 16 << 20
        shape = Shape(num_blocks=64, block_size=16, heads=2, head_size=32, prefill=(200, 48),
                      decode=16)
    elif torch.cuda.is_available():
        device, rep, ceiling_bytes = "cuda", 40 if args.quick else 200, 1 << 30
        shape = Shape()
    else:
        print("fkv bench write needs a CUDA device (--cpu-smoke runs the code path on CPU)",
              file=sys.stderr)
        return 2
    if device == "cuda":
        settle_graphs()  # every decode case's graphs in the same state (settle_graphs)
    host = _host_profile(device) if args.host_profile else {}
    ceiling = copy_ceiling_gbps(rep, device, ceiling_bytes)
    cases = [c for c in _cases(shape, args.quick) if args.only in c.name]
    if device == "cuda":
        _run_primed(cases, shape, rep)
    for case in cases:
        _run_case(case, shape, ceiling, rep, device)
        print(f"  {case.name}: {case.gbps:.0f} GB/s ({case.pct_of_copy:.1f}% of copy, "
              f"{case.speedup_vs_baseline:.2f}x torch)", flush=True)
    sweep = _sweep(shape, ceiling, rep, device) if args.sweep else []
    run = to_run(cases, shape, ceiling, device,
                 config={"mode": "cpu-smoke" if args.cpu_smoke else "cuda", "quick": args.quick,
                         "only": args.only, "rep": rep})
    run.extra = {"sweep": sweep, "host_profile_us": host}
    path = results.save(run, args, by_default=not args.cpu_smoke)
    print(_table(cases, ceiling))
    if args.plot:
        from fkv.bench import plots

        plots.plot_write(run.to_file(), args.plot)
        print(f"plot: {args.plot} (from {path or 'this run'})")
    return 0


_METRICS = ("ms", "gbps", "pct_of_copy", "baseline_ms", "baseline_gbps")
_EXTRA_METRICS = ("kernel_us", "eager_us", "eager_gbps", "baseline_eager_us", "graph1_us",
                  "graph_per_call_us", "baseline_graph_per_call_us", "graph_per_call_pdl_us",
                  "graph_per_call_warm_us", "graph_per_call_warm_pdl_us", "plain_kernel_us",
                  "after_plain_us", "after_plain_pdl_us", "engine_graph_per_call_us",
                  "graph_per_call_primed_us", "engine_graph_per_call_primed_us")


def to_run(cases: list[Case], shape: Shape, ceiling: float, device: str,
           config: dict[str, Any] | None = None, env: dict[str, Any] | None = None
           ) -> results.Run:
    """The result file of a run: one case per measured ``Case`` (id = ``Case.name``)."""
    run = results.Run("write", config={"shape": asdict(shape), **(config or {})}, env=env,
                      device=device)
    run.ceiling("copy_gbps", ceiling)
    for c in cases:
        metrics = {k: getattr(c, k) for k in _METRICS}
        metrics["speedup_x"] = c.speedup_vs_baseline
        metrics |= {k: c.extra[k] for k in _EXTRA_METRICS if k in c.extra}
        extra = {k: v for k, v in c.extra.items() if k not in _EXTRA_METRICS}
        run.add(c.name, params={"kind": c.kind, "tokens": c.tokens, "layout": c.layout,
                                "dtype": c.dtype, "bytes": c.bytes},
                metrics=metrics, extra=extra)
    return run


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
