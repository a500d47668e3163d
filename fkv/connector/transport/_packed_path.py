"""Packed reads, decode side: ask the prefill ranks to pack, READ the packs, scatter them.

For each chunk of a request (chunks keep every pack inside the prefill rank's share of its pack
buffer and all packs of the chunk inside the local staging buffer), the decode rank:

1. sends a ``Pack`` to every prefill rank it reads (block ids, that rank's head range it needs,
   token count; see ``_packer``) through one persistent DEALER socket per rank, and
   waits for every reply (a busy buffer answers ``retry``: ask again until the deadline);
2. posts one READ per rank (one descriptor, or ``FKV_PACK_DESCRIPTORS`` equal pieces) of the
   packed bytes into its own area of the local staging buffer; the READ carries the slot's free
   notification;
3. once every READ is DONE, runs ``fkv.ops.scatter`` per rank and layer (any local layout and
   block size: the pack holds staging blocks of the prefill block size).

The request notification (``"<request id>:<decode tp>"``) goes to every prefill rank of the group
after the last chunk. Failures (no pack reply, a refusal, a READ that errs or outlives the
deadline) raise ``TransferFailed``; slots already packed whose READ was never posted are freed
with a notification, the others by their lease on the prefill side.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from typing import Any

import attrs
import numpy as np

from fkv.connector.transport import _side
from fkv.connector.transport._agent import Xfer
from fkv.connector.transport._base import Tally, TransferFailed, kernels, on_device, split_chunks
from fkv.connector.transport._link import Link, Local, wait_reads
from fkv.connector.transport._packer import ALIGN, FREE_PREFIX, align, pack_layer_bytes

__all__ = ["PackedPath", "PackedSizing", "packed_sizing"]

_tokens = itertools.count(1)


def _pieces() -> int:
    """Descriptors per pack READ (``FKV_PACK_DESCRIPTORS``, default 1)."""
    try:
        return max(1, int(os.environ.get("FKV_PACK_DESCRIPTORS", "1") or 1))
    except ValueError:
        return 1


@attrs.frozen
class PackedSizing:
    """How packed reads of one connection are cut: pack bytes per remote block per read (all
    layers), the most tokens one chunk moves, and the local staging bytes packed reads need."""

    per_block: tuple[int, ...]
    chunk_tokens: int
    buffer_bytes: int


def packed_sizing(local: Local, plan: Any, entries: list[Any], rs: Any
                  ) -> tuple[PackedSizing | None, str]:
    """The packed sizing of a connection, or None and the reason packed reads are not possible."""
    ls = local.spec
    per_block, caps = [], []
    for read in plan.reads:
        entry = entries[read.remote_rank]
        if not entry.address or not entry.pack_bytes:
            return None, (f"prefill rank {read.remote_rank} serves no pack buffer "
                          f"(serve(..., pack_bytes=0))")
        heads = read.remote_heads[1] - read.remote_heads[0]
        per_block.append(rs.num_layers * pack_layer_bytes(rs, 1, heads))
        # every decode rank of the group may hold a slot at once
        caps.append(entry.pack_bytes // plan.notifications // ALIGN * ALIGN)
    blocks = min(cap // b for cap, b in zip(caps, per_block, strict=True))
    room = local.staging_bytes_max - ALIGN * len(per_block)
    blocks = min(blocks, max(0, room) // sum(per_block))
    step = math.lcm(ls.block_size, rs.block_size)
    tokens = blocks * rs.block_size // step * step
    if tokens == 0:
        return None, (f"one chunk of {step} tokens needs {step // rs.block_size} remote blocks "
                      f"of {sum(per_block)} packed bytes, more than the prefill ranks' pack "
                      f"buffers ({[e.pack_bytes for e in entries]} bytes, shared by "
                      f"{plan.notifications} decode ranks) or staging_bytes="
                      f"{local.staging_bytes_max} hold")
    # a chunk never needs more than the whole remote cache (rounded to whole steps)
    tokens = min(tokens, -(-rs.num_blocks * rs.block_size // step) * step)
    n = -(-tokens // rs.block_size)
    size = sum(align(n * b) for b in per_block)
    return PackedSizing(tuple(per_block), tokens, size), ""


class PackedPath:
    """Packed reads of one connection: the prefill ranks' pack addresses and buffers, the chunk
    size, and one DEALER socket per prefill rank read."""

    name = "packed"
    notifies_with_read = False  # the request notification goes after the last chunk

    def __init__(self, link: Link, sizing: PackedSizing) -> None:
        self.conn = link
        self.per_block = list(sizing.per_block)
        self.chunk_tokens = sizing.chunk_tokens
        self.buffer_bytes = sizing.buffer_bytes
        self.dealers: dict[int, _side.Dealer] = {}
        self.spin = link.spin
        try:
            for read in link.plan.reads:
                rank = read.remote_rank
                self.dealers[rank] = _side.Dealer(link.local.zctx, link.entries[rank].address,
                                                  link.local.curve)
        except BaseException:
            self.close()
            raise

    def layered(self) -> bool:
        """Packs hold every layer: a streaming request reads packed once all are published."""
        return False

    def describe(self) -> str:
        conn = self.conn
        ranks = ", ".join(f"P{r.remote_rank} ({b} B per block)"
                          for r, b in zip(conn.plan.reads, self.per_block, strict=True))
        return (f"packed: each prefill rank read gathers the request into its pack buffer, then "
                f"one READ per rank per chunk of up to {self.chunk_tokens} tokens: {ranks}")

    # -- one request -------------------------------------------------------------------------------
    def read(self, request_id: str, local: np.ndarray, remote: np.ndarray, tokens: int,
             deadline: float, tally: Tally) -> None:
        ls, rs = self.conn.local.spec, self.conn.remote_spec
        for lc, rc, n in split_chunks(local, remote, tokens, self.chunk_tokens, ls.block_size,
                                      rs.block_size):
            self._chunk(request_id, lc, rc, n, deadline, tally)

    def _chunk(self, request_id: str, local: np.ndarray, remote: np.ndarray, tokens: int,
               deadline: float, tally: Tally) -> None:
        conn = self.conn
        agent, client = conn.local.agent, conn.local
        reads = conn.plan.reads
        sizes = [remote.size * b for b in self.per_block]
        offsets = np.concatenate(([0], np.cumsum([align(s) for s in sizes])[:-1])).tolist()
        t0 = time.perf_counter()
        packs = self._ask(request_id, remote, tokens, sizes, deadline)
        tally.pack_seconds += time.perf_counter() - t0
        xfers: list[Xfer] = []
        ranks: list[int] = []
        t1 = time.perf_counter()
        try:
            base = conn.staging.data_ptr()
            for read, pack, off in zip(reads, packs, offsets, strict=True):
                rank = read.remote_rank
                entry = conn.entries[rank]
                local_tab, remote_tab = _tables(base + off, entry.pack_base + pack.offset,
                                                pack.nbytes, _pieces(), client.device_id,
                                                conn.peers[rank].device_id)
                xfers.append(agent.read_descs(local_tab, client.mem_type, remote_tab,
                                              entry.mem_type, conn.names[rank], pack.nbytes,
                                              FREE_PREFIX + str(pack.slot).encode()))
                ranks.append(rank)
                tally.descriptors += len(local_tab)
            wait_reads(agent, xfers, ranks, conn.engine_id, deadline, self.spin)
        except TransferFailed:
            self._free(packs[len(xfers):], reads[len(xfers):])
            raise
        finally:
            tally.bytes += sum(x.nbytes for x in xfers if x.state == "DONE")
            tally.transfer_seconds += time.perf_counter() - t1
            for x in xfers:
                agent.release(x)
        self._scatter(local, tokens, remote.size, offsets)

    def _ask(self, request_id: str, remote: np.ndarray, tokens: int, sizes: list[int],
             deadline: float) -> list[_side.Packed]:
        """Send every rank its Pack, then collect the replies (asking again while busy)."""
        conn = self.conn
        ids = remote.tolist()
        reads = conn.plan.reads
        tokens_sent: list[int] = []

        def send(read: Any) -> int:
            token = next(_tokens)
            heads = read.remote_heads if not conn.remote_spec.is_mla else (0, 1)
            self.dealers[read.remote_rank].send(_side.Pack(
                token=token, request_id=request_id, block_ids=ids, heads=tuple(heads),
                num_tokens=tokens, timeout=max(1e-3, deadline - time.monotonic())))
            return token

        packs: list[_side.Packed] = []
        try:
            tokens_sent = [send(read) for read in reads]
            for i, read in enumerate(reads):
                packs.append(self._reply(read, tokens_sent[i], send, sizes[i], deadline))
        except (TransferFailed, _side.SideChannelError) as e:
            self._free(packs, reads[:len(packs)])
            if isinstance(e, TransferFailed):
                raise
            raise TransferFailed(str(e)) from e
        return packs

    def _reply(self, read: Any, token: int, send: Any, nbytes: int, deadline: float
               ) -> _side.Packed:
        conn = self.conn
        rank = read.remote_rank
        who = f"prefill rank {rank} of engine {conn.engine_id!r} ({conn.entries[rank].address})"
        pause = 0.0002
        while True:
            reply = self.dealers[rank].wait(token, deadline, self.spin)
            if reply is None:
                raise TransferFailed(f"{who} did not answer the pack request before the read's "
                                     f"timeout: the prefill process is hung, dead or unreachable: "
                                     f"reconnect once it is back (client.reconnect())")
            if isinstance(reply, _side.Packed):
                cap = conn.entries[rank].pack_bytes
                if reply.nbytes != nbytes or reply.offset + reply.nbytes > cap:
                    raise TransferFailed(f"{who} packed {reply.nbytes} bytes at offset "
                                         f"{reply.offset} of its {cap}-byte buffer; expected "
                                         f"{nbytes} bytes inside it")
                return reply
            if not reply.retry:
                raise TransferFailed(f"{who}: {reply.message}")
            if time.monotonic() + pause >= deadline:
                raise TransferFailed(f"{who}: the pack buffer stayed busy until the read's "
                                     f"timeout ({reply.message})")
            time.sleep(pause)
            pause = min(0.005, pause * 2)
            token = send(read)

    def _free(self, packs: list[_side.Packed], reads: Any) -> None:
        """Free slots whose READ will never come (best effort: the rank may be gone)."""
        for pack, read in zip(packs, reads):
            try:
                self.conn.local.agent.notify(self.conn.names[read.remote_rank],
                                               FREE_PREFIX + str(pack.slot).encode())
            except TransferFailed:
                continue

    def _scatter(self, local: np.ndarray, tokens: int, nblocks: int, offsets: list[int]) -> None:
        import torch

        from fkv.ops.relayout import staging_spec
        from fkv.tensors import torch_dtype

        conn, client = self.conn, self.conn.local
        ls, rs = client.spec, conn.remote_spec
        scatter = kernels(client.device).scatter
        dtype = torch_dtype(ls.dtype)
        with on_device(client.device):
            ids = torch.as_tensor(local, device=client.device)
            for read, off, per_block in zip(conn.plan.reads, offsets, self.per_block, strict=True):
                h = read.local_heads[1] - read.local_heads[0]
                shape = staging_spec(ls, nblocks, num_heads=h, block_size=rs.block_size
                                     ).physical_shape
                layer_bytes = nblocks * per_block // ls.num_layers
                heads = None if ls.is_mla else read.local_heads
                for layer, view in enumerate(client.views):
                    start = off + layer * layer_bytes
                    src = conn.staging[start:start + layer_bytes].view(dtype).view(shape)
                    scatter(src, view, ls, ids, heads=heads, num_tokens=tokens,
                            block_size=rs.block_size)

    def close(self) -> None:
        for dealer in self.dealers.values():
            dealer.close()
        self.dealers.clear()


def _tables(local: int, remote: int, nbytes: int, pieces: int, local_dev: int, remote_dev: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """``Nx3`` uint64 descriptor tables moving ``nbytes`` from ``remote`` to ``local`` in
    ``pieces`` nearly equal parts (ALIGN-multiples but the last)."""
    part = max(ALIGN, align(-(-nbytes // pieces)))
    starts = np.arange(0, nbytes, part, dtype=np.uint64)
    lengths = np.minimum(np.uint64(part), np.uint64(nbytes) - starts)
    tabs = []
    for base, dev in ((local, local_dev), (remote, remote_dev)):
        t = np.empty((starts.size, 3), dtype=np.uint64)
        t[:, 0] = np.uint64(base) + starts
        t[:, 1] = lengths
        t[:, 2] = dev
        tabs.append(t)
    return tabs[0], tabs[1]
