"""The same-host path: ``fkv.ops`` kernels on the decode GPU read the mapped prefill caches.

Once per connection the decode rank maps every prefill rank it reads (``_ipc.Mapping``: CUDA IPC
in its own device's context) and prepares one :class:`fkv.ops.layers.LayerMove` per read: head
slice, layout, backend and block-size conversion of all layers in one launch. A request is then
two small host-to-device id copies, one launch per prefill rank read, and one wait for the
decode stream; the caller notifies the prefill ranks only after that wait (the bytes landed). No
descriptors, no staging buffer, no pack round trip.

A prefill process that died during the read is detected after the copy (its pid, when both
processes share a PID namespace): the read fails and nothing is reported as done.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fkv.connector.transport._base import Tally, TransferFailed, process_alive
from fkv.connector.transport._ipc import Mapping, _uuid, mps_running, sharing_note
from fkv.connector.transport._link import Local

__all__ = ["IpcPath"]


class IpcPath:
    """Reads of one connection straight from the prefill ranks' mapped caches."""

    name = "ipc"
    notifies_with_read = False  # the caller notifies every prefill rank after the copy

    def __init__(self, local: Local, plan: Any, peers: list[Any], engine_id: str) -> None:
        from fkv.ops.layers import LayerMove

        self.local, self.plan, self.engine_id = local, plan, engine_id
        self.mappings: dict[int, Mapping] = {}
        self.movers: list[tuple[int, Any]] = []
        self.pids: dict[int, int] = {}
        # per mapped rank its interprocess publish events (streaming), when every rank has them
        self.events: dict[int, list[Any]] = {}
        # the last request: its ids (host), tokens and prepared moves (one per read)
        self._request: tuple[Any, ...] | None = None
        self._done: Any = None  # the event each read records after its moves
        rs = peers[0].spec
        self.bytes_per_token = 0
        self.shared_gpu: list[int] = []
        try:
            for read in plan.reads:
                rank = read.remote_rank
                if rank not in self.mappings:
                    self.mappings[rank] = Mapping(peers[rank], local.device)
                    pid = peers[rank].ipc.pid
                    if pid:
                        self.pids[rank] = pid
                heads = None if rs.is_mla else read.remote_heads
                dheads = None if rs.is_mla else read.local_heads
                self.movers.append((rank, LayerMove(self.mappings[rank].views, rs, local.views,
                                                    local.spec, src_heads=heads,
                                                    dst_heads=dheads)))
                h = 1 if rs.is_mla else read.remote_heads[1] - read.remote_heads[0]
                self.bytes_per_token += ((1 if rs.is_mla else 2) * h * rs.head_size * rs.itemsize
                                         * rs.num_layers)
            self.events = self._open_events(peers)
            # prefill ranks on this very GPU: without MPS every copy waits for a context switch
            ours = _uuid(local.device.index if local.device.index is not None else 0)
            self.shared_gpu = [rank for rank in self.mappings if peers[rank].ipc.device_uuid == ours]
            self.warm()
        except BaseException:
            self.close()
            raise

    def _open_events(self, peers: list[Any]) -> dict[int, list[Any]]:
        """Open every mapped rank's publish events; none at all unless every rank has them and
        they opened and answered a query in the mapping's probe process (a streaming read then
        counts finished writes, as the NIXL paths do)."""
        import torch

        events = {}
        for rank in self.mappings:
            handles = peers[rank].ipc.events
            if not handles or not self.mappings[rank].events_ok:  # none, or refused by the probe
                return {}
            try:
                events[rank] = [torch.cuda.Event.from_ipc_handle(self.local.device, handle)
                                for handle in handles]
            except Exception:  # noqa: BLE001 - a handle CUDA refuses: count finished writes
                return {}
        return events

    def waits_on_events(self) -> bool:
        """Whether a streaming read may move every *published* layer at once, its stream
        waiting for the prefill ranks' publish events (else: only layers whose writes
        finished)."""
        return bool(self.events)

    def _wait_written(self, layer: int, deadline: float) -> None:
        """Poll the publish events of ``layer`` until every rank's completed (busy for the first
        2 ms: a layer's writes usually end within a layer's compute; then every 50 µs)."""
        events = [ev[layer % len(ev)] for ev in self.events.values()]
        t0 = time.monotonic()
        while not all(event.query() for event in events):
            now = time.monotonic()
            if now > deadline:
                raise TransferFailed(f"the writes of layer {layer} on prefill engine "
                                     f"{self.engine_id!r} did not finish before the read's "
                                     f"timeout (its publish event never completed)")
            if now - t0 > 0.002:
                time.sleep(0.00005)

    def written(self, start: int, published: int) -> int:
        """The end of the run of layers from ``start`` (below ``published``) whose publish
        events completed on every rank: their writes finished (an event recorded again later
        completes no earlier, so a slot shared with another layer can only say "not yet")."""
        layer = start
        while layer < published and all(events[layer % len(events)].query()
                                         for events in self.events.values()):
            layer += 1
        return layer

    def describe(self) -> str:
        ranks = ", ".join(f"P{rank}" for rank in self.mappings)
        return (f"ipc: the prefill caches of {ranks} are mapped into cuda:"
                f"{self.local.device.index}; one kernel per read moves every layer"
                f"{sharing_note(self.shared_gpu, mps_running())}")

    #: Token counts that reach every compiled variant of the move kernel (its tile covers 1 to 32
    #: tokens, a power of two, with or without a ragged last tile).
    WARM_TOKENS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)

    def warm(self) -> None:
        """Compile and run every kernel variant a request can need, into nothing (ids outside
        the caches are masked), so the first request after connect pays no compile."""
        import torch

        dev = self.local.device
        with torch.cuda.device(dev):
            far = torch.full((max(self.WARM_TOKENS),), -1, dtype=torch.int64, device=dev)
            for _, mover in self.movers:
                for tokens in self.WARM_TOKENS:
                    mover(far, far, tokens, validate=False)
            torch.cuda.current_stream(dev).synchronize()

    def layered(self) -> bool:
        """Whether a request can move a few layers at a time (streaming)."""
        return True

    def read(self, request_id: str, local: np.ndarray, remote: np.ndarray, tokens: int,
             deadline: float, tally: Tally, layers: tuple[int, int] | None = None,
             after_events: bool = False) -> None:
        """Move the request (``layers=(a, b)``: only those layers; ``after_events``: first wait,
        on the host and at most until ``deadline``, for each prefill rank's publish event of
        layer ``b - 1``, recorded after the writes of every layer up to it: a layer published
        while still being written moves the moment its writes finished).

        The wait is the host's, never the stream's: a peer whose writes never finish costs this
        read its timeout, and nothing stays queued behind its event to land later."""
        import torch

        dev = self.local.device
        t0 = time.perf_counter()
        with torch.cuda.device(dev):
            moves = self._prepared(local, remote, tokens)
            if after_events:
                last = (layers[1] if layers else len(self.local.views)) - 1
                self._wait_written(last, deadline)
            for move in moves:
                move(layers)
            done = self._done
            if done is None:
                done = self._done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(dev))
            while not done.query():
                if time.monotonic() > deadline:
                    raise TransferFailed(f"the ipc copy from prefill engine {self.engine_id!r} "
                                         f"did not finish before the read's timeout")
        tally.transfer_seconds += time.perf_counter() - t0
        dead = [rank for rank, pid in self.pids.items() if not process_alive(pid)]
        if dead:
            raise TransferFailed(f"prefill rank(s) {dead} of engine {self.engine_id!r} exited "
                                 f"during the read: its bytes are not trusted; reconnect once "
                                 f"it is back (client.reconnect())")
        share = 1.0 if layers is None else (layers[1] - layers[0]) / len(self.local.views)
        tally.bytes += round(tokens * self.bytes_per_token * share)

    def _prepared(self, local: np.ndarray, remote: np.ndarray, tokens: int) -> list[Any]:
        """The request's moves (one per prefill rank read), ids copied to the device once; the
        previous request's again when ids and tokens are the same (a streaming read moves its
        layers in many reads of one request, each a kept launch)."""
        import torch

        kept = self._request
        if (kept is not None and kept[2] == tokens and np.array_equal(kept[0], local)
                and np.array_equal(kept[1], remote)):
            return kept[3]
        dev = self.local.device
        lids = torch.from_numpy(np.ascontiguousarray(local, dtype=np.int64)).to(
            dev, non_blocking=True)
        rids = torch.from_numpy(np.ascontiguousarray(remote, dtype=np.int64)).to(
            dev, non_blocking=True)
        moves = [mover.prepare(rids, lids, tokens, validate=False) for _, mover in self.movers]
        self._request = (np.array(local, copy=True), np.array(remote, copy=True), tokens, moves)
        return moves

    def close(self) -> None:
        self._request = None
        self.movers.clear()
        for mapping in self.mappings.values():
            mapping.close()
        self.mappings.clear()
