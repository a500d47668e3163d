"""Experiment: a streamed ipc layer as the bench moves it, piece by piece, on one GPU.

``ipc_layer_latency.py`` found that a one-layer copy (256 blocks, 4 of 8 heads) lands 5 us after
its launch when the decode process is alone on the GPU and 44-59 us right after another process's
kernel, while the transfer bench's streamed ipc layers wait about 0.2-0.29 ms after their launch.
What the bench does that the experiment did not:

1. the source is the *other* process's memory, mapped here by CUDA IPC;
2. the layer's writes were launched by the other process just before the publish, and this
   process first waits (host spin on ``query``) for the other process's interprocess event;
3. the other process publishes with its write still queued or running (no synchronize).

Here a child process (the "prefill") owns a 16384-block x 32-layer HND cache, writes one layer
of 256 blocks every 0.5 ms (``index_copy_`` of 16 MiB: a layer's ``write_kv``), records an
interprocess event after it and advances a shared counter (the publish). The parent (the
"decode") spins on the counter, spins on the event, launches the layer's ``PreparedMove`` and
spins on its own event. Variants, each 300 layers:

- ``ipc_event``: the bench's way (source mapped from the child, wait on the child's event);
- ``ipc_synced``: the child synchronizes before publishing (no event wait; source mapped);
- ``local_event``: the parent moves from its own copy of a cache (same shape), still waiting on
  the child's event first: what the mapping costs, if anything;
- ``ipc_event_nowrite``: the child publishes without writing (records the event only): what the
  write's kernel in flight costs.

Per layer: publish seen -> event complete, -> launch returned, -> copy landed (host
``perf_counter``), and the copy's GPU time (CUDA events around it).

    python bench/experiments/ipc_event_latency.py     # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

import _record  # bench/experiments/_record.py

BLOCKS, LAYERS, N, REPS = 16384, 32, 256, 300


def _spec(heads: int) -> Any:
    import fkv

    return fkv.KVCacheSpec(layout="HND", num_blocks=BLOCKS, block_size=16, num_kv_heads=heads,
                           head_size=128, dtype="bfloat16", num_layers=LAYERS)


def _prefill(conn: Any, counter: Any, go: Any, stop: Any) -> None:
    """The child: own the cache, send its layer views and an interprocess event, then publish
    one written layer every 0.5 ms while ``go`` is set (mode from the pipe)."""
    import fkv

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    views = fkv.allocate(_spec(8), dev)
    for v in views:
        v.normal_()
    blocks = torch.randperm(BLOCKS, device=dev)[:N]
    vals = torch.randn((N, *views[0].shape[1:]), device=dev, dtype=views[0].dtype)
    event = torch.cuda.Event(interprocess=True)
    event.record()
    torch.cuda.synchronize()
    conn.send((views, bytes(event.ipc_handle())))
    while not stop.is_set():
        mode = conn.recv()
        if mode is None:
            break
        go.wait()
        while go.is_set():
            time.sleep(0.0005)  # the layer's compute, on the host
            layer = counter.value % LAYERS  # the layer the decode will move for this publish
            if mode != "ipc_event_nowrite":
                views[layer].index_copy_(0, blocks, vals)
            event.record()
            if mode == "ipc_synced":
                torch.cuda.synchronize()
            with counter.get_lock():
                counter.value += 1
        torch.cuda.synchronize()
        conn.send("idle")


def _measure(prepared: Any, event: Any, counter: Any, synced: bool) -> dict[str, Any]:
    seen_to_event, to_launch, to_landed, gpu = [], [], [], []
    last = counter.value
    for i in range(REPS):
        while counter.value == last:
            pass
        last = counter.value
        t0 = time.perf_counter()
        if not synced:
            while not event.query():
                pass
        t1 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        start.record()
        layer = (last - 1) % LAYERS
        prepared((layer, layer + 1))
        done.record()
        t2 = time.perf_counter()
        while not done.query():
            pass
        t3 = time.perf_counter()
        seen_to_event.append(1e3 * (t1 - t0))
        to_launch.append(1e3 * (t2 - t1))
        to_landed.append(1e3 * (t3 - t2))
        gpu.append(start.elapsed_time(done))
    med = statistics.median
    return {"reps": REPS, "event_ms": med(seen_to_event), "launch_ms": med(to_launch),
            "landed_after_launch_ms": med(to_landed),
            "landed_after_launch_p90_ms": sorted(to_landed)[int(0.9 * REPS)],
            "gpu_ms": med(gpu),
            "publish_seen_to_landed_ms": med(a + b + c for a, b, c in
                                             zip(seen_to_event, to_launch, to_landed))}


def main() -> None:
    import fkv
    from fkv.ops.layers import LayerMove

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    counter, go, stop = ctx.Value("q", 0), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_prefill, args=(child, counter, go, stop), daemon=True)
    proc.start()
    mapped, handle = parent.recv()
    event = torch.cuda.Event.from_ipc_handle(dev, handle)
    own = fkv.allocate(_spec(8), dev)
    for v in own:
        v.normal_()
    dst = fkv.allocate(_spec(4), dev)
    sids = torch.randperm(BLOCKS, device=dev)[:N]
    dids = torch.randperm(BLOCKS, device=dev)[:N]
    moves = {}
    for name, src in (("ipc", mapped), ("local", own)):
        move = LayerMove(src, _spec(8), dst, _spec(4), src_heads=(0, 4), dst_heads=(0, 4))
        prepared = move.prepare(sids, dids, N * 16, validate=False)
        for layer in range(LAYERS):
            prepared((layer, layer + 1))
        moves[name] = prepared
    torch.cuda.synchronize()
    # the mapped source's bytes are the child's: one layer checked against the mapped view
    moves["ipc"]((0, 1))
    torch.cuda.synchronize()
    ok = bool(torch.equal(dst[0][dids], mapped[0][sids][:, :, :, 0:4]))  # (B, 2, N, H, D)
    rows: list[dict[str, Any]] = [{"mode": "check: a mapped layer moved equals its source",
                                   "equal": ok}]
    print(rows[-1])
    order = ("ipc_event", "ipc_synced", "local_event", "ipc_event_nowrite", "ipc_event")
    try:
        for mode in order:
            parent.send(mode)
            go.set()
            time.sleep(0.3)  # the child's loop running
            row = _measure(moves["local" if mode.startswith("local") else "ipc"], event,
                           counter, mode == "ipc_synced")
            go.clear()
            parent.recv()
            row["mode"] = mode
            rows.append(row)
            print(row)
    finally:
        stop.set()
        go.clear()
        parent.send(None)
        proc.join(10)
    _record.write("ipc-event-latency.json", "ipc_event_latency", rows)


if __name__ == "__main__":
    main()
