"""Experiment: where a streamed ipc layer's 0.3 ms goes on one GPU.

The transfer bench's streamed ipc reads (one H200, prefill and decode processes on the same GPU,
16384 blocks x 32 layers, 256 blocks a request) land each layer about 0.35 ms after its publish,
against 0.026 ms for the layer's share of a whole read. Its stage timers put 0.09 ms in
``LayerMove.__call__`` (the host's launch) and 0.27 ms after it, waiting for the copy's event.
Two suspects for the 0.27 ms: the one-layer copy itself (grid, tiling), or the GPU switching to
the decode's context from the prefill's, which just ran its write of the layer (without MPS,
kernels of two processes never share the GPU).

One layer of 256 random blocks (HND, 8 KV heads of 128, bf16, block 16, heads 0-3: a decode rank
of TP 2) moved by ``LayerMove`` between two caches of this process, each call after 0.5 ms of
idle host time, as a stream's layers come:

- ``alone``: no other process has work on the GPU;
- ``after_peer``: a second process runs, every 0.5 ms, a gather of 16 MiB and waits for it (the
  prefill's write of a layer), and this process launches right after the peer's kernel ended
  (a shared counter says when);
- ``peer_busy``: the peer runs matmuls back to back (a prefill computing on the same GPU).

Then the host's launch alone, a plain call against ``LayerMove.prepare``'s kept launch.

Per call: the host's launch (``__call__``), launch to the event's completion seen by the host
(spinning on ``query``), and the GPU's own time of the copy (CUDA events around it). Also a
cProfile of 300 calls (the host launch's pieces).

    python bench/experiments/ipc_layer_latency.py     # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import cProfile
import io
import multiprocessing as mp
import pstats
import statistics
import time
from typing import Any

import torch

import _record  # bench/experiments/_record.py

BLOCKS, LAYERS, N = 16384, 32, 256


def _peer(mode: str, ticks: Any, stop: Any) -> None:
    """The other process on the GPU: ``after_peer`` a 16 MiB gather every 0.5 ms (advancing
    ``ticks`` once it completed), ``peer_busy`` matmuls without pause."""
    dev = torch.device("cuda:0")
    src = torch.randn(64 << 20, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(src.numel() // 4096, device=dev)[:2048]
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    while not stop.is_set():
        if mode == "after_peer":
            time.sleep(0.0005)
            src.view(-1, 4096)[idx].sum()
            torch.cuda.synchronize()
            with ticks.get_lock():
                ticks.value += 1
        else:
            for _ in range(8):
                a @ a
            torch.cuda.synchronize()


def _measure(move: Any, sids: Any, dids: Any, mode: str, ticks: Any, reps: int) -> dict[str, Any]:
    launch, landed, gpu = [], [], []
    for i in range(reps):
        if mode == "after_peer":  # launch right after the peer's kernel ended
            seen = ticks.value
            while ticks.value == seen:
                pass
        else:
            time.sleep(0.0005)
        layer = i % LAYERS
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        move(sids, dids, N * 16, validate=False, layers=(layer, layer + 1))
        done.record()
        t1 = time.perf_counter()
        while not done.query():
            pass
        t2 = time.perf_counter()
        launch.append(1e3 * (t1 - t0))
        landed.append(1e3 * (t2 - t0))
        gpu.append(start.elapsed_time(done))
    med = statistics.median
    return {"mode": mode, "reps": reps, "launch_ms": med(launch), "landed_ms": med(landed),
            "gpu_ms": med(gpu), "landed_p90_ms": sorted(landed)[int(0.9 * reps)]}


def main() -> None:
    import fkv
    from fkv.ops.layers import LayerMove

    dev = torch.device("cuda:0")
    src_spec = fkv.KVCacheSpec(layout="HND", num_blocks=BLOCKS, block_size=16, num_kv_heads=8,
                               head_size=128, dtype="bfloat16", num_layers=LAYERS)
    dst_spec = fkv.KVCacheSpec(layout="HND", num_blocks=BLOCKS, block_size=16, num_kv_heads=4,
                               head_size=128, dtype="bfloat16", num_layers=LAYERS)
    src, dst = fkv.allocate(src_spec, dev), fkv.allocate(dst_spec, dev)
    for view in src:
        view.normal_()
    move = LayerMove(src, src_spec, dst, dst_spec, src_heads=(0, 4), dst_heads=(0, 4))
    sids = torch.randperm(BLOCKS, device=dev)[:N]
    dids = torch.randperm(BLOCKS, device=dev)[:N]
    for layer in range(LAYERS):
        move(sids, dids, N * 16, validate=False, layers=(layer, layer + 1))
    move(sids, dids, N * 16, validate=False)
    torch.cuda.synchronize()
    rows: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    for mode in ("alone", "after_peer", "peer_busy", "alone"):
        ticks, stop = ctx.Value("q", 0), ctx.Event()
        peer = None
        if mode != "alone":
            peer = ctx.Process(target=_peer, args=(mode, ticks, stop), daemon=True)
            peer.start()
            time.sleep(8.0 if mode == "after_peer" else 6.0)  # its CUDA context and first kernels
        try:
            row = _measure(move, sids, dids, mode, ticks, 300)
        finally:
            stop.set()
            if peer is not None:
                peer.join(10)
        rows.append(row)
        print(row)
    # the whole request's 32 layers in one launch, for scale
    t = []
    for _ in range(50):
        time.sleep(0.0005)
        t0 = time.perf_counter()
        move(sids, dids, N * 16, validate=False)
        torch.cuda.synchronize()
        t.append(1e3 * (time.perf_counter() - t0))
    rows.append({"mode": "alone, 32 layers in one launch", "landed_ms": statistics.median(t)})
    print(rows[-1])
    # the host's launch alone, back to back and after 0.5 ms idle: a call against a prepared move
    prepared = move.prepare(sids, dids, N * 16, validate=False)
    for label, call in (("call", lambda i: move(sids, dids, N * 16, validate=False,
                                                layers=(i % LAYERS, i % LAYERS + 1))),
                        ("prepared", lambda i: prepared((i % LAYERS, i % LAYERS + 1)))):
        for idle in (0.0, 0.0005):
            t = []
            for i in range(400):
                if idle:
                    time.sleep(idle)
                t0 = time.perf_counter()
                call(i)
                t.append(1e3 * (time.perf_counter() - t0))
                if i % 32 == 31:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            rows.append({"mode": f"host launch, {label}, idle {idle * 1e3:g} ms",
                         "launch_ms": statistics.median(t[50:])})
            print(rows[-1])
    prof = cProfile.Profile()
    prof.enable()
    for i in range(300):
        move(sids, dids, N * 16, validate=False, layers=(i % LAYERS, i % LAYERS + 1))
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).strip_dirs().sort_stats("cumulative").print_stats(30)
    print(s.getvalue())
    rows.append({"mode": "cprofile of 300 one-layer calls", "text": s.getvalue()[:6000]})
    _record.write("ipc-layer-latency.json", "ipc_layer_latency", rows)


if __name__ == "__main__":
    main()
