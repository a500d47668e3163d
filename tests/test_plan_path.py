"""The plan's own paths (``_plan_path``) in one process, with no NIXL: a real plan and a real
:class:`Link`'s descriptor arithmetic over a fake agent that lands a READ's bytes (granule by
granule, from the prefill rank's caches to the decode's) when it is waited for, or fails it as a
test says; the same-host branch with a real ``SameHostCopy`` reading this very process. The
tests check the decode caches byte for byte against the prefill caches (and what a read must
not touch against what it held), the READs created, posted and released, the exact errors."""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import fkv
from fkv.connector import EngineDesc
from fkv.connector.handshake import handshake
from fkv.connector.transport import _plan_path
from fkv.connector.transport._agent import Xfer
from fkv.connector.transport._base import Tally, TransferFailed, cache_regions, layer_views
from fkv.connector.transport._link import Link, Local
from fkv.connector.transport._plan_path import PlanPath, staging_blocks
from fkv.errors import FkvError
from fkv.testing import assert_kv_equal

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=3)
#: the prefill side of a staging pair: blocks half as large (a block size mismatch)
HALF = SPEC.evolve(num_blocks=16, block_size=2)


class _Handle:
    """A READ the fake agent created: both descriptor lists and their indices."""

    def __init__(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any,
                 name: str) -> None:
        self.local, self.remote, self.name = local, remote, name
        self.local_idx, self.remote_idx = np.asarray(local_idx), np.asarray(remote_idx)


class _Agent:
    """NIXL as the plan's path uses it. ``outcome``: remote name -> the state its READs end in
    when waited for (default DONE: the bytes land then); ``refuse_post`` / ``refuse_create``:
    names whose posts / creates fail (TransferFailed, as ``Agent`` raises)."""

    def __init__(self) -> None:
        self.outcome: dict[str, str] = {}
        self.refuse_post: set[str] = set()
        self.refuse_create: set[str] = set()
        self.created: list[_Handle] = []
        self.posted: list[_Handle] = []
        self.released: list[Any] = []  # handles of released READs
        self.discarded: list[_Handle] = []
        self.waits: list[float] = []  # the deadline of every wait
        self.spins: list[float] = []  # and how long it busy-polls
        self.landed: list[tuple[str, int]] = []  # (remote, bytes) of every READ that landed
        self.released_dlists: list[np.ndarray] = []

    # descriptor lists: a prepared list is its granule table
    def prep(self, name: Any, table: np.ndarray, mem_type: str) -> np.ndarray:
        return table

    def release_dlist(self, handle: Any) -> None:
        self.released_dlists.append(handle)

    def create_read(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any,
                    remote_name: str, notif: bytes = b"") -> _Handle:
        assert notif == b"", "the plan's READs carry no notification"
        if remote_name in self.refuse_create:
            raise TransferFailed(f"could not create a READ from {remote_name!r}: RuntimeError: no")
        handle = _Handle(local, local_idx, remote, remote_idx, remote_name)
        self.created.append(handle)
        return handle

    def post(self, handle: _Handle, remote_name: str, nbytes: int) -> Xfer:
        if remote_name in self.refuse_post:
            self.released.append(handle)  # Agent.post releases what it could not post
            raise TransferFailed(f"could not post a READ from {remote_name!r}: RuntimeError: no")
        self.posted.append(handle)
        return Xfer(handle, remote_name, nbytes)

    def read(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, remote_name: str,
             nbytes: int, notif: bytes = b"") -> Xfer:
        return self.post(self.create_read(local, local_idx, remote, remote_idx, remote_name,
                                          notif), remote_name, nbytes)

    def discard(self, handle: _Handle) -> None:
        self.discarded.append(handle)
        self.released.append(handle)

    def wait(self, xfers: list[Xfer], deadline: float, spin: float = 0.0) -> Xfer | None:
        self.waits.append(deadline)
        self.spins.append(spin)
        for x in xfers:
            if x.state == "PROC":
                x.state = self.outcome.get(x.remote, "DONE")
                if x.state == "DONE":
                    self._land(x)
        failed = [x for x in xfers if x.state == "ERR"]
        stuck = [x for x in xfers if x.state == "PROC"]
        return (failed or stuck or [None])[0]

    def _land(self, x: Xfer) -> None:
        h = x.handle
        assert h.local_idx.shape == h.remote_idx.shape
        total = 0
        for li, ri in zip(h.local_idx.tolist(), h.remote_idx.tolist(), strict=True):
            (dst, n, _), (src, m, _) = h.local[li].tolist(), h.remote[ri].tolist()
            assert n == m
            ctypes.memmove(dst, src, n)
            total += n
        assert total == x.nbytes, (total, x.nbytes)
        self.landed.append((x.remote, total))

    def poll(self, x: Xfer) -> str:
        return x.state

    def release(self, x: Xfer) -> None:
        self.released.append(x.handle)

    def unreleased(self) -> list[_Handle]:
        return [h for h in self.created if not any(h is r for r in self.released)]


def _engine(name: str, tp: int = 1, rank: int = 0, heads: int = 2) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=tp, tp_rank=rank, total_num_kv_heads=heads)


def _caches(spec: fkv.KVCacheSpec, seed: int) -> list[torch.Tensor]:
    """Caches of distinct finite values (bitwise comparable through every copy and move)."""
    gen = torch.Generator().manual_seed(seed)
    caches = fkv.allocate(spec)
    for layer in caches:
        layer.view(torch.int16).copy_(torch.randint(0, 0x3F00, layer.shape, generator=gen,
                                                    dtype=torch.int16))
    return caches


def _path(remote: fkv.KVCacheSpec = SPEC, *, local: fkv.KVCacheSpec = SPEC,
          strategy: str = "direct", ranks: int = 1, staging_bytes: int = 1 << 20,
          copies: bool = False) -> SimpleNamespace:
    """A PlanPath of a real plan (decode ``local``, TP 1, against ``ranks`` prefill ranks of
    ``remote``'s heads each) over a Link whose agent is :class:`_Agent`; the prefill ranks'
    caches are filled, the decode's too (with other values). ``copies``: same-host copies (a
    real SameHostCopy reading this process) instead of READs."""
    from fkv.connector.transport import _cma

    heads = remote.num_kv_heads * ranks
    plan = handshake((_engine("d", heads=heads), local),
                     (_engine("p", ranks, 0, heads), remote), strategy=strategy).plan
    assert plan.strategy == strategy and plan.remote_ranks == tuple(range(ranks))
    agent = _Agent()
    mine = _caches(local, 1)
    theirs = [_caches(remote, 100 + r) for r in range(ranks)]
    regions, mem_type, device_id, device = cache_regions(local, mine)
    blocks = staging_blocks(plan, local, remote, staging_bytes)
    link = object.__new__(Link)
    link.local = Local(engine=_engine("d", heads=heads), spec=local,
                       views=layer_views(local, mine), regions=regions, mem_type=mem_type,
                       device_id=device_id, device=device, agent=agent, zctx=None,
                       strategy=strategy, staging_bytes_max=staging_bytes, pack_threshold=0)
    link.plan, link.remote_spec, link.engine_id, link.spin = plan, remote, "p", 0.0
    link.peers = tuple(SimpleNamespace(regions=cache_regions(remote, t)[0], device_id=0)
                       for t in theirs)
    link.names = {r: f"p{r}" for r in range(ranks)}
    link.mem_types = ["DRAM"] * ranks
    link.remote_dlists, link.local_dlist, link.outboxes = {}, None, {}
    link.staging_path_bytes = plan.staging_bytes(blocks) if blocks else 0
    link.staging = torch.zeros(max(link.staging_path_bytes, 1), dtype=torch.uint8)
    link.granule = link._probe_granule()
    link._prep(link.granule)
    copier = None
    if copies:
        copier = _cma.SameHostCopy(regions, (link.staging.data_ptr(), link.staging_path_bytes),
                                   {}, "p")
        for r, peer in enumerate(link.peers):
            src = object.__new__(_cma._Source)
            src.rank, src.pid, src.pidfd, src._poll = r, os.getpid(), -1, None
            src.bases = np.array([b for b, _ in peer.regions], dtype=np.uint64)
            src.sizes = np.array([n for _, n in peer.regions], dtype=np.int64)
            src.board = SimpleNamespace(stopped=lambda: False, close=lambda: None)
            src.exited = lambda: False
            copier.sources[r] = src
    path = PlanPath(link, blocks, copier)
    return SimpleNamespace(path=path, agent=agent, link=link, plan=plan, local=local,
                           remote=remote, mine=mine, theirs=theirs,
                           before=[t.clone() for t in mine])


def _two(**kw: Any) -> SimpleNamespace:
    """A direct path reading two prefill ranks, one head each."""
    return _path(SPEC.evolve(num_kv_heads=1), ranks=2, **kw)


def _read(s: SimpleNamespace, local_ids: list[int], remote_ids: list[int], tokens: int,
          timeout: float = 5.0, **kw: Any) -> Tally:
    tally = Tally()
    s.path.read("r1", np.array(local_ids, dtype=np.int64), np.array(remote_ids, dtype=np.int64),
                tokens, _plan_path.time.monotonic() + timeout, tally, **kw)
    return tally


def _landed(s: SimpleNamespace, local_ids: list[int], remote_ids: list[int], tokens: int,
            layers: tuple[int, int] | None = None) -> None:
    """The request's tokens of ``layers`` (default all) hold the prefill ranks' values, each
    rank's in its heads; every other layer, and every block outside ``local_ids``, holds what
    it held before (at the last check); the caches as they are now are the next check's
    "before"."""
    first, end = layers or (0, s.local.num_layers)
    per = s.remote.num_kv_heads
    for layer in range(s.local.num_layers):
        if first <= layer < end:
            for r, theirs in enumerate(s.theirs):
                assert_kv_equal([s.mine[layer]], s.local.evolve(num_layers=1),
                                [theirs[layer]], s.remote.evolve(num_layers=1),
                                block_ids_a=local_ids, block_ids_b=remote_ids, num_tokens=tokens,
                                heads_a=(r * per, r * per + per))
        else:
            assert torch.equal(s.mine[layer], s.before[layer]), f"layer {layer} was written"
        others = [b for b in range(s.local.num_blocks) if b not in local_ids]
        assert torch.equal(s.mine[layer][others], s.before[layer][others]), \
            f"layer {layer}: a block outside the request was written"
    s.before = [t.clone() for t in s.mine]


def _untouched(s: SimpleNamespace) -> None:
    for layer, (now, was) in enumerate(zip(s.mine, s.before, strict=True)):
        assert torch.equal(now, was), f"layer {layer} was written"


# -- direct ---------------------------------------------------------------------------------------

def test_a_direct_read_lands_the_request_in_one_read_per_rank_and_releases_it() -> None:
    s = _two()
    tally = _read(s, [5, 1, 2], [0, 7, 3], 10)
    _landed(s, [5, 1, 2], [0, 7, 3], 10)
    rows = s.plan.rows(np.array([5, 1, 2]), np.array([0, 7, 3]), 10)
    assert [name for name, _ in s.agent.landed] == ["p0", "p1"]
    assert tally.bytes == sum(n for _, n in s.agent.landed) == int(rows[:, 5].sum())
    assert tally.descriptors == rows.shape[0]
    # the ended READs are released when the next read starts (or at close), not before
    assert [x.state for x in s.path.ended] == ["DONE", "DONE"] and s.agent.released == []
    _read(s, [4], [6], 4)
    assert s.agent.released == s.agent.created[:2] and len(s.path.ended) == 2
    s.path.close()
    assert s.agent.unreleased() == [] and s.path.ended == [] and s.path.quarantine == []


def test_a_layer_range_reads_only_those_layers() -> None:
    s = _path()
    rows = s.plan.rows(np.array([3, 6]), np.array([2, 5]), 7)
    layer1 = rows[rows[:, 1] == 1]
    tally = _read(s, [3, 6], [2, 5], 7, layers=(1, 2))
    _landed(s, [3, 6], [2, 5], 7, layers=(1, 2))
    assert (tally.bytes, tally.descriptors) == (int(layer1[:, 5].sum()), layer1.shape[0])
    _read(s, [3, 6], [2, 5], 7, layers=(2, 3))
    _landed(s, [3, 6], [2, 5], 7, layers=(2, 3))
    _read(s, [3, 6], [2, 5], 7, layers=(0, 1))
    _landed(s, [3, 6], [2, 5], 7, layers=(0, 1))


def test_a_layer_range_needs_per_layer_prefill_caches() -> None:
    s = _path()
    s.link.remote_spec = s.remote.evolve(cross_layer=True)
    with pytest.raises(FkvError, match=r"^PlanPath.read: a layer range needs per-layer prefill "
                                       r"caches$"):
        _read(s, [3], [2], 4, layers=(0, 1))
    assert s.agent.created == []
    _untouched(s)


def test_a_read_made_ahead_is_posted_as_created() -> None:
    """layer_reads creates the layer's READs (one per rank), posts nothing; the read of that
    layer posts exactly those handles and creates none; nothing is left to discard."""
    s = _two()
    local, remote = np.array([1, 2]), np.array([3, 5])
    rows = s.path.stream_rows(local, remote, 8)
    ahead = s.path.layer_reads(rows, 1)
    assert (ahead.layers, ahead.granule, ahead.rows) == ((1, 2), s.link.granule,
                                                         int((rows[:, 1] == 1).sum()))
    assert [r[0] for r in ahead.reads] == [0, 1] and len(ahead.created) == 2
    assert s.agent.created == ahead.created and s.agent.posted == []
    made = list(ahead.created)
    _read(s, [1, 2], [3, 5], 8, rows=rows, layers=(1, 2), prepared=ahead)
    _landed(s, [1, 2], [3, 5], 8, layers=(1, 2))
    assert s.agent.created == made and s.agent.posted == made
    assert (s.path.prepared_reads, ahead.created) == (1, None)
    s.path.discard_unposted()
    assert s.path.discarded_reads == 0 and s.agent.discarded == [] and s.path._ahead == []


def test_a_read_made_ahead_for_another_range_is_discarded_unposted() -> None:
    s = _two()
    local, remote = np.array([1, 2]), np.array([3, 5])
    rows = s.path.stream_rows(local, remote, 8)
    ahead = s.path.layer_reads(rows, 1)
    made = list(ahead.created)
    _read(s, [1, 2], [3, 5], 8, rows=rows, layers=(1, 3), prepared=ahead)
    _landed(s, [1, 2], [3, 5], 8, layers=(1, 3))
    assert s.agent.posted == s.agent.created[2:] and len(s.agent.posted) == 2
    assert s.path.prepared_reads == 0 and ahead.created == made
    s.path.discard_unposted()
    assert s.agent.discarded == made and s.path.discarded_reads == 2
    assert ahead.created is None and s.path._ahead == []
    s.path.discard_unposted()  # once only
    assert s.agent.discarded == made and s.path.discarded_reads == 2
    s.path.close()
    assert s.agent.unreleased() == []


def test_a_read_made_ahead_on_another_granule_is_not_posted() -> None:
    s = _path()
    rows = s.path.stream_rows(np.array([1, 2]), np.array([3, 5]), 8)
    ahead = s.path.layer_reads(rows, 0)
    s.link.granule //= 2  # the descriptors were prepared again since
    s.link._prep(s.link.granule)
    _read(s, [1, 2], [3, 5], 8, rows=rows, layers=(0, 1), prepared=ahead)
    _landed(s, [1, 2], [3, 5], 8, layers=(0, 1))
    assert s.agent.posted == s.agent.created[1:] and s.path.prepared_reads == 0
    s.path.close()
    assert s.agent.discarded == s.agent.created[:1]
    assert s.agent.unreleased() == []


def test_a_read_whose_create_fails_ahead_is_left_to_the_post() -> None:
    """Rank 1 refuses the create: rank 0's handle is discarded at once, nothing is kept ahead,
    and the read of the layer creates (and posts) both READs itself."""
    s = _two()
    rows = s.path.stream_rows(np.array([1, 2]), np.array([3, 5]), 8)
    s.agent.refuse_create = {"p1"}
    ahead = s.path.layer_reads(rows, 0)
    assert ahead.created is None and s.path._ahead == []
    assert s.agent.discarded == s.agent.created and len(s.agent.created) == 1
    s.agent.refuse_create = set()
    _read(s, [1, 2], [3, 5], 8, rows=rows, layers=(0, 1), prepared=ahead)
    _landed(s, [1, 2], [3, 5], 8, layers=(0, 1))
    assert s.agent.posted == s.agent.created[1:] and len(s.agent.posted) == 2
    # the indices computed ahead were used (the READs made again from them)
    assert s.path.prepared_reads == 1 and s.path.discarded_reads == 0


@pytest.mark.parametrize("ahead", [False, True])
def test_a_refused_post_fails_the_read_naming_the_rank_and_leaks_no_handle(ahead: bool) -> None:
    """Rank 0 refuses the post: the read fails naming it, nothing moves, rank 1's READ (made
    ahead) is discarded, never posted; the next read works."""
    s = _two()
    rows = s.path.stream_rows(np.array([1, 2]), np.array([3, 5]), 8)
    prepared = s.path.layer_reads(rows, 0) if ahead else None
    s.agent.refuse_post = {"p0"}
    with pytest.raises(TransferFailed) as e:
        _read(s, [1, 2], [3, 5], 8, rows=rows, layers=(0, 1), prepared=prepared)
    assert str(e.value) == ("prefill rank 0 of engine 'p': could not post a READ from 'p0': "
                            "RuntimeError: no; the prefill process may have died: reconnect once "
                            "it is back (client.reconnect())")
    assert s.agent.posted == [] and s.agent.landed == [] and s.agent.waits == []
    assert s.agent.unreleased() == []
    assert len(s.agent.created) == 1 + ahead and s.agent.discarded == s.agent.created[1:]
    _untouched(s)
    s.agent.refuse_post = set()
    _read(s, [1, 2], [3, 5], 8)
    _landed(s, [1, 2], [3, 5], 8)
    s.path.close()
    assert s.agent.unreleased() == []


def test_a_failed_read_fails_the_request_and_counts_only_what_landed() -> None:
    """Rank 1's READ ends in ERR: TransferFailed naming it; only rank 0's bytes are counted;
    both READs are released."""
    s = _two()
    s.agent.outcome = {"p1": "ERR"}
    with pytest.raises(TransferFailed) as e:
        tally = Tally()
        s.path.read("r1", np.array([1, 2]), np.array([3, 5]), 8,
                    _plan_path.time.monotonic() + 5, tally)
    assert str(e.value) == ("READ from prefill rank 1 of engine 'p' (p1) failed (NIXL state "
                            "ERR): the prefill process may have died: reconnect once it is back "
                            "(client.reconnect())")
    assert tally.bytes == s.agent.landed[0][1] and [n for n, _ in s.agent.landed] == ["p0"]
    assert s.path.quarantine == [] and [x.state for x in s.path.ended] == ["DONE", "ERR"]
    s.path.close()
    assert s.agent.unreleased() == []


def test_a_staging_read_that_fails_moves_nothing_into_the_caches() -> None:
    s = _path(HALF.evolve(num_kv_heads=1), strategy="staging", ranks=2)
    s.agent.outcome = {"p1": "ERR"}
    with pytest.raises(TransferFailed, match=r"^READ from prefill rank 1 of engine 'p' \(p1\) "):
        _read(s, [1, 2], [3, 5, 6, 9], 8)
    assert [n for n, _ in s.agent.landed] == ["p0"]
    _untouched(s)
    s.agent.outcome = {}
    _read(s, [1, 2], [3, 5, 6, 9], 8)
    _landed(s, [1, 2], [3, 5, 6, 9], 8)


def test_a_timed_out_read_is_quarantined_and_blocks_the_next_until_nixl_ends_it() -> None:
    """Rank 0's READ is still in progress at the deadline: the read fails naming it and the
    READ is kept (not released); the next read waits for it until its own deadline and fails
    without posting; once NIXL ends it (DONE or ERR), it is released and reads go on."""
    s = _path(HALF, strategy="staging")
    s.agent.outcome = {"p0": "PROC"}
    deadline = _plan_path.time.monotonic() + 5
    with pytest.raises(TransferFailed) as e:
        s.path.read("r1", np.array([1, 2]), np.array([3, 5, 6, 9]), 8, deadline, Tally())
    assert str(e.value) == ("READ from prefill rank 0 of engine 'p' (p0) did not finish before "
                            "the read's timeout: the prefill process is hung, dead or unreachable")
    assert s.agent.waits == [deadline]
    stuck = s.path.quarantine
    assert [x.state for x in stuck] == ["PROC"] and s.path.ended == [] and s.agent.released == []
    _untouched(s)
    s.agent.outcome = {}
    with pytest.raises(TransferFailed) as e:
        _read(s, [1, 2], [3, 5, 6, 9], 8, timeout=0.01)
    assert str(e.value) == ("1 READ(s) of an earlier read that timed out (from ['p0']) have not "
                            "finished: their bytes could still land in the staging buffer, so "
                            "this read did not start; reconnect (client.reconnect()) if the "
                            "prefill rank is gone")
    assert len(s.agent.posted) == 1 and s.agent.released == []
    stuck[0].state = "ERR"  # NIXL ended it
    handle = stuck[0].handle
    _read(s, [1, 2], [3, 5, 6, 9], 8)
    _landed(s, [1, 2], [3, 5, 6, 9], 8)
    assert s.agent.released == [handle] and s.path.quarantine == []
    s.path.close()
    assert s.agent.unreleased() == []


def test_close_releases_every_handle_it_holds() -> None:
    s = _two()
    rows = s.path.stream_rows(np.array([1, 2]), np.array([3, 5]), 8)
    s.agent.outcome = {"p1": "PROC"}
    with pytest.raises(TransferFailed, match="did not finish"):
        _read(s, [1, 2], [3, 5], 8)
    assert len(s.path.ended) == 1 and len(s.path.quarantine) == 1
    ahead = s.path.layer_reads(rows, 2)  # (releases the ended READ: the lists may be prepared)
    made = list(ahead.created)
    assert s.agent.released == [s.agent.posted[0]] and len(made) == 2
    s.path.close()
    assert s.agent.unreleased() == [] and s.agent.discarded == made
    assert s.path.discarded_reads == 2 and s.path.quarantine == [] and s.path.ended == []


# -- staging: whole, in windows of layers, in chunks of blocks ------------------------------------

#: a staging buffer of 2 prefill blocks of every layer (768 B): ``staging_blocks`` 2
TWO_BLOCKS = 768


def _staging(staging_bytes: int = 1 << 20, ranks: int = 1, **kw: Any) -> SimpleNamespace:
    return _path(HALF.evolve(num_kv_heads=2 // ranks), strategy="staging", ranks=ranks,
                 staging_bytes=staging_bytes, **kw)


def test_staging_blocks_are_what_the_cap_holds_and_at_least_the_smallest_chunk() -> None:
    s = _staging()
    plan = s.plan
    assert plan.staging_bytes(1) == 384  # 3 layers x (K, V) x 2 heads x 2 tokens x 8 x 2 B
    assert [staging_blocks(plan, SPEC, HALF, n) for n in (768, 1151, 1152, 1 << 20)] == \
        [2, 2, 3, 16]
    direct = _path().plan
    assert staging_blocks(direct, SPEC, SPEC, 0) == 0
    with pytest.raises(FkvError) as e:
        staging_blocks(plan, SPEC, HALF, 767)
    assert str(e.value) == (
        "the smallest staging chunk of this pair is 4 tokens (the least common multiple of "
        "block sizes 4 and 2): 768 bytes, over the staging cap staging_bytes=767; nothing was "
        "allocated: raise connect(staging_bytes=) or use block sizes that divide each other")
    # a cache smaller than the smallest chunk still gets one chunk's blocks
    tiny = HALF.evolve(num_blocks=1)
    assert staging_blocks(_path(tiny, strategy="staging").plan, SPEC, tiny, 1 << 20) == 2


def test_a_staging_read_that_fits_is_one_read_then_the_moves() -> None:
    s = _staging(ranks=2)
    local, remote = [6, 0, 3], [9, 2, 15, 4, 11, 1]
    tally = _read(s, local, remote, 11)
    _landed(s, local, remote, 11)
    rows = s.plan.rows(np.array(local), np.array(remote), 11)
    assert len(s.agent.posted) == 2 and tally.descriptors == rows.shape[0]
    assert tally.bytes == int(rows[:, 5].sum()) and s.path.windowed_ranges == 0
    # the moves' steps are kept for the next request of the same sizes, made again otherwise
    memo = s.path._staging_memo
    _read(s, [5, 2, 7], [8, 3, 14, 0, 12, 10], 11)
    assert s.path._staging_memo is memo
    _landed(s, [5, 2, 7], [8, 3, 14, 0, 12, 10], 11)
    _read(s, [4, 1], [13, 5, 6], 5)
    assert s.path._staging_memo is not memo and s.path._staging_memo.sizes == (2, 3, 5, 0)
    _landed(s, [4, 1], [13, 5, 6], 5)


def test_chunks_of_blocks_split_at_the_staging_blocks() -> None:
    s = _staging(TWO_BLOCKS)
    assert s.path.staging_blocks == 2

    def chunks(local: list[int], remote: list[int], tokens: int) -> list[Any]:
        return [(lc.tolist(), rc.tolist(), n) for lc, rc, n in
                s.path.chunks(np.array(local), np.array(remote), tokens)]

    assert chunks([1], [3, 5], 4) == [([1], [3, 5], 4)]
    assert chunks([1, 2], [3, 5, 7], 6) == [([1], [3, 5], 4), ([2], [7], 2)]
    assert chunks([1, 2, 4], [3, 5, 7, 9, 11], 9) == [([1], [3, 5], 4), ([2], [7, 9], 4),
                                                      ([4], [11], 1)]
    assert _path().path.chunks(np.array([1, 2, 4]), np.array([3, 5, 7]), 12)[0][2] == 12


@pytest.mark.parametrize("knob", ["0", "1"])
def test_a_staging_read_over_the_buffer_goes_in_chunks_of_blocks(
        monkeypatch: pytest.MonkeyPatch, knob: str) -> None:
    """Chunks of blocks when windows are off, or when not even one layer of the request fits
    (7 prefill blocks of a layer are 896 B): each chunk one READ then its moves."""
    monkeypatch.setenv("FKV_STAGING_WINDOW", knob)
    s = _staging(TWO_BLOCKS)
    local, remote = [6, 0, 3, 5], [9, 2, 15, 4, 11, 1, 7]
    assert s.path.window(7) == 0 and s.path.stream_rows(np.array(local), np.array(remote),
                                                         13) is None
    tally = _read(s, local, remote, 13)
    _landed(s, local, remote, 13)
    assert len(s.agent.posted) == 4 and s.path.windowed_ranges == 0
    rows = [s.plan.rows(lc, rc, n) for lc, rc, n in
            s.path.chunks(np.array(local), np.array(remote), 13)]
    assert [n for _, n in s.agent.landed] == [int(r[:, 5].sum()) for r in rows]
    assert tally.descriptors == sum(r.shape[0] for r in rows)


def test_a_staging_read_over_the_buffer_goes_a_window_of_layers_at_a_time() -> None:
    """6 prefill blocks of one layer fill the buffer (768 B): one layer at a time, three
    READs, each layer's moves before the next READ overwrites the buffer."""
    s = _staging(TWO_BLOCKS)
    local, remote = [6, 0, 3], [9, 2, 15, 4, 11, 1]
    assert (s.path.window(2), s.path.window(3), s.path.window(6)) == (0, 2, 1)
    tally = _read(s, local, remote, 12)
    _landed(s, local, remote, 12)
    rows = s.plan.rows(np.array(local), np.array(remote), 12, 1)
    assert s.path.windowed_ranges == 3 and len(s.agent.posted) == 3
    assert (tally.bytes, tally.descriptors) == (int(rows[:, 5].sum()), rows.shape[0])
    assert [n for _, n in s.agent.landed] == [int(rows[rows[:, 1] == n][:, 5].sum())
                                              for n in range(3)]
    assert s.path.stream_rows(np.array(local), np.array(remote), 12).tolist() == rows.tolist()


def test_a_window_of_two_layers_and_a_layer_range() -> None:
    s = _staging(2 * TWO_BLOCKS)
    local, remote = [6, 0, 3], [9, 2, 15, 4, 11, 1]
    assert s.path.window(6) == 2 and s.path.staging_blocks == 4
    _read(s, local, remote, 12)
    _landed(s, local, remote, 12)
    assert s.path.windowed_ranges == 2 and len(s.agent.posted) == 2
    rows = s.path.stream_rows(np.array(local), np.array(remote), 12)
    s = _staging(2 * TWO_BLOCKS)
    _read(s, local, remote, 12, rows=rows, layers=(1, 3))
    _landed(s, local, remote, 12, layers=(1, 3))
    assert s.path.windowed_ranges == 1 and len(s.agent.posted) == 1
    s = _staging(TWO_BLOCKS)
    rows = s.path.stream_rows(np.array(local), np.array(remote), 12)
    _read(s, local, remote, 12, rows=rows, layers=(1, 3))
    _landed(s, local, remote, 12, layers=(1, 3))
    assert s.path.windowed_ranges == 2 and len(s.agent.posted) == 2


def test_a_windowed_layer_read_posts_the_read_made_ahead() -> None:
    s = _staging(TWO_BLOCKS)
    local, remote = np.array([6, 0, 3]), np.array([9, 2, 15, 4, 11, 1])
    rows = s.path.stream_rows(local, remote, 12)
    ahead = s.path.layer_reads(rows, 2)
    made = list(ahead.created)
    s.path.read("r1", local, remote, 12, _plan_path.time.monotonic() + 5, Tally(), rows=rows,
                layers=(2, 3), prepared=ahead)
    _landed(s, local.tolist(), remote.tolist(), 12, layers=(2, 3))
    assert s.agent.posted == made and s.path.prepared_reads == 1


@pytest.mark.parametrize("value", ["2", "", "yes"])
def test_a_bad_staging_window_knob_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                        value: str) -> None:
    monkeypatch.setenv("FKV_STAGING_WINDOW", value)
    with pytest.raises(FkvError) as e:
        _staging(TWO_BLOCKS)
    assert str(e.value) == (
        f"FKV_STAGING_WINDOW={value!r}: expected 1 (a staging read of a request larger than "
        f"the staging buffer moves a few layers of all its blocks at a time) or 0 (chunks of "
        f"blocks)")


def test_windows_need_per_layer_prefill_caches() -> None:
    s = _staging(TWO_BLOCKS)
    s.link.remote_spec = HALF.evolve(cross_layer=True)
    assert s.path.window(6) == 0 and not s.path.layered()
    s.link.remote_spec = HALF
    assert s.path.window(6) == 1 and s.path.layered()
    assert _path().path.window(100) == 0  # direct


# -- same-host copies -----------------------------------------------------------------------------

def test_same_host_copies_land_the_request_without_a_read() -> None:
    s = _two(copies=True)
    tally = _read(s, [5, 1, 2], [0, 7, 3], 10)
    _landed(s, [5, 1, 2], [0, 7, 3], 10)
    rows = s.plan.rows(np.array([5, 1, 2]), np.array([0, 7, 3]), 10)
    assert (tally.bytes, tally.descriptors) == (int(rows[:, 5].sum()), rows.shape[0])
    assert s.agent.created == [] and s.path.describe() == (
        f"direct: the plan's rows copied with process_vm_readv from the prefill processes "
        f"(P0 pid {os.getpid()}, P1 pid {os.getpid()})")
    s.path.close()
    assert s.path.copier is None


def test_same_host_copies_of_a_staging_plan_in_windows_and_layers() -> None:
    s = _staging(TWO_BLOCKS, copies=True)
    local, remote = [6, 0, 3], [9, 2, 15, 4, 11, 1]
    _read(s, local, remote, 12)
    _landed(s, local, remote, 12)
    assert s.path.windowed_ranges == 3
    s = _staging(copies=True, ranks=2)
    rows = s.path.stream_rows(np.array(local), np.array(remote), 12)
    ahead = s.path.layer_reads(rows, 1)
    assert (ahead.layers, ahead.granule, ahead.created) == ((1, 2), 0, None)
    assert [(r, nbytes) for r, _, _, nbytes in ahead.reads] == \
        [(r, int(rows[(rows[:, 1] == 1) & (rows[:, 0] == r)][:, 5].sum())) for r in (0, 1)]
    s.path.prime(ahead, 10.0)
    assert s.path.copier.primed == 2
    tally = _read(s, local, remote, 12, rows=rows, layers=(1, 2), prepared=ahead)
    _landed(s, local, remote, 12, layers=(1, 2))
    assert s.path.prepared_reads == 1 and tally.bytes == sum(r[3] for r in ahead.reads)
    _read(s, local, remote, 12, rows=rows, layers=(0, 1), prepared=ahead)  # another range
    _landed(s, local, remote, 12, layers=(0, 1))
    assert s.path.prepared_reads == 1 and s.agent.created == []


def test_a_failed_same_host_copy_fails_the_read_and_moves_nothing() -> None:
    s = _staging(copies=True, ranks=2)
    s.path.copier.sources[1].exited = lambda: True
    tally = Tally()
    with pytest.raises(TransferFailed) as e:
        s.path.read("r1", np.array([1, 2]), np.array([3, 5, 6, 9]), 8,
                    _plan_path.time.monotonic() + 5, tally)
    assert str(e.value) == (f"prefill rank 1 of engine 'p' (pid {os.getpid()}) exited: its "
                            f"bytes are not trusted; reconnect once it is back "
                            f"(client.reconnect())")
    rows = s.plan.rows(np.array([1, 2]), np.array([3, 5, 6, 9]), 8)
    assert tally.bytes == int(rows[rows[:, 0] == 0][:, 5].sum())
    _untouched(s)


def test_a_direct_sibling_borrows_the_copier_and_leaves_it_open() -> None:
    s = _staging(copies=True)
    direct = handshake((_engine("d"), SPEC), (_engine("p"), HALF), strategy="direct").plan
    with pytest.raises(FkvError, match=r"^PlanPath: a plan other than the link's is a direct "
                                       r"plan whose rows a same-host copier moves$"):
        PlanPath(s.link, 0, None, plan=direct)
    with pytest.raises(FkvError, match=r"^PlanPath: a plan other than the link's"):
        PlanPath(s.link, 0, s.path.copier, plan=s.plan)
    sibling = PlanPath(s.link, 0, s.path.copier, plan=direct)
    assert sibling.name == "direct" and sibling.describe().startswith(
        "direct: the direct plan's rows copied with process_vm_readv")
    _read(SimpleNamespace(path=sibling), [1, 2], [3, 5, 6, 9], 8)
    _landed(s, [1, 2], [3, 5, 6, 9], 8)
    sources = s.path.copier.sources
    sibling.close()
    assert sibling.copier is None and s.path.copier.sources is sources and sources
    s.path.close()
    assert sources == {}


# -- the bounds of chunks and windows, the rows a caller gives ------------------------------------

def test_chunks_of_tokens_hold_whole_blocks_on_both_sides() -> None:
    """3 prefill blocks fit (1152 B) but a chunk holds whole decode blocks (4 tokens): a
    request of exactly 3 prefill blocks is one chunk; 4 are two chunks of 2."""
    s = _staging(1152)
    assert s.path.staging_blocks == 3
    got = [(lc.tolist(), rc.tolist(), n) for lc, rc, n in
           s.path.chunks(np.array([1, 2]), np.array([3, 5, 7]), 6)]
    assert got == [([1, 2], [3, 5, 7], 6)]
    got = [(lc.tolist(), rc.tolist(), n) for lc, rc, n in
           s.path.chunks(np.array([1, 2]), np.array([3, 5, 7, 9]), 8)]
    assert got == [([1], [3, 5], 4), ([2], [7, 9], 4)]


def test_no_staging_window_when_the_knob_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FKV_STAGING_WINDOW", "0")
    s = _staging(TWO_BLOCKS)
    local, remote = [6, 0, 3], [9, 2, 15, 4, 11, 1]
    assert s.path.window(6) == 0
    _read(s, local, remote, 12)
    _landed(s, local, remote, 12)
    assert s.path.windowed_ranges == 0 and len(s.agent.posted) == 3  # 3 chunks of 2 blocks


def test_a_whole_windowed_read_given_the_whole_requests_rows_uses_the_windows() -> None:
    """The client passes the rows it computed to choose the path (every layer staged at once):
    a windowed read computes the window's own."""
    s = _staging(TWO_BLOCKS)
    local, remote = np.array([6, 0, 3]), np.array([9, 2, 15, 4, 11, 1])
    rows = s.plan.rows(local, remote, 12)
    tally = Tally()
    s.path.read("r1", local, remote, 12, _plan_path.time.monotonic() + 5, tally, rows)
    _landed(s, local.tolist(), remote.tolist(), 12)
    assert s.path.windowed_ranges == 3


def test_a_chunked_read_given_the_whole_requests_rows_computes_each_chunks() -> None:
    s = _staging(TWO_BLOCKS)
    local, remote = np.array([6, 0, 3, 5]), np.array([9, 2, 15, 4, 11, 1, 7])
    rows = s.plan.rows(local, remote, 13)
    s.path.read("r1", local, remote, 13, _plan_path.time.monotonic() + 5, Tally(), rows)
    _landed(s, local.tolist(), remote.tolist(), 13)
    assert len(s.agent.posted) == 4


def test_a_read_made_ahead_is_not_posted_by_a_read_in_chunks() -> None:
    """A prepared layer (from a one-chunk request's rows) given to a read that goes in chunks
    of blocks: each chunk reads its own rows; the prepared READs are discarded unposted."""
    s = _staging(TWO_BLOCKS)
    local, remote = np.array([6, 0, 3, 5]), np.array([9, 2, 15, 4, 11, 1, 7])
    ahead = s.path.layer_reads(_staging().plan.rows(local[:1], remote[:2], 4), 0)
    made = list(ahead.created)
    s.path.read("r1", local, remote, 13, _plan_path.time.monotonic() + 5, Tally(),
                layers=(0, 1), prepared=ahead)
    _landed(s, local.tolist(), remote.tolist(), 13, layers=(0, 1))
    assert len(s.agent.posted) == 4 and not any(h in s.agent.posted for h in made)
    s.path.discard_unposted()
    assert s.agent.discarded == made


def test_a_windowed_layer_read_of_part_of_a_window_posts_the_read_made_ahead() -> None:
    """Windows of 2 layers; the stream's last layer comes alone: its READ made ahead is
    posted, and only that layer moves."""
    s = _staging(2 * TWO_BLOCKS)
    local, remote = np.array([6, 0, 3]), np.array([9, 2, 15, 4, 11, 1])
    rows = s.path.stream_rows(local, remote, 12)
    for layers in ((0, 2), (2, 3)):
        ahead = s.path.layer_reads(rows, layers[0])
        s.path.read("r1", local, remote, 12, _plan_path.time.monotonic() + 5, Tally(),
                    rows=rows, layers=layers, prepared=ahead)
        _landed(s, local.tolist(), remote.tolist(), 12, layers=layers)
    assert s.path.prepared_reads == 1 and s.path.windowed_ranges == 2
    s.path.discard_unposted()
    assert s.path.discarded_reads == 1


@pytest.mark.parametrize("copies", [False, True])
def test_a_windowed_layer_read_without_rows_computes_the_windows(copies: bool) -> None:
    s = _staging(TWO_BLOCKS, copies=copies)
    local, remote = [6, 0, 3], [9, 2, 15, 4, 11, 1]
    _read(s, local, remote, 12, layers=(1, 3))
    _landed(s, local, remote, 12, layers=(1, 3))
    assert s.path.windowed_ranges == 2


@pytest.mark.parametrize("copies", [False, True])
def test_a_staging_layer_range_moves_only_those_layers(copies: bool) -> None:
    s = _staging(copies=copies)
    _read(s, [6, 0], [9, 2, 15, 4], 8, layers=(0, 1))
    _landed(s, [6, 0], [9, 2, 15, 4], 8, layers=(0, 1))
    _read(s, [6, 0], [9, 2, 15, 4], 8, layers=(1, 2))
    _landed(s, [6, 0], [9, 2, 15, 4], 8, layers=(1, 2))


def test_rows_off_the_prepared_granule_prepare_a_finer_one() -> None:
    s = _path()
    fine = s.link.granule
    s.link._prep(4 * fine)
    _read(s, [3, 6], [2, 5], 7)
    _landed(s, [3, 6], [2, 5], 7)
    assert s.link.granule == fine


def test_reads_made_ahead_never_prepare_the_lists_again_under_a_running_read() -> None:
    """A READ of a timed-out read still runs over the descriptor lists: a layer's READs made
    ahead that need a finer granule are not made (the lists stay, nothing is created); once
    NIXL ended that READ, the read of the layer releases it, prepares the finer lists and lands
    the layer."""
    s = _path()
    fine = s.link.granule
    s.link._prep(4 * fine)
    s.agent.released_dlists.clear()
    stuck = Xfer(_Handle(None, [], None, [], "p0"), "p0", 64)
    s.path.quarantine.append(stuck)
    rows = s.path.stream_rows(np.array([3, 6]), np.array([2, 5]), 7)
    ahead = s.path.layer_reads(rows, 0)
    assert (ahead.granule, ahead.reads, ahead.created) == (-1, (), None)
    assert s.link.granule == 4 * fine and s.agent.released_dlists == [] and s.agent.created == []
    assert s.path.quarantine == [stuck] and s.agent.released == []
    stuck.state = "DONE"
    _read(s, [3, 6], [2, 5], 7, rows=rows, layers=(0, 1), prepared=ahead)
    _landed(s, [3, 6], [2, 5], 7, layers=(0, 1))
    assert s.link.granule == fine and s.agent.released == [stuck.handle]
    assert s.path.prepared_reads == 0 and len(s.agent.released_dlists) == 2
    s.path.close()
    assert s.agent.unreleased() == []


def test_reads_made_ahead_on_the_prepared_granule_beside_a_running_read() -> None:
    """With the rows on the prepared granule, READs made ahead need no new lists: they are made
    while an older READ still runs (the read of the layer waits for it before posting them)."""
    s = _path()
    stuck = Xfer(_Handle(None, [], None, [], "p0"), "p0", 64)
    s.path.quarantine.append(stuck)
    rows = s.path.stream_rows(np.array([3, 6]), np.array([2, 5]), 8)
    ahead = s.path.layer_reads(rows, 1)
    assert ahead.granule == s.link.granule and len(ahead.created) == 1
    stuck.state = "ERR"
    _read(s, [3, 6], [2, 5], 8, rows=rows, layers=(1, 2), prepared=ahead)
    _landed(s, [3, 6], [2, 5], 8, layers=(1, 2))
    assert s.path.prepared_reads == 1 and s.agent.posted == s.agent.created


def test_an_ended_read_is_released_when_the_next_chunk_starts() -> None:
    """Also by a read that posts READs made ahead (it prepares no descriptors)."""
    s = _path()
    rows = s.path.stream_rows(np.array([1, 2]), np.array([3, 5]), 8)
    ahead = s.path.layer_reads(rows, 0)
    _read(s, [1, 2], [3, 5], 8, rows=rows, layers=(1, 2))
    first = s.agent.posted[-1]
    assert s.agent.released == []
    _read(s, [1, 2], [3, 5], 8, rows=rows, layers=(0, 1), prepared=ahead)
    assert s.agent.released == [first] and s.path.prepared_reads == 1


def test_a_read_waits_for_a_quarantined_read_that_ends_before_its_deadline() -> None:
    s = _path()
    s.agent.outcome = {"p0": "PROC"}
    with pytest.raises(TransferFailed, match="did not finish before the read's timeout"):
        _read(s, [1, 2], [3, 5], 8)
    s.agent.outcome = {}
    stuck = s.path.quarantine[0]
    polls = []

    def poll(x: Xfer) -> str:  # NIXL ends it at the third poll
        polls.append(x)
        if len(polls) == 3:
            x.state = "DONE"
        return x.state

    s.agent.poll = poll
    _read(s, [1, 2], [3, 5], 8)
    _landed(s, [1, 2], [3, 5], 8)
    assert polls == [stuck] * 3 and s.agent.released == [stuck.handle]


def test_every_wait_and_copy_has_the_reads_deadline() -> None:
    """The read's deadline (and the link's busy-poll time) reach every wait of a READ and every
    same-host copy."""
    s = _two()
    s.link.spin = 0.25
    deadline = _plan_path.time.monotonic() + 5
    s.path.read("r1", np.array([1, 2]), np.array([3, 5]), 8, deadline, Tally(), layers=(0, 1))
    s.path.read("r1", np.array([1, 2]), np.array([3, 5]), 8, deadline + 1, Tally())
    assert (s.agent.waits, s.agent.spins) == ([deadline, deadline + 1], [0.25, 0.25])
    s = _two(copies=True)
    copier, copies = s.path.copier, []
    real_copy = copier.copy

    def copy(rank: int, local: Any, remote: Any, nbytes: int, until: float) -> None:
        copies.append((rank, until))
        real_copy(rank, local, remote, nbytes, until)

    copier.copy = copy
    s.path.read("r1", np.array([1, 2]), np.array([3, 5]), 8, deadline, Tally())
    _landed(s, [1, 2], [3, 5], 8)
    assert copies == [(0, deadline), (1, deadline)]
