"""Experiment: a streamed ipc layer as the bench moves it, piece by piece, on one GPU.

``ipc_layer_latency.py`` found that a one-layer copy (256 blocks, 4 of 8 heads) lands 5 us after
its launch when the decode process is alone on the GPU and 44-59 us right after another process's
kernel, while the transfer bench's streamed ipc layers wait about 0.2-0.29 ms after their launch.
What the bench does that the experiment did not:

1. the source is the *other* process's memory, mapped here by CUDA IPC;
2. the layer's writes were launched by the other process just before the publish, and this
   process first waits (host spin on ``query``) for the other process's interprocess event;
3. the other process publishes with its write still queued or running (no synchronize).

Here a child process (the "prefill") owns an HND cache of 32 layers, writes one layer of 256
blocks every 0.5 ms (``index_copy_`` of 16 MiB: a layer's ``write_kv``), records an event after it
and advances a shared counter (the publish). The parent (the "decode") spins on the counter,
optionally spins on the event, launches the layer's ``PreparedMove`` and spins on its own event.

The first version (four variants, 16384 blocks; ``raw/ipc-event-latency-exp-20261204T0653/``)
found the copy landing 0.13 ms after its launch in every variant, mapped source or not, the
child's write in flight or not, event waited on or not, and the child's event completing
0.13-0.15 ms after the publish even when nothing but the event was recorded. So this version
starts from the decode alone and adds, one step at a time (the parent's state only grows), what
the bench's read has: another process publishing with a plain event after synchronizing, the
same without its write, its event interprocess, that event opened here, waited on, the source
mapped from the child. 300 layers per step.

Per layer: publish seen -> event complete, -> launch returned, -> copy landed (host
``perf_counter``), and the copy's GPU time (CUDA events around it).

    python bench/experiments/ipc_event_latency.py [BLOCKS]   # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch

import _record  # bench/experiments/_record.py

BLOCKS, LAYERS, N, REPS = 16384, 32, 256, 300


def _spec(heads: int, blocks: int = BLOCKS) -> Any:
    import fkv

    return fkv.KVCacheSpec(layout="HND", num_blocks=blocks, block_size=16, num_kv_heads=heads,
                           head_size=128, dtype="bfloat16", num_layers=LAYERS)


def _prefill(conn: Any, counter: Any, go: Any, stop: Any, blocks_n: int) -> None:
    """The child: own the cache, send its layer views and an event's IPC handle, then publish
    one layer every 0.5 ms while ``go`` is set. Per run from the pipe: ``mode`` (the write or
    none, synchronize or not) and whether the event is an interprocess one."""
    import fkv

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    views = fkv.allocate(_spec(8, blocks_n), dev)
    for v in views:
        v.normal_()
    blocks = torch.randperm(blocks_n, device=dev)[:N]
    vals = torch.randn((N, *views[0].shape[1:]), device=dev, dtype=views[0].dtype)
    shared = torch.cuda.Event(interprocess=True)
    shared.record()
    torch.cuda.synchronize()
    conn.send((views, bytes(shared.ipc_handle())))
    while not stop.is_set():
        got = conn.recv()
        if got is None:
            break
        mode, interprocess = got
        event = shared if interprocess else torch.cuda.Event()
        go.wait()
        while go.is_set():
            time.sleep(0.0005)  # the layer's compute, on the host
            layer = counter.value % LAYERS  # the layer the decode will move for this publish
            if "nowrite" not in mode:
                views[layer].index_copy_(0, blocks, vals)
            event.record()
            if "synced" in mode:
                torch.cuda.synchronize()
            with counter.get_lock():
                counter.value += 1
        torch.cuda.synchronize()
        conn.send("idle")


def _measure(prepared: Any, event: Any, counter: Any, query: bool) -> dict[str, Any]:
    seen_to_event, to_launch, to_landed, gpu = [], [], [], []
    last = 0 if counter is None else counter.value
    for _ in range(REPS):
        if counter is None:
            time.sleep(0.0005)
            last += 1
        else:
            while counter.value == last:
                pass
            last = counter.value
        t0 = time.perf_counter()
        if query:
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

    blocks_n = int(sys.argv[1]) if len(sys.argv) > 1 else BLOCKS
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    own = fkv.allocate(_spec(8, blocks_n), dev)
    for v in own:
        v.normal_()
    dst = fkv.allocate(_spec(4, blocks_n), dev)
    sids = torch.randperm(blocks_n, device=dev)[:N]
    dids = torch.randperm(blocks_n, device=dev)[:N]

    def prepare(src: Any) -> Any:
        move = LayerMove(src, _spec(8, blocks_n), dst, _spec(4, blocks_n), src_heads=(0, 4),
                         dst_heads=(0, 4))
        prepared = move.prepare(sids, dids, N * 16, validate=False)
        for layer in range(LAYERS):
            prepared((layer, layer + 1))
        return prepared

    local = prepare(own)
    torch.cuda.synchronize()
    rows: list[dict[str, Any]] = [{"config": f"{blocks_n} blocks x {LAYERS} layers, {N} moved"}]
    row = _measure(local, None, None, False)
    row["mode"] = "alone: no other process"
    rows.append(row)
    print(row)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    counter, go, stop = ctx.Value("q", 0), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_prefill, args=(child, counter, go, stop, blocks_n), daemon=True)
    proc.start()
    payload = parent.recv()  # the child's views and event handle, not opened yet
    state = {"event": None, "mapped": None}
    # each step adds one thing the bench's read has; the parent's state only grows
    steps = (
        ("peer writes, plain event, synchronizes; nothing of it opened here",
         "write_synced", False, False, False, False),
        ("the same without the write (an event recorded, synchronized)",
         "nowrite_synced", False, False, False, False),
        ("peer's event interprocess; not opened here",
         "write_synced", True, False, False, False),
        ("its handle opened here (never queried)",
         "write_synced", True, True, False, False),
        ("peer publishes before its write ends; decode waits on the opened event",
         "write", True, True, True, False),
        ("the same with the source mapped from the peer (the bench's read)",
         "write", True, True, True, True),
        ("mapped, peer synchronizes, no event wait", "write_synced", True, True, False, True),
        ("mapped, event wait, the peer records without writing",
         "nowrite", True, True, True, True),
    )
    try:
        for label, mode, interprocess, opened, query, mapped in steps:
            if opened and state["event"] is None:
                state["event"] = torch.cuda.Event.from_ipc_handle(dev, payload[1])
            if mapped and state["mapped"] is None:
                views = payload[0]
                state["mapped"] = prepare(views)
                state["mapped"]((0, 1))
                torch.cuda.synchronize()
                check = bool(torch.equal(dst[0][dids], views[0][sids][:, :, :, 0:4]))
                rows.append({"mode": "check: a mapped layer moved equals its source",
                             "equal": check})
                print(rows[-1])
            parent.send((mode, interprocess))
            go.set()
            time.sleep(0.3)  # the child's loop running
            row = _measure(state["mapped"] if mapped else local, state["event"], counter, query)
            go.clear()
            parent.recv()
            row.update(mode=label, peer=mode, interprocess=interprocess, opened=opened,
                       query=query, mapped=mapped)
            rows.append(row)
            print(row)
    finally:
        stop.set()
        go.clear()
        parent.send(None)
        proc.join(10)
    _record.write(f"ipc-event-latency-{blocks_n}.json", "ipc_event_latency", rows)


if __name__ == "__main__":
    main()
