"""Benchmark the pure handshake and ``TransferPlan.segments`` on the CPU (docs/benchmarks.md).

Targets: ``handshake`` <= 50 µs per call; ``segments`` for 100k blocks <= 20 ms (numpy, no Python
loop per block). Both are pure Python + numpy and run on any machine (no GPU).

- handshake, per call, for example A (P TP=1 -> D TP=2, HND: direct), example B (P TP=4 -> D TP=2:
  two reads), NHD P1->D2
  (staging), a layout mismatch, MLA P4->D2: "warm" = the module's small lru caches (span
  contiguity, best atom split) already filled, which is the steady state of a server answering
  many peers of one model; "cold" = every cache of fkv.layout and fkv.connector.plan cleared
  before each call (first contact).
- segments for N blocks (random distinct ids on both sides, and contiguous ids where coalescing
  applies): time per call. Baseline (same run): a per-row Python loop building the same rows with
  scalar ``region_and_offset`` calls (timed on fewer blocks and scaled linearly), which is also
  the correctness reference: the vectorized rows must equal it exactly before anything is timed.
  Ceiling (same run): one numpy copy of an int64 array the size of the output (the floor for
  producing the rows at all).

    python bench/bench_plan.py                         # also: fkv bench plan (-> bench/results/)
    python bench/bench_plan.py --json plan.json --plot plan.png
    python bench/bench_plan.py --quick                 # 10k blocks, fewer repeats
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from typing import Any

import numpy as np

from fkv.bench import results
from fkv.bench._common import parse_args
from fkv.connector import plan as _plan
from fkv.connector.handshake import EngineDesc, handshake
from fkv.layout import KVCacheSpec

__all__ = ["main"]

HANDSHAKE_TARGET_US = 50.0
SEGMENTS_TARGET_MS = 20.0   # for 100k blocks
TARGET_BLOCKS = 100_000


def _rank(tp: int, r: int, *, num_blocks: int, heads: int = 8, **kw: Any) -> tuple[EngineDesc, KVCacheSpec]:
    base: dict[str, Any] = dict(layout="HND", block_size=16, head_size=128, num_blocks=num_blocks)
    base.update(kw)
    mla = base.get("backend") == "mla"
    engine = EngineDesc(engine_id=f"tp{tp}", tp_size=tp, tp_rank=r,
                        total_num_kv_heads=1 if mla else heads, model="m")
    return engine, KVCacheSpec(num_kv_heads=1 if mla else max(1, heads // tp), **base)


def _configs(num_blocks: int) -> dict[str, tuple[Any, Any]]:
    nb = num_blocks
    return {
        "A: P1->D2 HND": (_rank(2, 1, num_blocks=nb), _rank(1, 0, num_blocks=nb)),
        "B: P4->D2 HND": (_rank(2, 1, num_blocks=nb), _rank(4, 0, num_blocks=nb)),
        "same TP and layout": (_rank(2, 1, num_blocks=nb), _rank(2, 0, num_blocks=nb)),
        "NHD P1->D2 (staging)": (_rank(2, 1, num_blocks=nb, layout="NHD"),
                                 _rank(1, 0, num_blocks=nb, layout="NHD")),
        "layout HND->NHD (staging)": (_rank(1, 0, num_blocks=nb, layout="NHD"),
                                      _rank(1, 0, num_blocks=nb)),
        "A, 32 layers, cross-layer both": (
            _rank(2, 1, num_blocks=nb, num_layers=32, cross_layer=True),
            _rank(1, 0, num_blocks=nb, num_layers=32, cross_layer=True)),
        "MLA P4->D2": (_rank(2, 1, num_blocks=nb, backend="mla", head_size=576),
                       _rank(4, 0, num_blocks=nb, backend="mla", head_size=576)),
    }


def _clear_caches() -> None:
    from fkv import layout

    for f in (layout.box_is_contiguous, _plan._best_split, layout._physical_axes,
              layout._addressing):
        f.cache_clear()


def _median_time(fn: Any, *, number: int, repeat: int, setup: Any = None) -> float:
    """Median seconds per call over ``repeat`` runs of ``number`` calls."""
    times = []
    for _ in range(repeat):
        if setup is None:
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times.append((time.perf_counter() - t0) / number)
        else:
            total = 0.0
            for _ in range(number):
                setup()
                t0 = time.perf_counter()
                fn()
                total += time.perf_counter() - t0
            times.append(total / number)
    return statistics.median(times)


# -- the per-row Python reference (baseline and correctness check) --------------------------------

def naive_segments(plan: Any, local_ids: Any, remote_ids: Any) -> np.ndarray:
    """The same rows as ``plan.segments``, one scalar ``region_and_offset`` pair per row, merged
    in a Python loop. Slow on purpose: the reference and the baseline."""
    ls, rs = plan.local_spec, plan.remote_spec
    local, remote = [int(x) for x in local_ids], [int(x) for x in remote_ids]
    n_l, n_r = ls.block_size, rs.block_size
    tokens = min(len(local) * n_l, len(remote) * n_r)
    staging = plan.strategy == "staging"
    stage = rs.evolve(num_blocks=len(remote)) if staging else None
    mini = stage.region_bytes * stage.num_regions if stage else 0
    chunk = n_r if staging else math.gcd(n_l, n_r)
    axes = rs.physical_axes if rs.cross_layer else ("L", *rs.physical_axes)
    rows: list[list[int]] = []
    for i, (read, move) in enumerate(zip(plan.reads, plan.moves, strict=True)):
        atom = {a for a, _ in move.full if a not in move.split}
        nh = move.heads[1] - move.heads[0]
        ranges = {"L": [0] if "L" in atom else range(rs.num_layers), "B": range(len(remote)),
                  "N": range(0, n_r, 1 if "N" in move.split else chunk),
                  "two": range(2) if "two" in move.split else [0],
                  "H": range(nh) if "H" in move.split else [0], "C": [0]}
        nbytes = _plan._atom_bytes(rs, move.full, move.split)
        for idx in itertools.product(*(ranges[a] for a in axes)):
            at = dict(zip(axes, idx, strict=True))
            tok = at["B"] * n_r + at["N"]
            if tok >= tokens:
                continue
            rreg, roff = rs.region_and_offset(layer=at["L"], block=remote[at["B"]], kv=at.get("two", 0),
                                              token=at["N"], head=move.heads[0] + at.get("H", 0))
            if staging:
                dreg, doff = stage.region_and_offset(layer=at["L"], block=at["B"], kv=at.get("two", 0),
                                                     token=at["N"], head=move.heads[0] + at.get("H", 0))
                dreg, doff = -1, i * mini + dreg * stage.region_bytes + doff
            else:
                dreg, doff = ls.region_and_offset(
                    layer=at["L"], block=local[tok // n_l], kv=at.get("two", 0), token=tok % n_l,
                    head=read.local_heads[0] + at.get("H", 0))
            prev = rows[-1] if rows else None
            if (prev and prev[0] == read.remote_rank and prev[1] == rreg and prev[3] == dreg
                    and prev[2] + prev[5] == roff and prev[4] + prev[5] == doff):
                prev[5] += nbytes
            else:
                rows.append([read.remote_rank, rreg, roff, dreg, doff, nbytes])
    return np.array(rows, dtype=np.int64).reshape(-1, 6)


# -- cases ---------------------------------------------------------------------------------------

def _bench_handshake(repeat: int, number: int) -> list[dict[str, Any]]:
    out = []
    for name, (local, remote) in _configs(1024).items():
        result = handshake(local, remote)
        assert result.ok, str(result)
        warm = _median_time(lambda: handshake(local, remote), number=number, repeat=repeat)
        cold = _median_time(lambda: handshake(local, remote), number=max(1, number // 10),
                            repeat=repeat, setup=_clear_caches)
        out.append({"case": name, "strategy": result.plan.strategy, "warm_us": warm * 1e6,
                    "cold_us": cold * 1e6, "target_us": HANDSHAKE_TARGET_US,
                    "ok": warm * 1e6 <= HANDSHAKE_TARGET_US})
    return out


def _bench_segments(blocks: int, repeat: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    out = []
    pool = 2 * blocks
    for name, (local, remote) in _configs(pool).items():
        plan = handshake(local, remote).plan
        for ids in ("random", "contiguous"):
            if ids == "random":
                local_ids, remote_ids = rng.permutation(pool)[:blocks], rng.permutation(pool)[:blocks]
            else:
                local_ids, remote_ids = np.arange(blocks), np.arange(7, 7 + blocks)
            # correctness first: the vectorized rows equal the per-row reference
            small = min(blocks, 2000)
            ref = naive_segments(plan, local_ids[:small], remote_ids[:small])
            got = plan.segments(local_ids[:small], remote_ids[:small])
            if not np.array_equal(ref, got):
                raise AssertionError(f"{name}/{ids}: segments differ from the per-row reference")
            rows = plan.segments(local_ids, remote_ids)
            t = _median_time(lambda: plan.segments(local_ids, remote_ids), number=1, repeat=repeat)
            base_blocks = min(blocks, 5000)
            tb = _median_time(lambda: naive_segments(plan, local_ids[:base_blocks],
                                                     remote_ids[:base_blocks]),
                              number=1, repeat=max(1, repeat // 5)) * blocks / base_blocks
            arr = np.empty_like(rows)
            tc = _median_time(lambda: np.copyto(arr, rows), number=3, repeat=repeat)
            scaled_target = SEGMENTS_TARGET_MS * blocks / TARGET_BLOCKS
            out.append({"case": name, "ids": ids, "blocks": blocks, "strategy": plan.strategy,
                        "rows": int(rows.shape[0]), "ms": t * 1e3, "baseline_ms": tb * 1e3,
                        "ceiling_ms": tc * 1e3, "x_baseline": tb / t, "target_ms": scaled_target,
                        "ok": t * 1e3 <= scaled_target})
    return out


def to_run(hs: list[dict[str, Any]], seg: list[dict[str, Any]],
           config: dict[str, Any] | None = None, env: dict[str, Any] | None = None
           ) -> results.Run:
    """The result file: ``handshake <config>`` cases (warm/cold µs per call) and
    ``segments <config>, <ids> ids, <N> blocks`` cases (ms per call, per-row loop, copy floor)."""
    run = results.Run("plan", config=dict(config or {}), env=env, device="cpu")
    for r in hs:
        run.add(f"handshake {r['case']}", params={"config": r["case"], "strategy": r["strategy"]},
                metrics={"warm_us": r["warm_us"], "cold_us": r["cold_us"],
                         "target_us": r["target_us"]}, extra={"meets_target": r["ok"]})
    for r in seg:
        run.add(f"segments {r['case']}, {r['ids']} ids, {r['blocks']} blocks",
                params={"config": r["case"], "ids": r["ids"], "blocks": r["blocks"],
                        "strategy": r["strategy"]},
                metrics={"ms": r["ms"], "baseline_ms": r["baseline_ms"], "copy_ms": r["ceiling_ms"],
                         "speedup_x": r["x_baseline"], "target_ms": r["target_ms"],
                         "rows_count": r["rows"]}, extra={"meets_target": r["ok"]})
    return run


def main(argv: list[str] | None = None) -> int:
    from fkv.cli import positive_int

    parser = argparse.ArgumentParser(prog="fkv bench plan", description=__doc__.split("\n")[0])
    results.add_output_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="10k blocks, fewer repeats")
    parser.add_argument("--blocks", type=positive_int, default=None,
                        help=f"blocks of the request segmented (default {TARGET_BLOCKS}, 10000 "
                             f"with --quick)")
    args = parse_args(parser, argv)
    blocks = args.blocks or (10_000 if args.quick else TARGET_BLOCKS)
    repeat = 5 if args.quick else 15
    rng = np.random.default_rng(0)
    hs = _bench_handshake(repeat, 200 if args.quick else 2000)
    seg = _bench_segments(blocks, repeat, rng)
    run = to_run(hs, seg, config={"quick": args.quick, "blocks": blocks, "repeat": repeat})
    results.save(run, args)
    if args.plot:
        from fkv.bench import plots

        plots.plot_plan(run.to_file(), args.plot)
        print(f"plot: {args.plot}")
    print(f"{'handshake':34} {'strategy':8} {'warm µs':>8} {'cold µs':>8}  target <= {HANDSHAKE_TARGET_US:g} µs")
    for r in hs:
        print(f"{r['case']:34} {r['strategy']:8} {r['warm_us']:8.1f} {r['cold_us']:8.1f}  "
              f"{'ok' if r['ok'] else 'MISS'}")
    print(f"\n{'segments, ' + str(blocks) + ' blocks':34} {'ids':10} {'rows':>8} {'ms':>7} "
          f"{'copy ms':>7} {'loop ms':>8} {'x loop':>6}  target <= {seg[0]['target_ms']:g} ms")
    for r in seg:
        print(f"{r['case']:34} {r['ids']:10} {r['rows']:8d} {r['ms']:7.2f} {r['ceiling_ms']:7.2f} "
              f"{r['baseline_ms']:8.0f} {r['x_baseline']:6.0f}  {'ok' if r['ok'] else 'MISS'}")
    return 0 if all(r["ok"] for r in hs + seg) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

