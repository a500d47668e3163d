"""One rank of the transport tests, in its own process: ``python _transport_worker.py FD``.

Commands arrive as JSON lines on stdin; each gets one JSON line reply on file descriptor ``FD``
(stdout/stderr stay free for NIXL/UCX logs). A worker can host several prefill servers and decode
clients at once (one per test configuration), each under a name, so the test module starts its
processes once and reuses them.

Every prefill rank fills its caches from one global KV per layer (``global_kv``: float32 random
values of ``[num_blocks * block_size, 2, total_heads, head_size]`` for seed and layer, token ``t`` in
block ``t // N`` slot ``t % N``), through logical views; decode ranks poison their caches with NaN
and ``verify`` compares what landed against the same global KV, bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

import fkv
from fkv.connector import EngineDesc, connect, serve
from fkv.connector.handshake import rank_heads
from fkv.testing import assert_kv_equal

_CANON = ("B", "N", "two", "H", "C")


def make_spec(d: dict[str, Any]) -> fkv.KVCacheSpec:
    return fkv.KVCacheSpec(**d)


def make_engine(d: dict[str, Any]) -> EngineDesc:
    return EngineDesc(**d)


def heads_of(engine: EngineDesc, spec: fkv.KVCacheSpec) -> tuple[int, int]:
    if spec.is_mla:
        return 0, 1
    first, count = rank_heads(engine.total_num_kv_heads, engine.tp_size, engine.tp_rank)
    return first, first + count


def global_kv(seed: int, layer: int, tokens: int, heads: int, head_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + layer)
    return torch.randn(tokens, 2, heads, head_size, generator=g)


def canonical(view: torch.Tensor, spec: fkv.KVCacheSpec) -> torch.Tensor:
    """A writable ``[B, N, 2, H, C]`` view of one layer (MLA: ``[B, N, 1, 1, C]``)."""
    axes = spec.logical_axes
    if spec.is_mla:
        return view.unsqueeze(2).unsqueeze(3)
    return view.permute(*[axes.index(a) for a in _CANON])


def fill_prefill(caches: list[torch.Tensor], spec: fkv.KVCacheSpec, engine: EngineDesc,
                 seed: int) -> None:
    lo, hi = heads_of(engine, spec)
    total = 1 if spec.is_mla else engine.total_num_kv_heads
    tokens = spec.num_blocks * spec.block_size
    for layer, view in enumerate(caches):
        ref = global_kv(seed, layer, tokens, total, spec.head_size)[:, :1 if spec.is_mla else 2]
        src = ref[:, :, lo:hi].reshape(spec.num_blocks, spec.block_size, *ref.shape[1:2],
                                       hi - lo, spec.head_size)
        canonical(view, spec).copy_(src.to(view.dtype))


def poison(caches: list[torch.Tensor]) -> None:
    for view in caches:
        view.fill_(float("nan"))


def verify(caches: list[torch.Tensor], spec: fkv.KVCacheSpec, engine: EngineDesc,
           cmd: dict[str, Any]) -> str | None:
    """None when the request's tokens equal the global KV bit for bit (``fkv.testing``'s
    ``assert_kv_equal`` against a one-rank prefill cache of all heads: its message names layer,
    token, blocks and slots, K/V, head and channel) and every other block is still NaN."""
    rspec = make_spec(cmd["remote_spec"])
    total = 1 if spec.is_mla else engine.total_num_kv_heads
    local, remote = cmd["local"], cmd["remote"]
    n = cmd.get("num_tokens") or min(len(local) * spec.block_size, len(remote) * rspec.block_size)
    whole = rspec.evolve(num_kv_heads=total, dtype=spec.dtype)  # all heads, one rank
    reference = fkv.allocate(whole)
    fill_prefill(reference, whole, EngineDesc(engine_id="reference", tp_size=1, tp_rank=0,
                                              total_num_kv_heads=total), cmd["seed"])
    try:
        assert_kv_equal(caches, spec, reference, whole, block_ids_a=local, block_ids_b=remote,
                        num_tokens=n, heads_b=heads_of(engine, spec))
    except AssertionError as e:
        return str(e)
    others = sorted(set(range(spec.num_blocks)) - set(local) - set(cmd.get("also_written", ())))
    for layer, view in enumerate(caches):
        if others and not bool(canonical(view.cpu(), spec)[others].isnan().all()):
            return f"layer {layer}: blocks outside the request were written"
    return None


_MATMUL_SECONDS: list[float] = []


def _gpu_busy(seconds: float) -> None:
    """Queue at least ``seconds`` of GPU work on the current stream and return at once: fp32
    8192 x 8192 matmuls, as many as the time of one (measured once, after a warm-up) says.
    (``torch.cuda._sleep`` did not delay anything on the H200 image: a write queued behind 5 s of
    it had finished when the publish call returned.)"""
    a = torch.randn(8192, 8192, device=torch.cuda.current_device())
    out = torch.empty_like(a)
    if not _MATMUL_SECONDS:
        for _ in range(3):
            torch.mm(a, a, out=out)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(4):
            torch.mm(a, a, out=out)
        torch.cuda.synchronize()
        _MATMUL_SECONDS.append((time.perf_counter() - t) / 4)
    for _ in range(max(1, math.ceil(seconds / _MATMUL_SECONDS[0]))):
        torch.mm(a, a, out=out)


class Worker:
    def __init__(self, out: Any) -> None:
        self.out = out
        self.servers: dict[str, Any] = {}
        self.clients: dict[str, Any] = {}
        self.caches: dict[str, tuple[list[torch.Tensor], fkv.KVCacheSpec, EngineDesc]] = {}
        self.pending_reads: dict[str, Any] = {}
        self.rogues: dict[str, list[Any]] = {}  # NIXL agents of hostile tests, per name
        self.write_done: dict[str, list[float]] = {}  # cmd_publish's delayed writes, per name

    def reply(self, **fields: Any) -> None:
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()

    def run(self) -> None:
        for line in sys.stdin:
            cmd = json.loads(line)
            t0 = time.perf_counter()
            try:
                result = getattr(self, "cmd_" + cmd["cmd"])(cmd)
                self.reply(ok=True, seconds=time.perf_counter() - t0, **(result or {}))
            except Exception as e:
                self.reply(ok=False, type=type(e).__name__, error=str(e),
                           reasons=[r.code for r in getattr(e, "reasons", ())],
                           trace=traceback.format_exc())
            if cmd["cmd"] == "exit":
                return

    # -- env for UCX: read when an agent is created ------------------------------------------
    @staticmethod
    def _with_env(env: dict[str, str] | None, fn: Any) -> Any:
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # -- prefill -----------------------------------------------------------------------------
    def cmd_serve(self, cmd: dict[str, Any]) -> dict[str, Any]:
        spec, engine = make_spec(cmd["spec"]), make_engine(cmd["engine"])
        caches = fkv.allocate(spec, cmd.get("device", "cpu"))
        fill_prefill(caches, spec, engine, cmd["seed"])
        server = self._with_env(cmd.get("env"), lambda: serve(
            engine, spec, caches, host=cmd.get("host", "127.0.0.1"), join=cmd.get("join"),
            lease=cmd.get("lease", 60.0), pack_bytes=cmd.get("pack_bytes")))
        self.servers[cmd["name"]] = server
        self.caches[cmd["name"]] = (caches, spec, engine)
        return {"address": server.address, "pid": os.getpid()}

    def cmd_hold(self, cmd: dict[str, Any]) -> None:
        self.servers[cmd["name"]].hold(cmd["request_id"], cmd.get("blocks"), lease=cmd.get("lease"),
                                       layers_ready=cmd.get("layers_ready"))

    def cmd_publish(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``server.publish``; with ``delay_write`` (CUDA) a long kernel still runs when publish
        is called, and the layer's final bytes are written after it on the same stream."""
        server = self.servers[cmd["name"]]
        event = None
        if cmd.get("delay_write") or cmd.get("delay_seconds"):
            caches, spec, engine = self.caches[cmd["name"]]
            layer = cmd["layers_ready"] - 1
            saved = caches[layer].clone()
            caches[layer].fill_(float("nan"))
            torch.cuda.synchronize()
            if cmd.get("delay_seconds"):  # that long of GPU work first
                _gpu_busy(cmd["delay_seconds"])
            busy = torch.randn(4096, 4096, device=caches[layer].device)
            for _ in range(cmd.get("delay_write") or 0):
                busy = busy @ busy / 64.0   # seconds of work queued before the real bytes
            caches[layer].copy_(saved)
            event = torch.cuda.Event()
            event.record()
            done: list[float] = []  # when the delayed write ended (cmd_write_done)
            self.write_done[cmd["name"]] = done
            threading.Thread(target=lambda: (event.synchronize(),
                                             done.append(time.perf_counter())),
                             daemon=True).start()
        t = time.perf_counter()
        server.publish(cmd["request_id"], cmd["layers_ready"], event=event)
        return {"published_at": t, "returned_at": time.perf_counter()}

    def cmd_write_done(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """When the last delayed write of ``cmd_publish`` ended (``perf_counter``; waits)."""
        done = self.write_done[cmd["name"]]
        while not done:
            time.sleep(0.001)
        return {"at": done[0]}

    def cmd_pending(self, cmd: dict[str, Any]) -> dict[str, Any]:
        server = self.servers[cmd["name"]]
        return {"pending": sorted(server.pending()), "released": server.released(),
                "errors": list(server.errors)}

    def cmd_diagnostics(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self.servers[cmd["name"]].diagnostics()

    def cmd_checksum(self, cmd: dict[str, Any]) -> dict[str, Any]:
        caches = self.caches[cmd["name"]][0]
        return {"sum": [float(c.float().nan_to_num().sum()) for c in caches]}

    def cmd_pack_state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The pack buffer's size, slots held and a digest of its bytes (to see it untouched)."""
        server = self.servers[cmd["name"]]
        buf = server._packer.buffer.cpu()
        digest = int((buf.to(torch.int64) * torch.arange(1, buf.numel() + 1)).sum())
        return {"pack_bytes": server.pack_bytes, "held": server.packs_held(), "digest": digest}

    def cmd_stop_after_pack(self, cmd: dict[str, Any]) -> None:
        """Stop this process (SIGSTOP) right after its server answers the ``after``-th (default
        first) pack request of ``request_id``: the decode rank gets its reply, and its READ then
        finds nobody serving (a pipelined read: in the middle of the request)."""
        import signal

        from fkv.connector.transport import _side

        server = self.servers[cmd["name"]]
        answer_all = server._answer_all
        seen = [0]

        def answer_then_stop(batch: list[tuple[Any, bytes | None]]) -> None:
            # Decide before answering, so that nothing runs between the answer and the stop: a
            # READ served in that window would succeed. A NIXL progress thread can serve one
            # there; run the process without one (FKV_NIXL_PROGRESS_THREAD=0) to close it.
            stop = False
            for _, payload in batch:
                try:
                    msg = _side.decode_request(payload or b"")
                except _side.SideChannelError:
                    continue
                if isinstance(msg, _side.Pack) and msg.request_id == cmd["request_id"]:
                    seen[0] += 1
                    stop = stop or seen[0] == cmd.get("after", 1)
            answer_all(batch)
            if stop:
                os.kill(os.getpid(), signal.SIGSTOP)

        server._answer_all = answer_then_stop

    def cmd_poison_pack(self, cmd: dict[str, Any]) -> None:
        self.servers[cmd["name"]]._packer.buffer.fill_(0xA5)

    # -- decode ------------------------------------------------------------------------------
    def cmd_connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        spec, engine = make_spec(cmd["spec"]), make_engine(cmd["engine"])
        caches = fkv.allocate(spec, cmd.get("device", "cpu"))
        poison(caches)
        kwargs = {k: cmd[k] for k in ("strategy", "staging_bytes", "expected_engine",
                                      "pack_threshold") if k in cmd}
        client = self._with_env(cmd.get("env"), lambda: connect(
            engine, spec, caches, remote_address=cmd["address"], timeout=cmd.get("timeout", 20.0),
            **kwargs))
        self.clients[cmd["name"]] = client
        self.caches[cmd["name"]] = (caches, spec, engine)
        plan = client.plan
        return {"strategy": plan.strategy, "remote_ranks": list(plan.remote_ranks),
                "notify_only_ranks": list(plan.notify_only_ranks), "pid": os.getpid(),
                "packed": client.packed, "ipc": client.ipc, "describe": client.describe()}

    def _read(self, name: str, r: dict[str, Any]) -> dict[str, Any]:
        result = self.clients[name].read(r["request_id"], r["local"], r["remote"],
                                         timeout=r.get("timeout", 30.0),
                                         num_tokens=r.get("num_tokens"),
                                         stream=r.get("stream", False))
        ended = time.perf_counter()  # the read's own clock started ``seconds`` before its return
        state = self.clients[name]._state
        packed = state.packed
        plan_path = getattr(state, "plan_path", None)
        if result.strategy == "direct" and getattr(state, "direct", None) is not None:
            plan_path = state.direct  # a staging plan's small request, copied on one host
        return {"result_ok": result.ok, "bytes": result.bytes, "descriptors": result.descriptors,
                "error": result.error, "read_seconds": result.seconds, "path": result.strategy,
                "started_at": ended - result.seconds, "layer_seconds": list(result.layer_seconds),
                "pack_seconds": result.pack_seconds, "transfer_seconds": result.transfer_seconds,
                # a packed read's chunks, pipeline depth, most chunks in flight at once, ...
                "packed": dict(packed.last) if packed is not None and
                result.strategy == "packed" else None,
                # direct/staging: layer ranges read from READs computed while awaiting the layer
                "prepared_reads": getattr(plan_path, "prepared_reads", None),
                # ... and READs created during a wait that no read posted (released)
                "discarded_reads": getattr(plan_path, "discarded_reads", None),
                # ... and layer ranges moved through a staging window of a few layers
                "windowed_ranges": getattr(plan_path, "windowed_ranges", None)}

    def cmd_read_async(self, cmd: dict[str, Any]) -> None:
        """Start a read in a thread (``read_wait`` collects it): the worker keeps answering."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = self._read(cmd["name"], cmd)
            except Exception as e:
                box["result"] = {"result_ok": False, "error": f"{type(e).__name__}: {e}"}

        thread = threading.Thread(target=run)
        thread.start()
        self.pending_reads[cmd["name"]] = (thread, box)

    def cmd_read_wait(self, cmd: dict[str, Any]) -> dict[str, Any]:
        thread, box = self.pending_reads.pop(cmd["name"])
        thread.join()
        return box["result"]

    def cmd_read(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self._read(cmd["name"], cmd)

    def cmd_read_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Several reads from concurrent threads of this rank (the client serializes NIXL)."""
        out: list[Any] = [None] * len(cmd["reads"])

        def one(i: int, r: dict[str, Any]) -> None:
            try:
                out[i] = self._read(cmd["name"], r)
            except Exception as e:
                out[i] = {"result_ok": False, "error": f"{type(e).__name__}: {e}"}

        threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(cmd["reads"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"results": out}

    def cmd_verify(self, cmd: dict[str, Any]) -> dict[str, Any]:
        caches, spec, engine = self.caches[cmd["name"]]
        layers = cmd.get("layers")
        if layers is not None:  # the first ``layers`` layers landed, the others still NaN
            rest = [bool(c.isnan().all()) for c in caches[layers:]]
            if not all(rest):
                return {"mismatch": f"layers past {layers} were written: {rest}"}
            if layers == 0:
                return {"mismatch": None}
            caches, spec = caches[:layers], spec.evolve(num_layers=layers)
            cmd = {**cmd, "remote_spec": {**cmd["remote_spec"], "num_layers": layers}}
        return {"mismatch": verify(caches, spec, engine, cmd)}

    def cmd_untouched(self, cmd: dict[str, Any]) -> dict[str, Any]:
        caches = self.caches[cmd["name"]][0]
        return {"untouched": all(bool(c.isnan().all()) for c in caches)}

    def cmd_stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The client's or server's ``stats()`` and a few of its Prometheus samples."""
        obj = self.clients.get(cmd["name"]) or self.servers[cmd["name"]]
        registry = obj.prometheus()
        samples = {f"{name}|{json.dumps(labels, sort_keys=True)}":
                   registry.get_sample_value(name, labels) for name, labels in cmd["samples"]}
        return {"stats": obj.stats(), "samples": samples}

    def cmd_reconnect(self, cmd: dict[str, Any]) -> None:
        self.clients[cmd["name"]].reconnect(cmd.get("address"), timeout=cmd.get("timeout", 20.0))
        poison(self.caches[cmd["name"]][0])

    # -- hostile peers (tests/test_hostile.py) ----------------------------------------------
    def cmd_notify_raw(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send raw NIXL notifications (hex ``messages``) to prefill rank ``rank`` of client
        ``name``'s connection: from the client's own agent, or with ``fresh`` from a new NIXL
        agent (bound by no Hello) that added that rank's metadata. Fresh agents stay alive
        until ``stop`` so their notifications are not lost in flight."""
        from fkv.connector.transport._agent import Agent

        client = self.clients[cmd["name"]]
        state = client._connected()
        rank = cmd.get("rank", 0)
        messages = [bytes.fromhex(m) for m in cmd["messages"]]
        if not cmd.get("fresh"):
            for m in messages:
                client._agent.notify(state.link.names[rank], m)
            return {"agent": client._agent.name}
        rogue = Agent("rogue")
        self.rogues.setdefault(cmd["name"], []).append(rogue)
        remote = rogue.add_remote(state.peers[rank].agent_metadata, timeout=10.0)
        for m in messages:
            rogue.notify(remote, m)
        return {"agent": rogue.name}

    def cmd_rss(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """This process's resident set (``VmRSS`` of ``/proc/self/status``), in bytes."""
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return {"rss": int(line.split()[1]) * 1024}
        raise RuntimeError("no VmRSS in /proc/self/status")

    def cmd_precheck(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Check NIXL metadata blobs (hex) in one batch: the verdicts are cached by hash, so the
        connects that follow find them without a probe child each. ``like``: a connected
        client's name; the probe then prepares what that client's connects prepare on a peer of
        the same regions (the cache key a connect looks up), else the blobs' own descriptors."""
        from fkv.connector.transport import _metadata as M

        blobs = [bytes.fromhex(b) for b in cmd["blobs"]]
        preps = None
        if cmd.get("like"):  # the descriptors a connect of client ``like`` prepares on rank 0
            from fkv.connector.transport._agent import granule_table
            from fkv.connector.transport._link import _PROBE_ROWS

            link = self.clients[cmd["like"]]._state.link
            peer = link.peers[0]
            table = granule_table(peer.regions, link.granule, device_id=peer.device_id,
                                  limit=_PROBE_ROWS)
            preps = [(link.mem_types[0], table)] * len(blobs)
        verdicts = M.check_each(blobs, timeout=cmd.get("timeout", 120.0), preps=preps)
        return {"accepted": sum(isinstance(v, M.AgentMetadata) for v in verdicts),
                "timeouts": sum(isinstance(v, M.MetadataProbeTimeout) for v in verdicts)}

    def cmd_reconnect_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``client.reconnect(address)`` ``n`` times; each outcome: ``"connected"``, ``"FkvError:
        <message>"`` or, for anything that is not an FkvError, ``"NOT FKV <type>: <message>"``."""
        from fkv.errors import FkvError

        client = self.clients[cmd["name"]]
        outcomes, worst = [], 0.0
        for _ in range(cmd["n"]):
            t0 = time.monotonic()
            try:
                client.reconnect(cmd["address"], timeout=cmd.get("timeout", 10.0))
                outcomes.append("connected")
            except FkvError as e:
                outcomes.append(f"FkvError: {str(e)[:cmd.get('chars', 400)]}")
            except Exception as e:
                outcomes.append(f"NOT FKV {type(e).__name__}: {str(e)[:400]}")
            worst = max(worst, time.monotonic() - t0)
        return {"outcomes": outcomes, "worst": worst}

    def cmd_republish(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Prefill rank k > 0 publishes its entry again (a retry, with its own secret); says
        whether that secret appears anywhere in what rank 0 hands out (``Fetch``)."""
        from fkv.connector.transport import _side
        from fkv.connector.transport._sidelimits import frame_request

        server = self.servers[cmd["name"]]
        raw = frame_request(server.address, _side.encode_message(_side.Fetch()), timeout=10.0,
                            max_frame=_side.MAX_SIDE_MESSAGE_BYTES)
        entry = _side.decode_reply(raw).ranks[server.engine.tp_rank]
        server._publish(server.address, entry, 10.0)
        return {"secret_handed_out": server._secret in raw}

    def cmd_side_stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The server's side-channel counters, telemetry refusals and request table counts."""
        server = self.servers[cmd["name"]]
        return {"side": server._sock.stats(), "refused": server.stats()["refused_messages"],
                "counts": server.diagnostics()["counts"], "errors": list(server.errors)}

    # -- both --------------------------------------------------------------------------------
    def cmd_ping(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def cmd_stop(self, cmd: dict[str, Any]) -> None:
        for table in (self.servers, self.clients):
            obj = table.pop(cmd["name"], None)
            if obj is not None:
                obj.close()
        for rogue in self.rogues.pop(cmd["name"], []):
            rogue.close()
        self.caches.pop(cmd["name"], None)

    def cmd_exit(self, cmd: dict[str, Any]) -> None:
        for table in (self.clients, self.servers):
            for obj in table.values():
                obj.close()
            table.clear()


if __name__ == "__main__":
    with os.fdopen(int(sys.argv[1]), "w") as out:
        Worker(out).run()
