"""A decode rank's NIXL state for one prefill engine: remote agents, descriptor lists, staging.

:class:`Link` holds what every NIXL path of a connection shares: the NIXL names of the prefill
ranks it reads or notifies, the descriptor lists prepared once (the local caches and the staging
buffer, each remote rank's caches, cut into equal *granules*: see ``_agent``), and the registered
staging buffer (shared by the staging path and packed reads). It knows nothing about which path
a request takes (``_connection`` decides that) and imports no path.

``wait_reads`` polls posted READs to DONE before a deadline and names the prefill rank that
failed. Callers hold the client's lock: NIXL is called from one thread at a time.
"""

from __future__ import annotations

import math
import time
from typing import Any

import attrs
import numpy as np

from fkv.connector.plan import TransferPlan
from fkv.connector.transport._agent import Agent, Xfer, granule_table, run_indices
from fkv.connector.transport._base import TransferFailed, spin_seconds
from fkv.connector.wire import Peer
from fkv.errors import FkvError
from fkv.layout import KVCacheSpec

__all__ = ["Link", "Local", "MAX_PREPARED_DESCRIPTORS", "wait_reads"]

#: Rows of a peer's descriptor table the metadata probe prepares first.
_PROBE_ROWS = 4096
#: Most remote descriptors (granules) a decode rank prepares for one prefill rank: about 96 MiB
#: of descriptor tables. A 32-layer cache of 16384 blocks cut in head halves needs 2**21.
MAX_PREPARED_DESCRIPTORS = 1 << 22


@attrs.define
class Local:
    """The decode rank's side of a connection: its engine, spec, cache views and registration,
    its NIXL agent and ZMQ context, and the client's settings."""

    engine: Any
    spec: KVCacheSpec
    views: list[Any]
    regions: list[tuple[int, int]]
    mem_type: str
    device_id: int
    device: Any
    agent: Agent
    zctx: Any
    strategy: str
    staging_bytes_max: int
    pack_threshold: int
    curve: Any = None  # CurveKeys for the side channel (None: plain-TCP frames)
    tainted: bool = False  # a peer's metadata was loaded into the agent for this connection
    secret: bytes = b""  # the client's own random bytes, sent in every Hello (rebinding proof)


#: Bytes of the READ that finishes connecting to a rank this decode rank only notifies.
_WIRE_UP_BYTES = 64


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


class Link:
    """NIXL names, descriptor lists and the registered staging buffer of one connection.

    ``staging_path_bytes``: the part of the staging buffer the plan's staging path uses (it is in
    the local descriptor list); ``staging_bytes``: the whole buffer (packed reads use it too).
    """

    def __init__(self, local: Local, plan: TransferPlan, peers: list[Peer], entries: list[Any],
                 *, staging_path_bytes: int, staging_bytes: int, deadline: float) -> None:
        self.local, self.plan, self.peers = local, plan, tuple(peers)
        self.entries = entries
        self.mem_types = [e.mem_type for e in entries]
        self.engine_id = peers[0].engine.engine_id
        self.remote_spec = peers[0].spec
        self.names: dict[int, str] = {}
        #: rank -> the outbox (``_outbox``) a same-host prefill rank accepted for notifications
        self.outboxes: dict[int, Any] = {}
        self.remote_dlists: dict[int, Any] = {}
        self.local_dlist: Any = None
        self.staging: Any = None
        self._staging_reg: Any = None
        self.staging_path_bytes = staging_path_bytes
        self.spin = spin_seconds()  # busy-poll READ states this long before sleeping
        agent = local.agent
        try:
            self.granule = self._probe_granule()
            preps = self._check_peers(deadline)
            for rank in (*plan.remote_ranks, *plan.notify_only_ranks):
                local.tainted = True
                self.names[rank] = agent.add_remote(peers[rank].agent_metadata,
                                                    timeout=max(0.5, deadline - time.monotonic()),
                                                    prep=preps[rank])
            if staging_bytes:
                import torch

                self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=local.device)
                self._staging_reg = agent.register([(self.staging.data_ptr(), staging_bytes)],
                                                   local.mem_type, local.device_id)
            self._prep(self.granule)
            if agent.progress == "off" and plan.notify_only_ranks:
                self.wire_up(plan.notify_only_ranks, deadline)
        except BaseException:
            self.close()
            raise

    def wire_up(self, ranks: Any, deadline: float) -> None:
        """Finish connecting to ranks this decode rank only notifies (or never READs from). An agent with no progress
        thread moves UCX only while it polls its own READs, and a notification to a peer it never
        read from waits in UCX for a connection that never completes; one small READ from each
        such rank (into a private buffer) completes it now, or fails the connect naming it."""
        import torch

        agent, local = self.local.agent, self.local
        scratch = torch.empty(_WIRE_UP_BYTES, dtype=torch.uint8, device=local.device)
        reg = agent.register([(scratch.data_ptr(), _WIRE_UP_BYTES)], local.mem_type,
                             local.device_id)
        try:
            for rank in ranks:
                peer = self.peers[rank]
                base, nbytes = peer.regions[0]
                size = min(_WIRE_UP_BYTES, nbytes)
                mine = np.array([[scratch.data_ptr(), size, local.device_id]], dtype=np.uint64)
                theirs = np.array([[base, size, peer.device_id]], dtype=np.uint64)
                xfer = agent.read_descs(mine, local.mem_type, theirs, self.mem_types[rank],
                                        self.names[rank], size)
                try:
                    wait_reads(agent, [xfer], [rank], self.engine_id, deadline)
                finally:
                    agent.release(xfer)
        finally:
            agent.deregister(reg, keep=scratch)

    def _check_peers(self, deadline: float) -> dict[int, Any]:
        """Every peer's NIXL metadata passes the structural check and the probe (one child
        process for all), and registers every region the peer's wire message announced; returns
        what the probe prepared per rank (``add_remote`` finds the same verdict by it)."""
        from fkv.connector.transport._metadata import check_each

        ranks = (*self.plan.remote_ranks, *self.plan.notify_only_ranks)
        # the probe prepares the very descriptors this rank will prepare on each peer
        preps = [(self.mem_types[r], granule_table(self.peers[r].regions, self.granule,
                                                   device_id=self.peers[r].device_id,
                                                   limit=_PROBE_ROWS))
                 if r in self.plan.remote_ranks else None for r in ranks]
        verdicts = check_each([self.peers[r].agent_metadata for r in ranks],
                              timeout=max(0.5, deadline - time.monotonic()), preps=preps)
        for rank, meta in zip(ranks, verdicts, strict=True):
            if isinstance(meta, Exception):
                raise FkvError(f"prefill rank {rank} of engine {self.engine_id!r}: {meta}")
            if rank not in self.plan.remote_ranks:
                continue
            for i, (base, nbytes) in enumerate(self.peers[rank].regions):
                if not meta.covers(base, nbytes, self.mem_types[rank]):
                    raise FkvError(f"prefill rank {rank} of engine {self.engine_id!r} announced "
                                   f"region {i} at 0x{base:x} (+{nbytes} B, "
                                   f"{self.mem_types[rank]}) that its NIXL metadata does not "
                                   f"register; refusing to read from it")
        return dict(zip(ranks, preps, strict=True))

    # -- descriptors -------------------------------------------------------------------------------
    def _probe_granule(self) -> int:
        ls, rs = self.local.spec, self.remote_spec
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

    def _release_dlists(self) -> None:
        agent = self.local.agent
        for handle in [self.local_dlist, *self.remote_dlists.values()]:
            if handle is not None:
                agent.release_dlist(handle)
        self.remote_dlists.clear()
        self.local_dlist = None

    def _prep(self, granule: int) -> None:
        """Prepare the local and remote descriptor lists at ``granule``, then release the old
        ones. On any failure nothing changes: the lists prepared so far are released and the
        link keeps its granule and lists (a later read must not find them half replaced)."""
        agent = self.local.agent
        ls, rs = self.local.spec, self.remote_spec
        local = list(self.local.regions)
        if self.staging_path_bytes:
            local.append((self.staging.data_ptr(), self.staging_path_bytes))
        remote_per_region = rs.region_bytes // granule
        count = remote_per_region * rs.num_regions
        if count > MAX_PREPARED_DESCRIPTORS:
            raise FkvError(f"prefill engine {self.engine_id!r} announced a cache of "
                           f"{rs.num_blocks} blocks x {rs.num_regions} region(s) "
                           f"({rs.region_bytes} B each): {count} descriptors of {granule} B to "
                           f"prepare, over this decode rank's limit of "
                           f"{MAX_PREPARED_DESCRIPTORS} (MAX_PREPARED_DESCRIPTORS); nothing was "
                           f"allocated")
        made: list[Any] = []
        try:
            made.append(agent.prep(None, granule_table(local, granule,
                                                       device_id=self.local.device_id),
                                   self.local.mem_type))
            for rank in self.plan.remote_ranks:
                peer = self.peers[rank]
                table = granule_table(peer.regions, granule, device_id=peer.device_id)
                made.append(agent.prep(self.names[rank], table, self.mem_types[rank]))
        except BaseException:
            for handle in made:
                agent.release_dlist(handle)
            raise
        self._release_dlists()
        self.granule = granule
        self.local_dlist = made[0]
        self.remote_dlists = dict(zip(self.plan.remote_ranks, made[1:], strict=True))
        self.local_per_region = ls.region_bytes // granule
        self.staging_base = ls.num_regions * self.local_per_region
        self.remote_per_region = remote_per_region

    def fits_granule(self, rows: np.ndarray) -> bool:
        """Whether every row sits on the current granule (offsets and sizes multiples of it)."""
        g = self.granule
        if not rows.size:
            return True
        if g & (g - 1) == 0:  # a power of two: one mask of the offsets' and sizes' low bits
            if not ((rows[:, 2] | rows[:, 4] | rows[:, 5]) & (g - 1)).any():
                return True
        return not (np.any(rows[:, 2:6:2] % g) or np.any(rows[:, 5] % g))

    def ensure_granule(self, rows: np.ndarray) -> None:
        """Re-prepare with a finer granule if a row does not sit on the current one (rare)."""
        if not self.fits_granule(rows):
            self._prep(math.gcd(self.granule, *rows[:, 2:6:2].ravel().tolist(),
                                *rows[:, 5].tolist()))

    def indices(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Local and remote descriptor indices of plan rows (one remote rank's)."""
        g = self.granule
        count = rows[:, 5] // g
        local_base = np.where(rows[:, 3] < 0, self.staging_base, rows[:, 3] * self.local_per_region)
        local, remote = run_indices((local_base + rows[:, 4] // g,
                                     rows[:, 1] * self.remote_per_region + rows[:, 2] // g), count)
        return local, remote

    # -- notifications -----------------------------------------------------------------------------
    def notif(self, request_id: str) -> bytes:
        """The request notification every reader sends each prefill rank it read or notifies
        (``fkv1|<request id>|<decode engine id>|<decode rank>|done``), once every READ of the
        request landed: a failed read notifies nobody, so its retry is safe."""
        from fkv.connector.transport._lifecycle import notification

        engine = self.local.engine
        return notification(request_id, engine.engine_id, engine.tp_rank)

    def notify(self, ranks: Any, message: bytes) -> None:
        """Send ``message`` (:meth:`notif`) to each of ``ranks``: into the rank's outbox when it
        accepted one and the outbox takes it, else through NIXL."""
        outboxes = self.outboxes
        for rank in ranks:
            box = outboxes.get(rank)
            if box is None or not box.put(message):
                self.local.agent.notify(self.names[rank], message)

    def close(self) -> None:
        for box in self.outboxes.values():
            box.close()
        self.outboxes.clear()
        agent = self.local.agent
        if agent is None:
            return
        self._release_dlists()
        for name in self.names.values():
            agent.remove_remote(name)
        self.names.clear()
        agent.deregister(self._staging_reg, keep=self.staging)
        self._staging_reg = self.staging = None
