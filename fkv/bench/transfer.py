"""Benchmark real prefill -> decode transfers (``fkv.connector``: NIXL READs between processes).

Cases (docs/benchmarks.md shape: bf16, N=16, 8 KV heads, head_size 128, 4096 blocks, one layer):

- ``link``: P TP=1 -> D TP=1, same layout, *contiguous* blocks, NIXL only (``strategy="nixl"``):
  the plan coalesces every request into one descriptor per layer, the best NIXL/UCX can do between
  these processes (the link).
- ``hnd-direct``: P TP=1 -> D TP=2, HND, random blocks: each D rank READs its head half, two
  descriptors (K, V) per block, straight into its cache (docs/handshake.md example A).
- ``nhd-staging``: P TP=1 -> D TP=2, NHD: a head slice is not contiguous, so each D rank READs whole
  pages into its registered staging buffer, then ``fkv.ops.move`` (Triton on CUDA; the torch
  reference on CPU) extracts its heads. (On one host in DRAM, a request of at most
  ``FKV_CMA_DIRECT_ROWS`` direct rows per layer copies the direct plan's rows instead: its
  ``path`` then says ``direct``.)
- ``nhd-direct``: ``nhd-staging``'s pair forced direct: each D rank READs its heads of every token
  (1 KiB rows, 32 per block and layer) straight into its cache.
- ``hnd2nhd-auto`` / ``hnd2nhd-direct``: HND prefill -> NHD decode (a layout change), the plan's
  choice (staging) and forced direct (one 256-byte row per token and head).
- ``hnd-staging``: ``hnd-direct`` forced through staging: one 64 KiB descriptor per block instead
  of two of 16 KiB, twice the bytes over the link, then the move kernel (does it pay on a GPU?).
- ``hnd-packed`` / ``nhd-packed``: the same requests read packed: each D rank asks the P rank (side
  channel) to gather its blocks and heads into the P rank's registered pack buffer
  (``fkv.ops.gather``), READs that as one descriptor and scatters it into its cache.
- ``hnd-auto``: ``hnd-direct``'s pair under ``strategy="auto"`` (packs requests over 64
  descriptors on CUDA; the one-block TTFB reads follow the plan).
- ``link-packed``: ``link``'s contiguous requests forced packed: what packing costs when the plan
  needs one descriptor anyway.

Every rank is its own process (spawned; CUDA: all on ``--p-gpu``/``--d-gpu``). Per case: the
prefill rank fills its cache from a seeded global KV, every decode rank checks one request bit for
bit against it before timing, then all decode ranks read at once (a barrier per repetition),
rotating through random block sets. Reported: aggregate GB/s (payload bytes landed in all decode
caches / slowest rank's time; staging READs twice that over the link), per-rank GB/s, the share
of time in READs and (packed) in waiting for the packs, descriptors actually posted per request
and rank, the path the requests took, time to first byte (a one-block read, call to return), and
the same-run ceiling: a 1 GiB device ``copy_`` (CPU: a 256 MiB DRAM memcpy) counted as bytes read
+ bytes written (docs/benchmarks.md); ``%copy`` compares a transfer with the copy's payload rate (half that:
each payload byte is read once and written once).

    python bench/bench_transfer.py --json transfer.json          # CUDA if present, else CPU
    python bench/bench_transfer.py --quick                       # 1024 blocks, fewer reps
    python bench/bench_transfer.py --ucx-tls "cuda_ipc,cuda_copy,tcp;rc,cuda_copy;tcp"
    FKV_NIXL_PROGRESS_THREAD=0 FKV_NIXL_NUM_THREADS=4 python bench/bench_transfer.py ...
    FKV_TRANSPORT_SPIN=0.005 python bench/bench_transfer.py --cases link,hnd-packed   # busy-poll

``--ucx-tls`` takes ``;``-separated UCX_TLS values and runs every case under each (fresh processes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["main"]

HEADS = 8
SEED = 11


@dataclass
class Case:
    name: str
    prefill_tp: int
    decode_tp: int
    prefill_layout: str
    decode_layout: str
    strategy: str = "auto"
    contiguous: bool = False
    ucx_tls: str = ""
    request_blocks: int = 0
    sizes: list[int] = field(default_factory=list)
    first_read_ms: float = 0.0  # the first read after connect (the correctness check), slowest rank
    stream_tail_ms: float = 0.0  # streamed: last layer published -> every decode rank's read done
    stream_news_ms: float = 0.0  # ... -> the last layer's news reached every decode rank
    stream_landed_ms: float = 0.0  # ... -> the last layer landed on every decode rank
    stream_return_ms: float = 0.0  # the last layer landed -> read returned, slowest decode rank
    stream_profile: dict[str, list[float]] = field(default_factory=dict)  # streamed reads' stages
    stream_cpu_ms: float = 0.0   # CPU time of a decode rank's process during one streamed read
    layer_ms: float = 0.0        # one layer's share of the same request's non-streamed read
    stream_layer_ms: float = 0.0  # a middle layer's publish -> landed on every decode rank
    # results
    plan_strategy: str = ""
    rows_by: str = ""  # who copies the plan's rows: "nixl" (READs) or "process_vm_readv"
    bytes_per_request: int = 0  # READ by all decode ranks (staging reads whole pages)
    payload_per_request: int = 0  # landed in the decode caches (what GB/s counts)
    descriptors_per_request: float = 0.0
    gbps: float = 0.0
    rank_gbps: list[float] = field(default_factory=list)
    ms: float = 0.0
    read_share: float = 0.0
    ttfb_ms: float = 0.0
    pack_share: float = 0.0
    path: str = ""  # the path ReadResult.strategy reported for the timed requests
    # median ms per call of each timed stage (prefill: its last calls, the timed requests'; decode:
    # the timed requests), and calls per request
    profile: dict[str, list[float]] = field(default_factory=dict)
    # packed reads: where each pack's round trip went (``_pack_hops``), ms
    pack_hops: dict[str, Any] = field(default_factory=dict)
    pct_of_copy: float = 0.0
    repeat_gbps: float = 0.0
    vs_peer_copy: float = 0.0   # GB/s over the same-run peer copy of the request's payload
    vs_nccl: float = 0.0        # GB/s over the same-run NCCL send/recv of the same bytes
    error: str = ""


# -- rank processes (spawned) -----------------------------------------------------------------------

def _spec(cfg: dict[str, Any], tp: int, layout: str) -> Any:
    import fkv

    return fkv.KVCacheSpec(layout=layout, num_blocks=cfg["blocks"], block_size=16,
                           num_kv_heads=HEADS // tp, head_size=128, dtype="bfloat16",
                           num_layers=cfg["layers"])


def _engine(name: str, tp: int, rank: int) -> Any:
    from fkv.connector import EngineDesc

    return EngineDesc(engine_id=name, tp_size=tp, tp_rank=rank, total_num_kv_heads=HEADS,
                      model="bench")


def _device(cfg: dict[str, Any], which: str, rank: int = 0) -> Any:
    """The device of the prefill rank (``p_gpu``) or of decode rank ``rank`` (``d_gpus``, rank
    by rank, round robin; ``d_gpu`` when not given)."""
    import torch

    if cfg["device"] == "cuda":
        gpus = (cfg.get("d_gpus") or [cfg["d_gpu"]]) if which == "d_gpu" else [cfg[which]]
        dev = torch.device("cuda", gpus[rank % len(gpus)])
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def _global_kv(layer: int, tokens: int, device: Any) -> Any:
    import torch

    g = torch.Generator(device=device).manual_seed(SEED * 1009 + layer)
    return torch.randn(tokens, 2, HEADS, 128, generator=g, device=device, dtype=torch.float32)


def _canon(view: Any, spec: Any) -> Any:
    axes = spec.logical_axes
    return view.permute(*[axes.index(a) for a in ("B", "N", "two", "H", "C")])


def _timers(targets: list[tuple[Any, str]]) -> dict[str, list[float]]:
    """Wrap methods (in this process) to record each call's seconds: ``"Class.method"`` -> list.
    The bench's stage profile; a wrapper costs about a µs per call."""
    stats: dict[str, list[float]] = {}
    for owner, attr in targets:
        seconds = stats[f"{owner.__name__}.{attr}"] = []

        def timed(*args: Any, _fn: Any = getattr(owner, attr), _rec: list[float] = seconds,
                  **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                _rec.append(time.perf_counter() - t0)

        setattr(owner, attr, timed)
    return stats


def _trace_packs_decode() -> list[list[Any]]:
    """Log every pack request of this decode process: ``[request id, token, first block id, sent,
    reply seen, reply kind]`` (``time.monotonic()``, one clock for every process of a host). A
    reply is seen when the read asks for it (the first chunk's as it arrives)."""
    from fkv.connector.transport import _packed_path

    log: list[list[Any]] = []
    sent: dict[int, tuple[float, str, int]] = {}
    send_one, take = _packed_path.PackedPath._send_one, _packed_path._Dealer.take

    def traced_send(self: Any, request_id: str, read: Any, chunk: Any, deadline: float) -> int:
        t = time.monotonic()
        token = send_one(self, request_id, read, chunk, deadline)
        sent[token] = (t, request_id, int(chunk.remote[0]))
        return token

    def traced_take(self: Any, token: int, deadline: float, spin: float = 0.0) -> Any:
        reply = take(self, token, deadline, spin)
        if reply is not None and token in sent:
            t, request_id, first = sent.pop(token)
            log.append([request_id, token, first, t, time.monotonic(), type(reply).__name__])
        return reply

    _packed_path.PackedPath._send_one = traced_send  # type: ignore[method-assign]
    _packed_path._Dealer.take = traced_take  # type: ignore[method-assign]
    return log


def _trace_packs_prefill() -> list[list[Any]]:
    """Log every pack this prefill process answered: ``[request id, token, first block id,
    taken up, handled, reply sent]`` (``time.monotonic()``): taken up when the server thread
    started on it, handled once gathered (launched, on CUDA), sent after its gather finished."""
    from fkv.connector.transport import _side
    from fkv.connector.transport._server import Server

    log: list[list[Any]] = []
    handled: dict[int, list[Any]] = {}
    reply_fn, send_fn = Server._reply, Server._send_replies

    def traced_reply(self: Any, envelope: Any, payload: bytes | None) -> Any:
        t = time.monotonic()
        got = reply_fn(self, envelope, payload)
        if isinstance(got[1], _side.Packed):
            msg = _side.decode_request(payload)
            handled[id(got[1])] = [msg.request_id, msg.token, int(msg.block_ids[0]), t,
                                   time.monotonic()]
        return got

    def traced_send(self: Any, out: list[Any], t0: float) -> float:
        packs = [r for _, r in out if isinstance(r, _side.Packed)]
        done = send_fn(self, out, t0)
        now = time.monotonic()
        for r in packs:
            rec = handled.pop(id(r), None)
            if rec is not None:
                log.append([*rec, now])
        return done

    Server._reply = traced_reply  # type: ignore[method-assign]
    Server._send_replies = traced_send  # type: ignore[method-assign]
    return log


def _pack_hops(decode: list[list[list[Any]]], prefill: list[list[Any]]) -> dict[str, Any]:
    """Median ms of each hop of the packs both sides logged (decode logs: one per rank): ``out``
    (sent -> the prefill's server thread takes it up), ``handle`` (-> gather launched), ``gather``
    (-> its reply sent: the gather's event), ``back`` (-> the decode rank sees the reply), and
    ``round_trip``; ``first`` the same for each read's first pack per rank (whose reply the
    decode waits for at once), ``retries`` the busy answers."""
    on_p = {(r[0], r[1], r[2]): r for r in prefill}
    hops: dict[str, list[float]] = {k: [] for k in ("out", "handle", "gather", "back",
                                                     "round_trip")}
    first: dict[str, list[float]] = {k: [] for k in hops}
    retries = 0
    for log in decode:
        seen: set[str] = set()
        for request_id, token, block, sent, back, kind in log:
            if kind != "Packed":
                retries += kind == "Error"
                continue
            p = on_p.get((request_id, token, block))
            if p is None:
                continue
            row = {"out": p[3] - sent, "handle": p[4] - p[3], "gather": p[5] - p[4],
                   "back": back - p[5], "round_trip": back - sent}
            for k, v in row.items():
                hops[k].append(v)
                if request_id not in seen:
                    first[k].append(v)
            seen.add(request_id)

    def med(d: dict[str, list[float]]) -> dict[str, float]:
        return {k: 1e3 * statistics.median(v) for k, v in d.items() if v}

    n = len(hops["out"])
    return {"all": med(hops), "first": med(first), "packs": n, "retries": retries} if n else {}


def _send(conn: Any, **msg: Any) -> None:
    conn.send_bytes(json.dumps(msg).encode())


def _recv(conn: Any) -> dict[str, Any]:
    return json.loads(conn.recv_bytes())


def _stream_blocks(cfg: dict[str, Any], n: int) -> tuple[list[int], list[int]]:
    """The one request every rank streams at size ``n`` (same ids on every rank)."""
    import numpy as np

    rng = np.random.default_rng(12345 + n)
    nb = cfg["blocks"]
    return rng.permutation(nb)[:n].tolist(), rng.permutation(nb)[:n].tolist()


def _compute(dev: Any, ms: float, where: str = "device") -> Any:
    """A stand-in for one layer's prefill compute of about ``ms`` milliseconds: bf16 matmuls on a
    GPU (calibrated once), a sleep on the CPU or with ``where="host"`` (the prefill's GPU then
    stays idle: what the decode sees when the prefill computes on another GPU). Returns a
    callable."""
    import torch

    if dev.type != "cuda" or where == "host":
        return lambda: time.sleep(ms / 1e3)
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize(dev)
    reps = max(1, round(ms / 1e3 / ((time.perf_counter() - t) / 20)))

    def run() -> None:
        for _ in range(reps):
            a @ a
    return run


def _stream_writer(spec: Any, caches: Any, dev: Any, blocks: list[int]) -> Any:
    """The prefill's write of one layer of a streamed request, as a prefill writes each layer's
    KV right before it publishes it: the request's K and V (gathered from the cache: the values
    every read checks) written back with ``write_kv`` (the Triton kernel on a GPU, the
    reference on the CPU). Returns a callable taking the layer."""
    import torch

    from fkv.ops import write_kv
    from fkv.ops.reference import write_kv as write_kv_ref

    write = write_kv if dev.type == "cuda" else write_kv_ref
    if dev.type != "cuda":
        # one thread: torch's worker threads would spin on every core for a while after each
        # write, and the decode processes reading that layer share the host's cores
        torch.set_num_threads(1)
    ids = torch.as_tensor(blocks, device=dev)
    bs = spec.block_size
    slots = (ids[:, None] * bs + torch.arange(bs, device=dev)).reshape(-1)

    def run(layer: int) -> None:
        kv = _canon(caches[layer], spec)[ids]  # (blocks, block_size, 2, heads, head_size)
        kv = kv.reshape(-1, 2, spec.num_kv_heads, spec.head_size)
        write(kv[:, 0], kv[:, 1], caches[layer], slots, spec)
    return run


def _prefill_stream(server: Any, conn: Any, cfg: dict[str, Any], dev: Any, sbarrier: Any,
                    spec: Any = None, caches: Any = None) -> list[list[float]]:
    """Streaming phase, prefill side: per size and repetition hold a streaming request, wait for
    the decode ranks, then compute, write (``cfg["stream_write"]``: the layer's KV, see
    :func:`_stream_writer`) and publish layer after layer (a CUDA event per publish); returns
    the perf_counter time of each last publish."""
    import torch

    compute = _compute(dev, cfg["compute_ms"], cfg.get("compute_on", "device"))
    out = []
    for n in cfg["sizes"]:
        _, remote = _stream_blocks(cfg, n)
        write = _stream_writer(spec, caches, dev, remote) \
            if cfg.get("stream_write", "kv") == "kv" and caches is not None else None
        lasts, pubs = [], []
        for rep in range(cfg["stream_reps"]):
            rid = f"st-{n}-{rep}"
            server.hold(rid, remote, layers_ready=0)
            sbarrier.wait()
            published = []  # when each publish call returned (a layer's own transfer starts)
            for layer in range(cfg["layers"]):
                compute()
                if write is not None:
                    write(layer)
                event = None
                if dev.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                server.publish(rid, layer + 1, event=event)
                published.append(time.perf_counter())
            if dev.type == "cuda":
                event.synchronize()
            lasts.append(time.perf_counter())
            pubs.append(published)
        out.append((lasts, pubs))
    return out


def _prefill_rank(conn: Any, cfg: dict[str, Any], case: dict[str, Any],
                  sbarrier: Any = None) -> None:
    import fkv
    from fkv.connector import serve

    os.environ.update({"UCX_TLS": case["ucx_tls"]} if case["ucx_tls"] else {})
    try:
        dev = _device(cfg, "p_gpu")
        spec = _spec(cfg, case["prefill_tp"], case["prefill_layout"])
        caches = fkv.allocate(spec, dev)
        for layer, view in enumerate(caches):
            ref = _global_kv(layer, spec.num_blocks * spec.block_size, dev)
            _canon(view, spec).copy_(ref.view(spec.num_blocks, spec.block_size, 2, HEADS, 128))
        del ref
        from fkv.connector.transport._packer import Packer
        from fkv.connector.transport._server import Server

        stats = _timers([(Server, "_answer_all"), (Packer, "pack"), (Packer, "_gather"),
                         (Packer, "sync")])
        packs = _trace_packs_prefill()
        with serve(_engine("bench-p", 1, 0), spec, caches, lease=600.0) as server:
            _send(conn, address=server.address)
            streamed = _prefill_stream(server, conn, cfg, dev, sbarrier, spec, caches) \
                if cfg.get("stream") else []
            _recv(conn)  # stop
            _send(conn, pending=len(server.pending()), errors=list(server.errors)[-3:], stats=stats,
                  stream_lasts=[lasts for lasts, _ in streamed],
                  stream_pubs=[pubs for _, pubs in streamed], packs=packs)
    except Exception as e:
        _send(conn, error=f"{type(e).__name__}: {e}")


def _decode_rank(conn: Any, cfg: dict[str, Any], case: dict[str, Any], rank: int,
                 barrier: Any, sbarrier: Any = None) -> None:
    import numpy as np
    import torch

    import fkv
    from fkv.connector import connect
    from fkv.connector.handshake import rank_heads

    os.environ.update({"UCX_TLS": case["ucx_tls"]} if case["ucx_tls"] else {})
    try:
        dev = _device(cfg, "d_gpu", rank)
        tp = case["decode_tp"]
        spec = _spec(cfg, tp, case["decode_layout"])
        caches = fkv.allocate(spec, dev)
        for view in caches:
            view.fill_(float("nan"))
        address = _recv(conn)["address"]
        if address is None:  # the prefill rank failed to start
            return
        from fkv.connector.transport._agent import Agent
        from fkv.connector.transport._client import Client
        from fkv.connector.transport._cma import SameHostCopy
        from fkv.connector.transport._ipc_path import IpcPath
        from fkv.connector.transport._packed_path import PackedPath
        from fkv.connector.transport._plan_path import PlanPath
        from fkv.telemetry import Telemetry

        from fkv.connector.transport._link import Link
        from fkv.connector.transport._outbox import Outbox
        from fkv.connector.transport._stream import Watch
        from fkv.ops.layers import PreparedMove
        from fkv.ops.reference import _convert as moves  # the staging moves in DRAM

        stats = _timers([(IpcPath, "_wait_written"), (IpcPath, "written"), (Watch, "ask"),
                         (PreparedMove, "__call__"), (PackedPath, "_ask"), (Agent, "read_descs"),
                         (Agent, "read"), (Agent, "wait"), (PackedPath, "_scatter"),
                         (PlanPath, "_run_staging"), (moves, "_check_move"), (moves, "_run"),
                         (Agent, "notify"), (IpcPath, "read"), (SameHostCopy, "copy"),
                         (Link, "notify"), (Outbox, "put"), (Client, "_stream"),
                         (Client, "_result"), (Telemetry, "record_read")])
        packs = _trace_packs_decode()
        client = connect(_engine("bench-d", tp, rank), spec, caches, remote_address=address,
                         timeout=60.0, strategy=case["strategy"])
        rng = np.random.default_rng(rank + 1)
        nb = cfg["blocks"]
        n = case["sizes"][-1]

        def blocks(i: int, n: int = n) -> tuple[list[int], list[int]]:
            if case["contiguous"]:
                start = (i * n) % (nb - n + 1)
                ids = list(range(start, start + n))
                return ids, ids
            return rng.permutation(nb)[:n].tolist(), rng.permutation(nb)[:n].tolist()

        # correctness first: one request, bit for bit against the global KV (the first read
        # after connect, timed: it must not pay compiles)
        local, remote = blocks(0)
        t_first = time.perf_counter()
        result = client.read("check", local, remote, timeout=120.0)
        first = time.perf_counter() - t_first
        if not result.ok:
            raise RuntimeError(f"check read failed: {result.error}")
        lo, cnt = rank_heads(HEADS, tp, rank)
        r_ids = torch.as_tensor(remote, device=dev)
        l_ids = torch.as_tensor(local, device=dev)
        for layer, view in enumerate(caches):
            ref = _global_kv(layer, nb * 16, dev).view(nb, 16, 2, HEADS, 128)
            want = ref[r_ids][..., lo:lo + cnt, :].to(view.dtype)
            got = _canon(view, spec)[l_ids]
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                raise RuntimeError(f"rank {rank}: layer {layer} bytes differ from the reference")
        del ref, want, got
        # time to first byte: one-block reads
        ttfb = []
        for i in range(cfg["ttfb_reps"]):
            barrier.wait()
            r = client.read(f"ttfb-{i}", [i % nb], [(7 * i) % nb], timeout=60.0)
            ttfb.append(r.seconds)
        # throughput: all ranks at once, rotating block sets, each request size in turn
        runs_by_size: dict[int, list[Any]] = {}
        stats_by_size: dict[int, Any] = {}
        packs_by_size: dict[int, Any] = {}
        for n in case["sizes"]:
            for seconds in stats.values():
                seconds.clear()
            packs.clear()
            runs = []
            for i in range(cfg["warmup"] + cfg["reps"]):
                local, remote = blocks(i + 1, n)
                barrier.wait()
                r = client.read(f"rep-{n}-{i}", local, remote, timeout=120.0)
                if not r.ok:
                    raise RuntimeError(f"read failed: {r.error}")
                if i >= cfg["warmup"]:
                    runs.append((r.seconds, r.transfer_seconds, r.bytes, r.descriptors,
                                 r.pack_seconds, r.strategy))
            runs_by_size[n] = runs
            stats_by_size[n] = {k: list(v) for k, v in stats.items()}
            packs_by_size[n] = [p for p in packs if p[0].startswith(f"rep-{n}-")
                                and int(p[0].rsplit("-", 1)[1]) >= cfg["warmup"]]
        stream_ends: list[list[float]] = []
        stream_news: list[list[float]] = []    # when the last layer's news reached this rank
        stream_landed: list[list[float]] = []  # when the last layer landed
        stream_layers: list[list[list[float]]] = []  # when each layer landed
        stream_cpu: list[list[float]] = []     # the process's CPU seconds during each read
        stream_stats: dict[int, Any] = {}       # the stages' timers during the streamed reads
        if cfg.get("stream"):
            from fkv.connector.transport._stream import Watch

            news: list[float] = []
            beyond = Watch.beyond

            def timed_beyond(self: Any, *a: Any, **kw: Any) -> int:
                got = beyond(self, *a, **kw)
                news.append(time.perf_counter())
                return got

            Watch.beyond = timed_beyond  # type: ignore[method-assign]
            for n in case["sizes"]:
                local, remote = _stream_blocks(cfg, n)
                ends, heard, landed, cpu, layers = [], [], [], [], []
                for seconds in stats.values():
                    seconds.clear()
                for rep in range(cfg["stream_reps"]):
                    sbarrier.wait()
                    news.clear()
                    c0 = time.process_time()
                    t0 = time.perf_counter()  # right before the call: `landed` below uses it
                    r = client.read(f"st-{n}-{rep}", local, remote, timeout=120.0, stream=True)
                    ends.append(time.perf_counter())
                    cpu.append(time.process_time() - c0)
                    if not r.ok:
                        raise RuntimeError(f"streamed read failed: {r.error}")
                    heard.append(news[-1] if news else ends[-1])
                    landed.append(t0 + r.layer_seconds[-1])
                    layers.append([t0 + s for s in r.layer_seconds])
                stream_ends.append(ends)
                stream_layers.append(layers)
                stream_news.append(heard)
                stream_landed.append(landed)
                stream_cpu.append(cpu)
                stream_stats[n] = {k: list(v) for k, v in stats.items()}
        rows_by = "process_vm_readv" if "process_vm_readv" in client.describe() else "nixl"
        _send(conn, strategy=client.plan.strategy, rows_by=rows_by, runs=runs_by_size, ttfb=ttfb,
              stats=stats_by_size, packs=packs_by_size, first_read=first, stream_ends=stream_ends,
              stream_news=stream_news, stream_landed=stream_landed, stream_layers=stream_layers,
              stream_cpu=stream_cpu,
              stream_stats=stream_stats)
        client.close()
    except Exception as e:
        barrier.abort()
        _send(conn, error=f"{type(e).__name__}: {e}")


# -- the parent ---------------------------------------------------------------------------------------

def _summarize(case: Case, cfg: dict[str, Any], outs: list[dict[str, Any]], bye: dict[str, Any],
               dtp: int) -> None:
    case.plan_strategy = outs[0]["strategy"]
    case.rows_by = outs[0].get("rows_by", "")
    reps = len(outs[0]["runs"])
    payload = case.request_blocks * 2 * 16 * (HEADS // dtp) * 128 * 2 * cfg["layers"]
    agg, wall, share, pack = [], [], [], []
    for i in range(reps):
        runs = [o["runs"][i] for o in outs]
        slowest = max(r[0] for r in runs)
        agg.append(dtp * payload / slowest / 1e9)
        wall.append(slowest)
        share.append(sum(r[1] for r in runs) / sum(r[0] for r in runs))
        pack.append(sum(r[4] for r in runs) / sum(r[0] for r in runs))
    half = max(1, reps // 2)  # the same case timed twice: first half, then second half
    case.repeat_gbps = statistics.median(agg[half:]) if reps > 1 else 0.0
    case.gbps = statistics.median(agg[:half]) if reps > 1 else agg[0]
    case.ms = statistics.median(wall) * 1e3
    case.read_share = statistics.median(share)
    case.pack_share = statistics.median(pack)
    case.path = "/".join(sorted({r[5] for o in outs for r in o["runs"]}))
    case.profile = _profile(bye.get("stats", {}), [o["stats"] for o in outs], reps)
    case.rank_gbps = [statistics.median(payload / r[0] / 1e9 for r in o["runs"]) for o in outs]
    case.bytes_per_request = sum(o["runs"][0][2] for o in outs)
    case.payload_per_request = dtp * payload
    case.descriptors_per_request = statistics.mean(o["runs"][0][3] for o in outs)
    case.ttfb_ms = statistics.median(t for o in outs for t in o["ttfb"]) * 1e3


def _run_case(cfg: dict[str, Any], case: Case) -> list[Case]:
    ctx = mp.get_context("spawn")
    dtp = case.decode_tp
    barrier = ctx.Barrier(dtp)
    sbarrier = ctx.Barrier(dtp + 1)
    cfg = {**cfg, "sizes": case.sizes}
    pp, pc = ctx.Pipe()
    p = ctx.Process(target=_prefill_rank, args=(pc, cfg, asdict(case), sbarrier), daemon=True)
    p.start()
    ds = []
    for rank in range(dtp):
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_decode_rank, args=(b, cfg, asdict(case), rank, barrier,
                                                      sbarrier), daemon=True)
        proc.start()
        ds.append((proc, a))
    try:
        hello = _recv(pp)
        for _, conn in ds:
            _send(conn, address=hello.get("address"))
        if "error" in hello:
            raise RuntimeError(f"prefill: {hello['error']}")
        outs = [_recv(conn) for _, conn in ds]
        _send(pp, stop=True)
        bye = _recv(pp)
        errors = [o["error"] for o in outs if "error" in o] + ([bye["error"]] if "error" in bye
                                                                else [])
        if errors:
            raise RuntimeError("; ".join(errors))
        results = []
        for n in case.sizes:
            c = Case(**{**asdict(case), "request_blocks": n})
            _summarize(c, cfg, [{**o, "runs": o["runs"][str(n)], "stats": o["stats"][str(n)]}
                                for o in outs], bye, dtp)
            c.first_read_ms = 1e3 * max(o["first_read"] for o in outs)
            c.pack_hops = _pack_hops([o["packs"][str(n)] for o in outs], bye.get("packs", []))
            if cfg.get("stream"):
                k = case.sizes.index(n)
                reps = range(cfg["stream_reps"])

                def after_last(key: str, k: int = k, reps: range = reps) -> float:
                    return 1e3 * statistics.median(max(o[key][k][i] for o in outs)
                                                   - bye["stream_lasts"][k][i] for i in reps)

                c.stream_tail_ms = after_last("stream_ends")
                c.stream_news_ms = after_last("stream_news")
                c.stream_landed_ms = after_last("stream_landed")
                c.stream_layer_ms = _streamed_layer_ms(
                    [o["stream_layers"][k] for o in outs], bye["stream_pubs"][k])
                c.stream_cpu_ms = 1e3 * max(statistics.median(o["stream_cpu"][k]) for o in outs)
                c.stream_return_ms = 1e3 * statistics.median(
                    max(o["stream_ends"][k][i] - o["stream_landed"][k][i] for o in outs)
                    for i in reps)
                c.stream_profile = _profile({}, [o["stream_stats"][str(n)] for o in outs],
                                            cfg["stream_reps"])
                c.layer_ms = c.ms / cfg["layers"]
            results.append(c)
        return results
    finally:
        for proc, _ in [(p, None), *ds]:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _streamed_layer_ms(landed: list[list[list[float]]], published: list[list[float]]) -> float:
    """Median ms from a layer's publish to its landing on every decode rank, over the streamed
    requests and their middle layers (the first waits for the read to start, the last is the
    tail's): what moving one layer takes once it is written, with the news of it. ``landed``:
    per decode rank, per request, when each layer landed; ``published``: per request, when each
    publish returned. 0.0 with fewer than 3 layers."""
    spans = [1e3 * (max(rank[i][layer] for rank in landed) - pubs[layer])
             for i, pubs in enumerate(published) for layer in range(1, len(pubs) - 1)]
    return statistics.median(spans) if spans else 0.0


def _profile(prefill: dict[str, list[float]], decode: list[dict[str, list[float]]], reps: int
             ) -> dict[str, list[float]]:
    """``stage -> [median ms per call, calls per request]``: the decode ranks' timed requests,
    and the prefill's last calls (as many as the timed requests made; earlier ones were the check,
    TTFB and warm-up requests)."""
    out: dict[str, list[float]] = {}
    for name, seconds in decode[0].items():
        calls = [t for d in decode for t in d[name]]
        if calls:
            out[f"D {name.rsplit('.', 1)[1]}"] = [1e3 * statistics.median(calls),
                                              len(calls) / reps / len(decode)]
    for name, seconds in prefill.items():
        last = seconds[-reps * len(decode):]
        if last:
            out[f"P {name.rsplit('.', 1)[1]}"] = [1e3 * statistics.median(last), 0.0]
    return out


def _copy_ceiling(cfg: dict[str, Any]) -> float:
    """GB/s of a same-run device copy, bytes read + bytes written (docs/benchmarks.md): 1 GiB on a GPU (well
    beyond L2), 256 MiB of DRAM on the CPU (``fkv.bench._common.copy_ceiling_gbps``)."""
    import torch

    from fkv.bench._common import copy_ceiling_gbps

    dev = _device(cfg, "d_gpu")
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            gbps = copy_ceiling_gbps(100, "cuda")
        torch.cuda.empty_cache()
        return gbps
    return copy_ceiling_gbps(100, "cpu", 256 << 20)


def _peer_copy_gbps(src: int, dst: int, nbytes: int) -> float:
    """GB/s of payload of a ``copy_`` from ``cuda:src`` to ``cuda:dst`` (median of CUDA events)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    times = []
    with torch.cuda.device(dst):
        for i in range(30):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            e1.synchronize()
            if i >= 5:
                times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def _nccl_rank(rank: int, port: int, devs: tuple[int, int], nbytes: int, conn: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(devs[rank])
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{devs[rank]}")
        times = []
        for i in range(25):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
            torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
        _send(conn, seconds=statistics.median(times))
    except Exception as e:
        _send(conn, error=f"{type(e).__name__}: {e}")


def _nccl_gbps(devs: tuple[int, int], nbytes: int) -> tuple[float, str]:
    """GB/s of NCCL send/recv of ``nbytes`` between two processes (prefill GPU -> decode GPU)."""
    import socket

    if devs[0] == devs[1]:
        return 0.0, "NCCL needs two GPUs (one rank per GPU)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(2):
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_nccl_rank, args=(rank, port, devs, nbytes, b), daemon=True)
        proc.start()
        conns.append(a)
        procs.append(proc)
    outs = [_recv(c) for c in conns]
    for proc in procs:
        proc.join(timeout=30)
    if any("error" in o for o in outs):
        return 0.0, "; ".join(o["error"] for o in outs if "error" in o)
    return nbytes / max(o["seconds"] for o in outs) / 1e9, ""


def _link_ceilings(cfg: dict[str, Any], sizes: list[int], page: int) -> dict[int, dict[str, Any]]:
    """Same-run ceilings per request size (payload of a P TP=1 -> D TP=2 request): the peer copy
    prefill GPU -> decode GPU (``copy_``) and NCCL send/recv of the same bytes between two
    processes; plus the 1 GiB peer copy (key 0)."""
    if cfg["device"] != "cuda":
        return {}
    devs = (cfg["p_gpu"], cfg["d_gpu"])
    out: dict[int, dict[str, Any]] = {0: {"peer_copy_gbps": _peer_copy_gbps(*devs, 1 << 30)}}
    for n in sizes:
        nbytes = max(1, n * page * cfg["layers"] // 2)  # what one decode rank of two lands
        nccl, why = _nccl_gbps(devs, nbytes)
        out[n] = {"bytes": nbytes, "peer_copy_gbps": _peer_copy_gbps(*devs, nbytes),
                  "nccl_gbps": nccl, "nccl_note": why}
        print(f"  ceilings for {n}-block requests ({nbytes} B per decode rank): peer copy "
              f"{out[n]['peer_copy_gbps']:.1f} GB/s, NCCL {nccl:.1f} GB/s {why}", flush=True)
    return out


_BASE_CASES = (Case("link", 1, 1, "HND", "HND", strategy="nixl", contiguous=True),
               Case("hnd-direct", 1, 2, "HND", "HND", strategy="direct"),
               Case("nhd-staging", 1, 2, "NHD", "NHD"),
               Case("nhd-direct", 1, 2, "NHD", "NHD", strategy="direct"),
               Case("hnd2nhd-auto", 1, 2, "HND", "NHD"),
               Case("hnd2nhd-direct", 1, 2, "HND", "NHD", strategy="direct"),
               Case("hnd-staging", 1, 2, "HND", "HND", strategy="staging"),
               Case("hnd-packed", 1, 2, "HND", "HND", strategy="packed"),
               Case("nhd-packed", 1, 2, "NHD", "NHD", strategy="packed"),
               Case("hnd-auto", 1, 2, "HND", "HND"),
               Case("link-packed", 1, 1, "HND", "HND", strategy="packed", contiguous=True),
               Case("hnd-ipc", 1, 2, "HND", "HND", strategy="ipc"),
               Case("nhd-ipc", 1, 2, "NHD", "NHD", strategy="ipc"),
               Case("hnd2nhd-ipc", 1, 2, "HND", "NHD", strategy="ipc"),
               Case("hnd-ipc-tp1", 1, 1, "HND", "HND", strategy="ipc"))
CASE_NAMES = tuple(c.name for c in _BASE_CASES)


def _case_names(text: str) -> list[str]:
    """``--cases``: a comma list of :data:`CASE_NAMES` (argparse ``type=``)."""
    names = [t.strip() for t in text.split(",")]
    unknown = [n for n in names if n not in CASE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(CASE_NAMES)} "
                                         f"(got {text!r}: unknown {', '.join(map(repr, unknown))})")
    return names


def _request_sizes(args: argparse.Namespace) -> list[int]:
    """Request sizes in blocks: ``--sizes``, else ``--request-blocks``, else half the cache."""
    return args.sizes or [args.request_blocks or max(1, _cache_blocks(args) // 2)]


def _cache_blocks(args: argparse.Namespace) -> int:
    return args.blocks or (1024 if args.quick else 4096)


def _cases(args: argparse.Namespace) -> list[Case]:
    """The cases to run: ``--cases`` in the order given (each once), else every case."""
    by_name = {c.name: c for c in _BASE_CASES}
    base = [by_name[n] for n in dict.fromkeys(args.cases)] if args.cases else _BASE_CASES
    variants = args.ucx_tls.split(";") if args.ucx_tls else [""]
    sizes = _request_sizes(args)
    return [Case(**{**asdict(c), "ucx_tls": v, "sizes": sizes}) for v in variants for c in base]


def main(argv: list[str] | None = None) -> int:
    from fkv.bench import results
    from fkv.bench._common import parse_args

    from fkv.cli import int_list, non_negative_int, positive_float, positive_int

    p = argparse.ArgumentParser(prog="fkv bench transfer", description=__doc__.split("\n")[0])
    results.add_output_arguments(p, plot=True)
    p.add_argument("--quick", action="store_true", help="1024 blocks, fewer repetitions")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the caches live (default: cuda when available)")
    p.add_argument("--p-gpu", type=non_negative_int, default=0,
                   help="CUDA device of the prefill rank (default 0)")
    p.add_argument("--d-gpu", type=non_negative_int, default=0,
                   help="CUDA device of the decode ranks (default 0)")
    p.add_argument("--d-gpus", type=int_list(0), default=None,
                   help="comma list of CUDA devices, one per decode rank in turn (e.g. 1,0: "
                        "decode rank 0 on GPU 1, rank 1 on GPU 0); overrides --d-gpu")
    p.add_argument("--blocks", type=positive_int, default=None,
                   help="blocks per cache (default 4096, 1024 with --quick)")
    p.add_argument("--request-blocks", type=positive_int, default=None,
                   help="blocks per request, at most --blocks (default: half the cache)")
    p.add_argument("--layers", type=positive_int, default=1, help="layers per cache (default 1)")
    p.add_argument("--sizes", type=int_list(1), default=None,
                   help="comma list of request sizes in blocks, each at most --blocks, each case "
                        "run at each (e.g. 1,16,256,2048); overrides --request-blocks")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="timed reads per case (default 20, 6 with --quick)")
    p.add_argument("--stream", action="store_true",
                   help="also stream each request: the prefill computes (--compute-ms per layer) "
                        "and publishes layer after layer while the decode ranks read; reports the "
                        "tail (last layer published -> read complete)")
    p.add_argument("--compute-ms", type=positive_float, default=0.5,
                   help="prefill compute per layer when streaming (default 0.5)")
    p.add_argument("--compute-on", choices=("device", "host"), default="device",
                   help="where the streaming prefill computes: 'device' (matmuls on its GPU, which "
                        "the decode shares when both use one GPU) or 'host' (a sleep: the GPU "
                        "stays free, as when prefill and decode have a GPU each)")
    p.add_argument("--stream-write", choices=("kv", "none"), default="kv",
                   help="what the streaming prefill writes before each publish: 'kv' (the "
                        "layer's KV of the request, with write_kv, as a prefill does: the "
                        "decode then copies bytes just written) or 'none' (it only publishes: "
                        "the bytes were written when the caches were filled)")
    p.add_argument("--cases", type=_case_names, default=None,
                   help=f"comma list of {','.join(CASE_NAMES)}, run in the order given "
                        f"(default: all)")
    p.add_argument("--ucx-tls", default="",
                   help="';'-separated UCX_TLS values to try (each case under each); "
                        "default: the environment's")
    args = parse_args(p, argv)  # a --plot without matplotlib: refused before the run
    blocks = _cache_blocks(args)
    too_big = [n for n in _request_sizes(args) if n > blocks]
    if too_big:
        flag = "--sizes" if args.sizes else "--request-blocks"
        p.error(f"argument {flag}: a request of {too_big[0]} blocks is larger than the cache "
                f"({blocks} blocks, --blocks)")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    d_gpus = args.d_gpus or []
    cfg = {"device": args.device, "p_gpu": args.p_gpu,
           "d_gpu": d_gpus[0] if d_gpus else args.d_gpu, "d_gpus": d_gpus, "blocks": blocks,
           "request_blocks": args.request_blocks or max(1, blocks // 2), "layers": args.layers,
           "reps": args.reps or (6 if args.quick else 20), "warmup": 2,
           "ttfb_reps": 5 if args.quick else 20, "stream": args.stream,
           "compute_ms": args.compute_ms, "compute_on": args.compute_on,
           "stream_write": args.stream_write, "stream_reps": 3 if args.quick else 5}
    cases = _cases(args)
    page = 2 * 16 * HEADS * 128 * 2
    request_bytes = cfg["request_blocks"] * page * cfg["layers"]
    ceiling = _copy_ceiling(cfg)
    links = _link_ceilings(cfg, sorted({n for c in cases for n in c.sizes}), page)
    env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "FKV_NIXL_", "NIXL_", "FKV_CMA"))}
    from fkv.connector.transport._agent import default_progress, progress_mode

    decode_default = default_progress("DRAM" if args.device == "cpu" else "VRAM")
    progress = {role: "{}({} us)".format(*mode) if mode[0] == "poll" else mode[0]
                for role, mode in (("prefill", progress_mode(None, "1")),
                                   ("decode", progress_mode(None, decode_default)))}
    print(f"fkv bench transfer: {args.device}, {blocks} blocks x {cfg['layers']} layer(s), "
          f"requests of {cfg['request_blocks']} blocks ({request_bytes / 2**20:.0f} MiB per P "
          f"page set), same-run copy ceiling {ceiling:.0f} GB/s (read + written); env "
          f"{env or '{}'}; NIXL progress threads {progress}", flush=True)
    done: list[Case] = []
    header = results.environment(args.device)
    path, created, run = None, None, None
    for case in cases:
        try:
            rows = _run_case(cfg, case)
        except Exception as e:
            case.error = f"{type(e).__name__}: {e}"
            rows = [case]
        for row in rows:
            row.pct_of_copy = 100 * row.gbps / (ceiling / 2)
            peer = links.get(row.request_blocks, {}).get("peer_copy_gbps")
            row.vs_peer_copy = row.gbps / peer if peer and row.gbps else 0.0
            nccl = links.get(row.request_blocks, {}).get("nccl_gbps")
            row.vs_nccl = row.gbps / nccl if nccl and row.gbps else 0.0
            print(f"  {row.name:12s} {row.request_blocks:6d} {row.ucx_tls or '(env)':24s} "
                  + (f"error: {row.error}" if row.error else
                     f"{row.gbps:7.2f} GB/s (repeat {row.repeat_gbps:.2f}), "
                     f"{row.ms:.3f} ms/read, first read {row.first_read_ms:.1f} ms"
                     + (f"; streamed tail {row.stream_tail_ms:.3f} ms (one layer "
                        f"{row.layer_ms:.3f} ms of the read, {row.stream_layer_ms:.3f} ms "
                        f"streamed; news {row.stream_news_ms:.3f}, landed "
                        f"{row.stream_landed_ms:.3f}, returned +{row.stream_return_ms:.3f}; "
                        f"decode CPU {row.stream_cpu_ms:.1f} ms per "
                        f"read)" if cfg["stream"] and not row.error
                        else "")),
                  flush=True)
            if row.profile:
                print("      ms/call: " + ", ".join(f"{k} {v[0]:.3f}"
                                                   for k, v in row.profile.items()), flush=True)
            if row.pack_hops:
                print(f"      pack hops, ms (first pack of a read | all {row.pack_hops['packs']}; "
                      f"{row.pack_hops['retries']} busy answers): "
                      + ", ".join(f"{k} {row.pack_hops['first'].get(k, 0):.3f} | {v:.3f}"
                                  for k, v in row.pack_hops["all"].items()), flush=True)
        done += rows
        # after every case, into the same file: a run cut short keeps what it measured
        run = _to_run(done, cfg, args, ceiling, links, blocks, header, env, progress)
        run.created = created = created or run.created  # one run, one timestamp: its name
        if path is None:
            path = results.save(run, args)
        else:
            results.write(run, json_path=path)
    if getattr(args, "plot", None) and run is not None:
        from fkv.bench import plots

        print(f"plot: {plots.plot_transfer(run.to_file(), args.plot)}")
    _table(done, ceiling)
    return 1 if any(c.error for c in done) else 0


def _to_run(cases: list[Case], cfg: dict[str, Any], args: argparse.Namespace, ceiling: float,
            links: dict[int, dict[str, Any]], blocks: int, header: dict[str, Any],
            env: dict[str, str], progress: dict[str, str]) -> Any:
    """The result file of the cases measured so far."""
    from fkv.bench import results

    run = results.Run("transfer", config={**cfg, "sizes": sorted({c.request_blocks
                                                                 for c in cases})},
                      env=header, device=args.device)
    run.ceiling("copy_gbps", ceiling)
    if 0 in links:
        run.ceiling("peer_copy_gbps", links[0]["peer_copy_gbps"])
    where = (f"cuda:{cfg['p_gpu']}->cuda:{','.join(map(str, cfg['d_gpus'] or [cfg['d_gpu']]))}"
             if args.device == "cuda" else "cpu")
    if args.device == "cuda" and header.get("mps"):
        where += " under MPS"  # processes on one GPU overlap their kernels: another case
    for c in cases:
        link = links.get(c.request_blocks, {})
        streamed = (f", streamed over {cfg['compute_ms']:g} ms/layer of "
                    f"{'host' if cfg['compute_on'] == 'host' or args.device != 'cuda' else 'GPU'}"
                    f" compute" if cfg["stream"] else "")
        run.add(f"{c.name} {c.request_blocks} blocks x{cfg['layers']} layers of {blocks} "
                f"{where}{' UCX_TLS=' + c.ucx_tls if c.ucx_tls else ''}{streamed}",
                params={"path": c.path or c.strategy, "series": c.name, "strategy": c.strategy,
                        "request_blocks": c.request_blocks,
                        "request_bytes": c.payload_per_request, "layers": cfg["layers"],
                        "cache_blocks": blocks, "prefill_tp": c.prefill_tp,
                        "decode_tp": c.decode_tp, "prefill_layout": c.prefill_layout,
                        "decode_layout": c.decode_layout, "devices": where,
                        "ucx_tls": c.ucx_tls,
                        **({"compute_ms": cfg["compute_ms"], "compute_on": cfg["compute_on"],
                            "stream_write": cfg["stream_write"]}
                           if cfg["stream"] else {})},
                metrics=None if c.error else {
                    "gbps": c.gbps, "repeat_gbps": c.repeat_gbps, "read_ms": c.ms,
                    "ttfb_ms": c.ttfb_ms, "first_read_ms": c.first_read_ms,
                    "of_copy_pct": c.pct_of_copy,
                    "peer_copy_gbps": link.get("peer_copy_gbps"),
                    "nccl_gbps": link.get("nccl_gbps") or None,
                    "of_peer_copy_x": c.vs_peer_copy or None, "of_nccl_x": c.vs_nccl or None,
                    "descriptors_count": c.descriptors_per_request,
                    "read_share_pct": 100 * c.read_share, "pack_share_pct": 100 * c.pack_share,
                    **({"stream_tail_ms": c.stream_tail_ms, "layer_ms": c.layer_ms,
                        "stream_news_ms": c.stream_news_ms,
                        "stream_landed_ms": c.stream_landed_ms,
                        "stream_cpu_ms": c.stream_cpu_ms,
                        "stream_return_ms": c.stream_return_ms,
                        "stream_layer_ms": c.stream_layer_ms or None,
                        "tail_over_layer_x": c.stream_tail_ms / c.layer_ms if c.layer_ms else None,
                        "tail_over_streamed_layer_x": c.stream_tail_ms / c.stream_layer_ms
                        if c.stream_layer_ms else None,
                        "nonstreamed_over_tail_x": c.ms / c.stream_tail_ms
                        if c.stream_tail_ms else None} if cfg["stream"] else {})},
                error=c.error,
                extra={"rank_gbps": c.rank_gbps, "profile_ms_per_call": c.profile,
                       **({"pack_hops_ms": c.pack_hops} if c.pack_hops else {}),
                       **({"stream_profile_ms_per_call": c.stream_profile}
                          if c.stream_profile else {}),
                       "plan_strategy": c.plan_strategy, "rows_by": c.rows_by, "nccl_note": link.get("nccl_note", "")})
    run.extra["env_transport"] = env
    run.extra["nixl_progress"] = progress
    return run


def _table(cases: list[Case], ceiling: float) -> None:
    head = (f"{'case':12s} {'blocks':>6s} {'UCX_TLS':22s} {'path':8s} {'GB/s':>7s} {'%copy':>6s} "
            f"{'rank GB/s':>14s} {'ms':>8s} {'READ%':>6s} {'pack%':>6s} {'desc/req':>9s} "
            f"{'TTFB ms':>8s}")
    print(f"\ncopy ceiling (same run, read + written): {ceiling:.0f} GB/s; %copy = GB/s over its "
          f"payload rate {ceiling / 2:.0f} GB/s")
    print(head)
    print("-" * len(head))
    for c in cases:
        if c.error:
            print(f"{c.name:12s} {c.ucx_tls or '(env)':22s} error: {c.error}")
            continue
        ranks = "/".join(f"{g:.2f}" for g in c.rank_gbps)
        print(f"{c.name:12s} {c.request_blocks:6d} {c.ucx_tls or '(env)':22s} {c.path:8s} "
              f"{c.gbps:7.2f} "
              f"{c.pct_of_copy:5.1f}% {ranks:>14s} {c.ms:8.2f} {100 * c.read_share:5.1f}% "
              f"{100 * c.pack_share:5.1f}% {c.descriptors_per_request:9.0f} {c.ttfb_ms:8.3f} "
              f"x{c.vs_peer_copy:.2f} peer x{c.vs_nccl:.2f} nccl")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
