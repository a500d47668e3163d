"""A decode rank's state for one prefill engine, and the plan's READ paths (direct and staging).

:class:`Connection` holds the accepted plan, every prefill rank's decoded metadata, the NIXL names
of the ranks it reads or notifies, the descriptor lists prepared once (the local caches and the
staging buffer, each remote rank's caches, cut into equal *granules*: see ``fkv.connector._nixl``),
the registered staging buffer (shared by the staging path and packed reads) and, when packed reads
are possible, the :class:`fkv.connector._unpack.PackedPath`.

``read_rows`` runs one chunk of a direct or staging read: the plan's rows become granule index
runs (NIXL merges runs contiguous on both sides into one descriptor), one READ per remote rank
(the last chunk's carries the request notification), polled to DONE before the deadline, then the
plan's staging moves. The caller (``fkv.connector._client.Client``) holds its lock throughout:
NIXL is called from one thread at a time.
"""

from __future__ import annotations

import math
import time
from typing import Any

import attrs
import numpy as np

from fkv.connector._common import kernels, on_device, spin_seconds
from fkv.connector._nixl import TransferFailed, Xfer, granule_table, row_indices
from fkv.connector.plan import TransferPlan
from fkv.connector.wire import Peer
from fkv.errors import FkvError

__all__ = ["Connection", "Tally", "split_chunks", "wait_reads"]


def split_chunks(local: np.ndarray, remote: np.ndarray, tokens: int, per: int, nl: int, nr: int
                 ) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """``(local ids, remote ids, tokens)`` pieces of at most ``per`` tokens (a multiple of both
    block sizes), each piece's ids exactly the blocks of its tokens."""
    if tokens <= per:
        return [(local, remote, tokens)]
    out = []
    for start in range(0, tokens, per):
        n = min(per, tokens - start)
        out.append((local[start // nl: -(-(start + n) // nl)],
                    remote[start // nr: -(-(start + n) // nr)], n))
    return out


@attrs.define
class Tally:
    """What one read did so far (for its :class:`~fkv.connector.ReadResult`)."""

    bytes: int = 0
    descriptors: int = 0
    transfer_seconds: float = 0.0
    pack_seconds: float = 0.0


def wait_reads(agent: Any, xfers: list[Xfer], ranks: list[int], engine_id: str,
               deadline: float, spin: float = 0.0) -> None:
    """Poll posted READs (``ranks[i]`` is ``xfers[i]``'s prefill rank) until DONE; raise
    TransferFailed naming the rank on ERR or at the deadline (busy-polls the first ``spin`` s)."""
    stuck = agent.wait(xfers, deadline, spin)
    if stuck is None:
        return
    who = f"prefill rank {ranks[xfers.index(stuck)]} of engine {engine_id!r} ({stuck.remote})"
    if stuck.state == "ERR":
        raise TransferFailed(f"READ from {who} failed (NIXL state ERR): the prefill process may "
                             f"have died: reconnect once it is back (client.reconnect())")
    raise TransferFailed(f"READ from {who} did not finish before the read's timeout: the "
                         f"prefill process is hung, dead or unreachable")


class Connection:
    """A client's state for one prefill engine: plan, peers, NIXL names, descriptor lists, the
    staging buffer and the packed path."""

    def __init__(self, client: Any, plan: TransferPlan, peers: list[Peer], entries: list[Any]
                 ) -> None:
        from fkv.connector._unpack import PackedPath

        self.client, self.plan, self.peers = client, plan, tuple(peers)
        self.entries = entries
        self.mem_types = [e.mem_type for e in entries]
        self.engine_id = peers[0].engine.engine_id
        self.remote_spec = peers[0].spec
        self.names: dict[int, str] = {}
        self.remote_dlists: dict[int, Any] = {}
        self.local_dlist: Any = None
        self.staging: Any = None
        self._staging_reg: Any = None
        self.staging_blocks = 0   # remote blocks one staging-path chunk holds
        self.staging_path_bytes = 0
        self.packed: PackedPath | None = None
        self.packed_reason = ""   # why packed reads are off (empty when on)
        self.spin = spin_seconds()  # busy-poll READ states this long before sleeping
        agent = client._agent
        ls, rs = client.spec, self.remote_spec
        step = math.lcm(ls.block_size, rs.block_size)
        try:
            for rank in (*plan.remote_ranks, *plan.notify_only_ranks):
                self.names[rank] = agent.add_remote(peers[rank].agent_metadata)
            if plan.strategy == "staging":
                per_block = plan.staging_bytes(1)
                blocks = max(client._staging_bytes_max // per_block, step // rs.block_size)
                self.staging_blocks = min(blocks, max(rs.num_blocks, step // rs.block_size))
                self.staging_path_bytes = plan.staging_bytes(self.staging_blocks)
            cuda = client._device.type == "cuda" and all(
                self.mem_types[r] == "VRAM" for r in plan.remote_ranks)
            if client._strategy == "packed" or (client._strategy == "auto" and cuda):
                self.packed, self.packed_reason = PackedPath.create(self)
                if client._strategy == "packed" and self.packed is None:
                    raise FkvError(f"strategy='packed' is not possible with prefill engine "
                                   f"{self.engine_id!r}: {self.packed_reason}")
            elif client._strategy == "auto":
                self.packed_reason = ("'auto' packs only when the caches of both sides are on "
                                      "CUDA (strategy='packed' forces packed reads)")
            else:
                self.packed_reason = f"strategy {client._strategy!r} forced"
            size = max(self.staging_path_bytes, self.packed.buffer_bytes if self.packed else 0)
            if size:
                import torch

                self.staging = torch.empty(size, dtype=torch.uint8, device=client._device)
                self._staging_reg = agent.register([(self.staging.data_ptr(), size)],
                                                   client._mem_type, client._device_id)
            self.granule = 0
            self._prep(self._probe_granule())
        except BaseException:
            self.close()
            raise

    # -- descriptors -------------------------------------------------------------------------------
    def _probe_granule(self) -> int:
        ls, rs = self.client.spec, self.remote_spec
        values = [ls.region_bytes, rs.region_bytes, ls.axis_strides["B"] * ls.itemsize,
                  rs.axis_strides["B"] * rs.itemsize]
        if self.staging_path_bytes:
            values += [self.plan.staging_bytes(1), self.staging_path_bytes]
        tokens = math.lcm(ls.block_size, rs.block_size)
        nl, nr = tokens // ls.block_size, tokens // rs.block_size
        if nl <= ls.num_blocks and nr <= rs.num_blocks:
            lo = np.arange(nl) + (1 if nl < ls.num_blocks else 0)
            ro = np.arange(nr, 0, -1) - (0 if nr < rs.num_blocks else 1)
            rows = self.plan.segments(lo, ro)
            values += rows[:, 2:6:2].ravel().tolist() + rows[:, 5].tolist()
        return math.gcd(*values)

    def _prep(self, granule: int) -> None:
        agent = self.client._agent
        for handle in [self.local_dlist, *self.remote_dlists.values()]:
            if handle is not None:
                agent.release_dlist(handle)
        self.remote_dlists.clear()
        self.local_dlist = None
        self.granule = granule
        ls, rs = self.client.spec, self.remote_spec
        local = list(self.client._regions)
        if self.staging_path_bytes:
            local.append((self.staging.data_ptr(), self.staging_path_bytes))
        self.local_per_region = ls.region_bytes // granule
        self.staging_base = ls.num_regions * self.local_per_region
        self.remote_per_region = rs.region_bytes // granule
        self.local_dlist = agent.prep(None, granule_table(local, granule,
                                                          device_id=self.client._device_id),
                                      self.client._mem_type)
        for rank in self.plan.remote_ranks:
            peer = self.peers[rank]
            table = granule_table(peer.regions, granule, device_id=peer.device_id)
            self.remote_dlists[rank] = agent.prep(self.names[rank], table, self.mem_types[rank])

    def ensure_granule(self, rows: np.ndarray) -> None:
        """Re-prepare with a finer granule if a row does not sit on the current one (rare)."""
        if rows.size and (np.any(rows[:, 2:6:2] % self.granule) or np.any(rows[:, 5] % self.granule)):
            self._prep(math.gcd(self.granule, *rows[:, 2:6:2].ravel().tolist(),
                                *rows[:, 5].tolist()))

    def indices(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Local and remote descriptor indices of plan rows (one remote rank's)."""
        g = self.granule
        count = rows[:, 5] // g
        local_base = np.where(rows[:, 3] < 0, self.staging_base, rows[:, 3] * self.local_per_region)
        local = row_indices(local_base + rows[:, 4] // g, count)
        remote = row_indices(rows[:, 1] * self.remote_per_region + rows[:, 2] // g, count)
        return local, remote

    def notif(self, request_id: str) -> bytes:
        return f"{request_id}:{self.client.engine.tp_size}".encode()

    # -- which path --------------------------------------------------------------------------------
    def choose(self, local: np.ndarray, remote: np.ndarray, tokens: int
               ) -> tuple[str, np.ndarray | None]:
        """The path for one request, and the plan rows when they were computed to decide:
        ``"packed"`` when forced, or (auto) when packed reads are on and the plan needs more
        than the client's ``pack_threshold`` descriptors for it; else the plan's strategy."""
        strategy = self.client._strategy
        if strategy == "packed":
            return "packed", None
        if strategy != "auto" or self.packed is None:
            return self.plan.strategy, None
        threshold = self.client._pack_threshold
        if self.plan.cost.descriptors * remote.size <= threshold:
            return self.plan.strategy, None
        rows = self.plan.segments(local, remote, num_tokens=tokens)
        if rows.shape[0] > threshold:
            return "packed", None
        return self.plan.strategy, rows

    # -- the plan's paths: direct and staging ------------------------------------------------------
    def chunks(self, local: np.ndarray, remote: np.ndarray, tokens: int
               ) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Split a staging read so each piece's staging mini-caches fit the staging buffer."""
        if self.plan.strategy != "staging" or remote.size <= self.staging_blocks:
            return [(local, remote, tokens)]
        nl, nr = self.client.spec.block_size, self.remote_spec.block_size
        step = math.lcm(nl, nr)
        per = (self.staging_blocks * nr) // step * step  # tokens per chunk
        return split_chunks(local, remote, tokens, per, nl, nr)

    def read_rows(self, request_id: str, local: np.ndarray, remote: np.ndarray, tokens: int,
                  last: bool, deadline: float, tally: Tally, rows: np.ndarray | None = None
                  ) -> None:
        """One chunk of a direct or staging read (``rows``: the plan's rows when known)."""
        agent, plan = self.client._agent, self.plan
        if rows is None:
            rows = plan.segments(local, remote, num_tokens=tokens)
        self.ensure_granule(rows)
        tally.descriptors += int(rows.shape[0])
        xfers: list[Xfer] = []
        ranks: list[int] = []
        t0 = time.perf_counter()
        try:
            for rank in plan.remote_ranks:
                mine = rows[rows[:, 0] == rank]
                local_idx, remote_idx = self.indices(mine)
                notif = self.notif(request_id) if last else b""
                try:
                    xfers.append(agent.read(self.local_dlist, local_idx, self.remote_dlists[rank],
                                            remote_idx, self.names[rank], int(mine[:, 5].sum()),
                                            notif))
                except TransferFailed as e:
                    raise TransferFailed(f"prefill rank {rank} of engine {self.engine_id!r}: {e}; "
                                         f"the prefill process may have died: reconnect once it "
                                         f"is back (client.reconnect())") from e
                ranks.append(rank)
            wait_reads(agent, xfers, ranks, self.engine_id, deadline, self.spin)
        finally:
            tally.bytes += sum(x.nbytes for x in xfers if x.state == "DONE")
            tally.transfer_seconds += time.perf_counter() - t0
            for x in xfers:
                agent.release(x)
        if plan.strategy == "staging":
            self.run_staging(local, remote, tokens)

    def run_staging(self, local: np.ndarray, remote: np.ndarray, tokens: int) -> None:
        import torch

        from fkv.tensors import wrap

        client = self.client
        move = kernels(client._device).move
        views, ls = client._views, client.spec
        with on_device(client._device):
            src_ids = torch.arange(remote.size, device=client._device)
            dst_ids = torch.as_tensor(local, device=client._device)
            for step in self.plan.staging_steps(local, remote, num_tokens=tokens):
                src = wrap(self.staging, step.stage_spec, step.stage_offset)[step.layer]
                move(src, step.stage_spec, src_ids, views[step.layer], ls, dst_ids,
                     src_heads=step.src_heads, dst_heads=step.dst_heads,
                     num_tokens=step.num_tokens)

    def close(self) -> None:
        if self.packed is not None:
            self.packed.close()
            self.packed = None
        agent = self.client._agent
        if agent is None:
            return
        for handle in [self.local_dlist, *self.remote_dlists.values()]:
            if handle is not None:
                agent.release_dlist(handle)
        self.remote_dlists.clear()
        self.local_dlist = None
        for name in self.names.values():
            agent.remove_remote(name)
        self.names.clear()
        agent.deregister(self._staging_reg, keep=self.staging)
        self._staging_reg = self.staging = None
