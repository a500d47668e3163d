"""A decode rank's :class:`~fkv.connector.transport._connection.Connection` over recording fakes
of what it builds on (the NIXL link, the same-host copier, the packed and ipc paths, the side
channel, outboxes): which paths it makes, the one path choice (``choose``) at its exact bounds,
``describe()``'s text, the Hello to each prefill rank, what a refused or failed connect closes;
and ``_base``: results, defaults, ``cache_regions``' checks, ``kernels``, ``on_device`` and the
small helpers. One process, no NIXL agent, well under a second a test."""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import fkv
from fkv.connector.handshake import EngineDesc, handshake
from fkv.connector.transport import _base, _cma, _connection, _ipc, _ipc_path, _outbox, _side
from fkv.connector.transport._base import (
    HandshakeRejected,
    ReadResult,
    SideChannelError,
    Tally,
    TransferFailed,
    cache_regions,
)
from fkv.connector.transport._connection import DIRECT_ROWS_PER_LAYER, Connection
from fkv.connector.transport._link import Local
from fkv.connector.wire import BoardInfo, Peer
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

#: The prefill spec; a decode rank of the same layout reads it with a direct plan (2 rows a remote
#: block), one of NHD with a staging plan whose direct sibling has 32 rows a block (16 a layer).
PREFILL = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                          num_layers=2)
NHD = PREFILL.evolve(layout="NHD")
MLA = fkv.KVCacheSpec(backend="mla", num_blocks=8, block_size=4, num_kv_heads=1, head_size=32,
                      num_layers=2)
HOST = "host-a"  # this host's identity (``_ipc.host_identity``, faked)
SECRET = b"s" * 16
COPIED = "copied by the fake copier"


# -- the fakes ---------------------------------------------------------------------------------

class Rig:
    """What the fakes do (set before ``build``) and what they saw (``log``, ``hellos``)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.hellos: list[tuple] = []      # (address, Hello, timeout, curve) in order
        self.replies: dict[int, Any] = {}  # prefill rank -> the reply to its Hello (default Ok)
        self.raises: dict[int, BaseException] = {}  # prefill rank -> what its Hello raises
        self.ipc_refusal: str = ""
        self.ipc_fails: str = ""           # IpcPath raises FkvError(this)
        self.sizing_reason: str = ""       # packed_sizing says None and this
        self.copy_fails: Any = ""          # SameHostCopy raises FkvError(this), or this
        self.wire_up_fails = False
        self.packed_fails = False
        self.outbox_wanted = False         # True: outboxes for ranks on this host
        self.outbox_oserror = False
        self.outboxes: list[FakeOutbox] = []
        self.sizings: list[str] = []       # the plan strategy of each packed_sizing call


class FakeLink:
    def __init__(self, rig: Rig, local: Local, plan: Any, peers: list, entries: list, *,
                 staging_path_bytes: int, staging_bytes: int, deadline: float) -> None:
        rig.log.append(("link", staging_path_bytes, staging_bytes))
        self.rig, self.local, self.plan, self.remote_spec = rig, local, plan, peers[0].spec
        self.outboxes: dict[int, Any] = {}
        self.mem_types = {r: entries[r].mem_type for r in plan.remote_ranks}
        self.staging = torch.empty(max(staging_bytes, 1), dtype=torch.uint8)
        self.staging_path_bytes = staging_path_bytes

    def wire_up(self, ranks: tuple, deadline: float) -> None:
        self.rig.log.append(("wire_up", tuple(ranks)))
        if self.rig.wire_up_fails:
            raise TransferFailed("wire-up failed")

    def close(self) -> None:
        self.rig.log.append(("link.close", sorted(self.outboxes)))
        for box in self.outboxes.values():
            box.close()
        self.outboxes.clear()


class _FakePart:
    """A part a connection makes and closes: its ``describe()`` is ``text``, its close logged."""

    tag = text = ""
    rig: Rig

    def describe(self) -> str:
        return self.text

    def close(self) -> None:
        self.rig.log.append((f"{self.tag}.close",))


class FakeCopier(_FakePart):
    tag, text = "copier", COPIED

    def __init__(self, rig: Rig, regions: list, staging: Any, peers: dict, engine_id: str,
                 threads: int) -> None:
        if isinstance(rig.copy_fails, BaseException):
            raise rig.copy_fails
        if rig.copy_fails:
            raise FkvError(rig.copy_fails)
        rig.log.append(("copier", staging, sorted(peers), engine_id, threads))
        self.rig = rig


class FakePacked(_FakePart):
    name = tag = "packed"
    text = "packed: the fake"

    def __init__(self, rig: Rig, link: Any, sizing: Any) -> None:
        if rig.packed_fails:
            raise FkvError("packed path failed")
        rig.log.append(("packed", sizing.buffer_bytes))
        self.rig = rig


class FakeIpc(_FakePart):
    tag, text = "ipc", "ipc: the fake"

    def __init__(self, rig: Rig, local: Local, plan: Any, peers: list, engine_id: str) -> None:
        if rig.ipc_fails:
            raise FkvError(rig.ipc_fails)
        rig.log.append(("ipc", engine_id))
        self.rig = rig


class FakeOutbox:
    def __init__(self, rig: Rig) -> None:
        if rig.outbox_oserror:
            raise OSError("no /dev/shm")
        n = len(rig.outboxes)
        self.rig, self.name, self.token = rig, f"fkv-outbox-{n:032x}", bytes([n]) * 16
        self.unlinked = self.closed = False
        rig.outboxes.append(self)

    def unlink(self) -> None:
        self.unlinked = True

    def close(self) -> None:
        self.closed = True
        self.rig.log.append(("outbox.close", self.name))


class FakeAgent:
    name = "agent-d"

    def __init__(self, progress: str) -> None:
        self.progress = progress


class Entry:
    """What rank 0 lists of one prefill rank (``_side.RankEntry``'s fields the connection uses)."""

    def __init__(self, rank: int, mem_type: str) -> None:
        self.mem_type, self.address = mem_type, f"tcp://p{rank}:1"
        self.pack_base, self.pack_bytes = 0, 1 << 20


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    rig = Rig()

    def packed_sizing(local: Any, plan: Any, entries: Any, rs: Any) -> tuple:
        rig.sizings.append(plan.strategy)
        if rig.sizing_reason:
            return None, rig.sizing_reason
        return SimpleNamespace(buffer_bytes=4096), ""

    def request(ctx: Any, address: str, msg: Any, timeout: float, curve: Any = None) -> Any:
        rank = int(address.split("//p")[1].split(":")[0])
        rig.hellos.append((address, msg, timeout, curve))
        if rank in rig.raises:
            raise rig.raises[rank]
        return rig.replies.get(rank, _side.Ok(engine_id="p"))

    for var in ("FKV_CMA_DIRECT_ROWS", "FKV_CMA", "FKV_STAGING_WINDOW", "FKV_OUTBOX",
                "FKV_CMA_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_connection, "Link", lambda *a, **k: FakeLink(rig, *a, **k))
    monkeypatch.setattr(_connection, "PackedPath", lambda *a: FakePacked(rig, *a))
    monkeypatch.setattr(_connection, "packed_sizing", packed_sizing)
    monkeypatch.setattr(_cma, "SameHostCopy", lambda *a: FakeCopier(rig, *a))
    monkeypatch.setattr(_ipc_path, "IpcPath", lambda *a: FakeIpc(rig, *a))
    monkeypatch.setattr(_ipc, "ipc_refusal", lambda peer, device: rig.ipc_refusal)
    monkeypatch.setattr(_ipc, "host_identity", lambda: HOST)
    monkeypatch.setattr(_side, "request", request)
    monkeypatch.setattr(_outbox, "Outbox", lambda: FakeOutbox(rig))
    monkeypatch.setattr(_outbox, "outbox_wanted", lambda: rig.outbox_wanted)
    return rig


def build(rig: Rig, strategy: str = "auto", *, spec: Any = NHD, remote: Any = PREFILL,
          prefill_tp: int = 1, cuda: bool = False, hosts: Any = None, progress: str = "poll",
          pack_threshold: int = 8, staging_bytes: int = 1 << 20, deadline: float = 30.0,
          curve: Any = None, prefill_mem: Any = None, decode: tuple[int, int] = (0, 1)
          ) -> Connection:
    """A Connection of decode rank ``decode[0]`` of tp ``decode[1]`` (``spec``) to a prefill
    engine of ``prefill_tp`` ranks (``remote``), on the CPU (DRAM) or ``cuda``; ``hosts[r]``:
    prefill rank r's host (None: no publish board), every rank on this host by default;
    ``prefill_mem[r]``: rank r's memory type (default: the decode rank's)."""
    heads = remote.num_kv_heads * prefill_tp if remote.backend != "mla" else 1
    decode = EngineDesc(engine_id="d", tp_size=decode[1], tp_rank=decode[0],
                        total_num_kv_heads=heads)
    prefill = [EngineDesc(engine_id="p", tp_size=prefill_tp, tp_rank=r, total_num_kv_heads=heads)
               for r in range(prefill_tp)]
    outcome = handshake((decode, spec), (prefill[0], remote),
                        strategy=strategy if strategy in ("direct", "staging") else "auto")
    assert outcome.ok, outcome
    hosts = [HOST] * prefill_tp if hosts is None else hosts
    peers = [Peer(engine=prefill[r], spec=remote,
                  regions=tuple(((r + 1 << 32) + i * (1 << 20), remote.region_bytes)
                                for i in range(remote.num_regions)),
                  board=None if hosts[r] is None else BoardInfo(
                      host=hosts[r], name=f"fkv-board-{r}", salt=bytes(16), pid=1000 + r))
             for r in range(prefill_tp)]
    mem = "VRAM" if cuda else "DRAM"
    local = Local(engine=decode, spec=spec, views=[],
                  regions=[(1 << 24 + i, spec.region_bytes) for i in range(spec.num_regions)],
                  mem_type=mem, device_id=0, device=torch.device("cuda" if cuda else "cpu"),
                  agent=FakeAgent(progress), zctx=None, strategy=strategy,
                  staging_bytes_max=staging_bytes, pack_threshold=pack_threshold, curve=curve,
                  secret=SECRET)
    mems = prefill_mem or [mem] * prefill_tp
    return Connection(local, outcome.plan, peers, [Entry(r, mems[r]) for r in range(prefill_tp)],
                      time.monotonic() + deadline)


def said(conn: Connection) -> list[str]:
    """``conn.describe()``'s lines after the plan's own description (which it starts with)."""
    text, plan = conn.describe(), conn.plan.describe()
    assert text.startswith(plan + "\n"), text
    return text[len(plan) + 1:].split("\n")


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def blocks(n: int) -> np.ndarray:
    """``n`` remote (or local) blocks that never merge: every other block id."""
    return np.arange(0, 2 * n, 2, dtype=np.int64)


# -- which paths a connection builds, and choose ---------------------------------------------------

def test_auto_on_one_host_with_a_staging_plan_copies_small_requests_with_the_direct_plan(
        rig: Rig) -> None:
    """16 direct rows a layer per remote block, the default bound 1024: up to 64 blocks go
    direct (the sibling), 65 the staging plan's rows; the sibling borrows the plan path's
    copier."""
    conn = build(rig)
    assert conn.plan.strategy == "staging" and conn.direct is not None
    assert conn.direct.plan.strategy == "direct" and conn.direct.copier is conn.plan_path.copier
    assert conn._direct_rows_per_block == 16.0 and conn._direct_rows_max == DIRECT_ROWS_PER_LAYER
    assert (conn.plan_path.staging_blocks, conn.direct.staging_blocks) == (8, 0)
    assert conn.choose(blocks(64), blocks(64), 256) == (conn.direct, None)
    path, rows = conn.choose(blocks(65), blocks(65), 260)
    assert (path, rows) == (conn.plan_path, None) and path.name == "staging"
    staging = conn.plan.staging_bytes(conn.plan_path.staging_blocks)
    assert rig.log == [("link", staging, staging),
                       ("copier", (conn.link.staging.data_ptr(), staging), [0], "p", 4)]
    assert rig.sizings == []  # no packed reads on the CPU
    assert (conn.ipc, conn.packed, conn.ipc_reason, conn.copy_reason) == (
        None, None, "the decode caches are not on CUDA (ipc maps GPU memory)", "")
    assert conn.packed_reason == ("'auto' packs only when the caches of both sides are on CUDA "
                                  "(strategy='packed' forces packed reads)")


@pytest.mark.parametrize(("value", "most", "small"), [("16", 16, 1), ("17", 17, 1),
                                                      ("32", 32, 2), ("31", 31, 1)])
def test_the_direct_rows_knob_bounds_the_sibling_exactly(rig: Rig, monkeypatch: Any, value: str,
                                                         most: int, small: int) -> None:
    """``FKV_CMA_DIRECT_ROWS`` rows a layer: a request of ``small`` blocks (16 rows a layer
    each) is at most that, one more block is over it."""
    monkeypatch.setenv("FKV_CMA_DIRECT_ROWS", value)
    conn = build(rig)
    assert conn._direct_rows_max == most
    assert said(conn)[1] == (f"same host, a request of at most {most} direct rows per layer (16 "
                             f"per remote block): direct: the direct plan's rows {COPIED}")
    assert conn.choose(blocks(small), blocks(small), 4 * small) == (conn.direct, None)
    assert conn.choose(blocks(small + 1), blocks(small + 1), 4 * small + 4) == \
        (conn.plan_path, None)


def test_direct_rows_0_makes_no_sibling_and_every_request_follows_the_plan(
        rig: Rig, monkeypatch: Any) -> None:
    monkeypatch.setenv("FKV_CMA_DIRECT_ROWS", "0")
    conn = build(rig)
    assert conn.direct is None and conn._direct_rows_max == 0
    assert conn.choose(blocks(1), blocks(1), 4) == (conn.plan_path, None)
    assert said(conn) == [
        f"same host: staging: the plan's rows {COPIED}",
        "ipc: off (the decode caches are not on CUDA (ipc maps GPU memory))",
        "packed reads off ('auto' packs only when the caches of both sides are on CUDA "
        "(strategy='packed' forces packed reads)): every request follows the plan"]


@pytest.mark.parametrize("value", ["-1", "x", "1.5", "", "-0x1"])
def test_a_bad_direct_rows_knob_fails_the_connect_before_anything_is_made(
        rig: Rig, monkeypatch: Any, value: str) -> None:
    monkeypatch.setenv("FKV_CMA_DIRECT_ROWS", value)
    with pytest.raises(FkvError) as e:
        build(rig)
    assert str(e.value) == (f"FKV_CMA_DIRECT_ROWS={value!r}: expected an integer >= 0 (the most "
                            f"direct rows per layer a same-host request copies instead of "
                            f"staging; 0: never)")
    assert rig.log == [] and rig.hellos == []


@pytest.mark.parametrize(("value", "most"), [(" 7 ", 7), ("0012", 12), ("1_000", 1000)])
def test_the_direct_rows_knob_takes_what_int_takes(rig: Rig, monkeypatch: Any, value: str,
                                                   most: int) -> None:
    monkeypatch.setenv("FKV_CMA_DIRECT_ROWS", value)
    assert _connection.direct_rows_per_layer() == most


def test_a_cross_layer_side_counts_the_sibling_rows_of_all_layers_as_one_layer(
        rig: Rig) -> None:
    """One buffer of all layers: the plan's descriptors per remote block are not divided by the
    layers (a row spans them)."""
    remote = PREFILL.evolve(cross_layer=True)
    conn = build(rig, remote=remote)
    sibling = handshake((EngineDesc(engine_id="d", tp_size=1, tp_rank=0, total_num_kv_heads=2),
                         NHD), (EngineDesc(engine_id="p", tp_size=1, tp_rank=0,
                                           total_num_kv_heads=2), remote), strategy="direct")
    assert conn.direct is not None
    assert conn._direct_rows_per_block == sibling.plan.cost.descriptors / 1 == 32.0


@pytest.mark.parametrize("strategy", ["nixl", "staging", "direct"])
def test_only_auto_makes_the_direct_sibling(rig: Rig, strategy: str) -> None:
    conn = build(rig, strategy)
    assert conn.direct is None
    assert conn.choose(blocks(1), blocks(1), 4) == (conn.plan_path, None)


def test_nixl_keeps_nixl_reads_and_says_why(rig: Rig) -> None:
    conn = build(rig, "nixl")
    assert conn.plan_path.copier is None and conn.copy_reason == \
        "strategy 'nixl' keeps NIXL READs"
    assert [e[0] for e in rig.log] == ["link"]
    assert said(conn) == [
        "same-host copies off (strategy 'nixl' keeps NIXL READs): NIXL READs",
        "packed reads off ('auto' packs only when the caches of both sides are on CUDA "
        "(strategy='packed' forces packed reads)): every request follows the plan"]
    assert conn.ipc_reason == "strategy 'nixl' forced"


@pytest.mark.parametrize(("strategy", "name"), [("staging", "staging"), ("direct", "direct")])
def test_a_forced_plan_strategy_says_so(rig: Rig, strategy: str, name: str) -> None:
    conn = build(rig, strategy, spec=PREFILL)
    assert conn.plan_path.name == name and conn.packed_reason == f"strategy {strategy!r} forced"
    assert conn.describe() == "\n".join([
        conn.plan.describe(), f"same host: {name}: the plan's rows {COPIED}",
        f"strategy {strategy!r} forced: every request follows the plan"])


def test_a_sibling_describe_names_its_bound_and_rows_a_block(rig: Rig) -> None:
    conn = build(rig)
    assert conn.describe() == "\n".join([
        conn.plan.describe(),
        f"same host: staging: the plan's rows {COPIED}",
        f"same host, a request of at most 1024 direct rows per layer (16 per remote block): "
        f"direct: the direct plan's rows {COPIED}",
        "ipc: off (the decode caches are not on CUDA (ipc maps GPU memory))",
        "packed reads off ('auto' packs only when the caches of both sides are on CUDA "
        "(strategy='packed' forces packed reads)): every request follows the plan"])


@pytest.mark.parametrize(("hosts", "why"), [
    (["host-b"], "prefill rank 0 runs on another host ('host-b')"),
    ([None], "prefill rank 0 announced no publish board (no host identity)"),
])
def test_no_copier_when_a_rank_is_elsewhere_and_describe_says_why(rig: Rig, hosts: list,
                                                                  why: str) -> None:
    conn = build(rig, hosts=hosts)
    assert (conn.plan_path.copier, conn.direct, conn.copy_reason) == (None, None, why)
    assert conn.choose(blocks(1), blocks(1), 4) == (conn.plan_path, None)
    assert said(conn)[0] == f"same-host copies off ({why}): NIXL READs"


def test_the_first_refusing_rank_names_why_no_copier(rig: Rig) -> None:
    """Prefill tp 2: rank 0 here, rank 1 elsewhere: no copier, the reason rank 1's."""
    conn = build(rig, remote=PREFILL.evolve(num_kv_heads=1), prefill_tp=2,
                 hosts=[HOST, "host-b"])
    assert conn.plan.remote_ranks == (0, 1)
    assert conn.copy_reason == "prefill rank 1 runs on another host ('host-b')"
    assert conn.plan_path.copier is None and [e[0] for e in rig.log] == ["link"]


def test_of_two_refusing_ranks_the_first_names_why_no_copier(rig: Rig) -> None:
    conn = build(rig, remote=PREFILL.evolve(num_kv_heads=1), prefill_tp=2,
                 hosts=["host-b", None])
    assert conn.copy_reason == "prefill rank 0 runs on another host ('host-b')"


def test_only_the_ranks_read_decide_and_are_copied_from(rig: Rig) -> None:
    """MLA, prefill tp 2: rank 1, only notified, runs elsewhere; rank 0 is copied from."""
    conn = build(rig, spec=MLA, remote=MLA, prefill_tp=2, hosts=[HOST, "host-b"])
    assert conn.copy_reason == "" and conn.plan_path.copier is not None
    assert rig.log == [("link", 0, 0), ("copier", None, [0], "p", 4)]


def test_fkv_cma_0_turns_copies_off(rig: Rig, monkeypatch: Any) -> None:
    monkeypatch.setenv("FKV_CMA", "0")
    conn = build(rig)
    assert (conn.plan_path.copier, conn.direct, conn.copy_reason) == (None, None, "FKV_CMA=0")


def test_a_copier_that_cannot_attach_leaves_nixl_reads_naming_why(rig: Rig) -> None:
    rig.copy_fails = "pid 1000 is not copyable"
    conn = build(rig)
    assert (conn.plan_path.copier, conn.direct, conn.copy_reason) == (
        None, None, "pid 1000 is not copyable")
    assert said(conn)[0] == \
        "same-host copies off (pid 1000 is not copyable): NIXL READs"


def test_a_copier_that_fails_otherwise_than_refusing_fails_the_connect(rig: Rig) -> None:
    """Only an FkvError (a refusal naming why) leaves NIXL READs; any other error, a plain
    ValueError included, is a bug to see: the connect fails and closes the link."""
    rig.copy_fails = ValueError("bad iovec")
    with pytest.raises(ValueError, match="^bad iovec$") as e:
        build(rig)
    assert not isinstance(e.value, FkvError)
    assert rig.log == [("link", 4096, 4096), ("link.close", [])]


def test_a_direct_plan_copier_gets_no_staging_area_and_no_sibling(rig: Rig) -> None:
    conn = build(rig, spec=PREFILL)
    assert conn.plan.strategy == "direct" and conn.direct is None
    assert rig.log == [("link", 0, 0), ("copier", None, [0], "p", 4)]


def test_a_bad_copy_threads_knob_fails_the_connect_and_closes_the_link(
        rig: Rig, monkeypatch: Any) -> None:
    monkeypatch.setenv("FKV_CMA_THREADS", "0")
    with pytest.raises(FkvError, match=r"^FKV_CMA_THREADS='0'"):
        build(rig)
    assert [e[0] for e in rig.log] == ["link", "link.close"]


def test_without_a_progress_thread_the_copier_wires_up_every_rank_read(rig: Rig) -> None:
    build(rig, remote=PREFILL.evolve(num_kv_heads=1), prefill_tp=2, progress="off")
    assert [e[0] for e in rig.log] == ["link", "copier", "wire_up"]
    assert rig.log[-1] == ("wire_up", (0, 1))


def test_a_failed_wire_up_closes_the_copier_and_the_link(rig: Rig) -> None:
    rig.wire_up_fails = True
    with pytest.raises(TransferFailed, match="^wire-up failed$"):
        build(rig, progress="off")
    assert [e[0] for e in rig.log] == ["link", "copier", "wire_up", "copier.close", "link.close"]


def test_a_bad_staging_window_knob_closes_the_copier_it_made(rig: Rig, monkeypatch: Any) -> None:
    """The plan path refuses ``FKV_STAGING_WINDOW`` after the copier attached to the prefill
    processes: the failed connect closes it (its pidfds and boards) and the link."""
    monkeypatch.setenv("FKV_STAGING_WINDOW", "2")
    with pytest.raises(FkvError, match=r"^FKV_STAGING_WINDOW='2'"):
        build(rig)
    assert [e[0] for e in rig.log] == ["link", "copier", "copier.close", "link.close"]


def test_close_closes_the_sibling_then_the_plan_path_its_copier_then_the_link(rig: Rig) -> None:
    conn = build(rig)
    direct, plan_path = conn.direct, conn.plan_path
    del rig.log[:]
    conn.close()
    assert rig.log == [("copier.close",), ("link.close", [])]
    assert (conn.ipc, conn.packed, conn.direct, conn.link) == (None, None, None, None)
    assert direct.copier is None and plan_path.copier is None
    conn.close()  # twice: nothing more
    assert rig.log == [("copier.close",), ("link.close", [])]


# -- CUDA: packed and ipc ----------------------------------------------------------------------

def test_auto_on_cuda_packs_requests_with_more_descriptors_than_the_threshold(rig: Rig) -> None:
    """The direct plan has 2 descriptors a remote block; threshold 8: 4 blocks never need rows
    computed, 5 scattered blocks (10 rows) read packed, 5 contiguous ones merge under it."""
    rig.ipc_refusal = "no peer access"
    conn = build(rig, spec=PREFILL, cuda=True)
    assert (conn.plan.strategy, conn.plan.cost.descriptors) == ("direct", 2)
    assert rig.sizings == ["direct"] and conn.packed is not None
    assert rig.log == [("link", 0, 4096), ("packed", 4096)]
    assert conn.choose(blocks(4), blocks(4), 16) == (conn.plan_path, None)
    assert conn.choose(blocks(5), blocks(5), 20) == (conn.packed, None)
    local, remote = np.arange(5, dtype=np.int64), np.arange(5, dtype=np.int64)
    path, rows = conn.choose(local, remote, 20)
    assert path is conn.plan_path
    assert np.array_equal(rows, conn.plan.rows(local, remote, 20)) and rows.shape[0] <= 8
    assert conn.describe() == "\n".join([
        conn.plan.describe(), "ipc: off (no peer access)",
        "auto: a request whose plan needs more than 8 descriptors reads packed; "
        "packed: the fake"])


def test_a_merged_request_of_exactly_the_threshold_rows_follows_the_plan(rig: Rig) -> None:
    """Rows computed (over the quick bound) and exactly the threshold: the plan's rows; one
    more row: packed."""
    rig.ipc_refusal = "no peer access"
    conn = build(rig, spec=PREFILL, cuda=True)
    local, remote = ids(0, 1, 3), ids(0, 1, 3)  # blocks 0 and 1 merge
    rows = conn.plan.rows(local, remote, 12)
    threshold_rows = rows.shape[0]
    assert threshold_rows < conn.plan.cost.descriptors * 3  # over the quick bound
    conn.local.pack_threshold = threshold_rows
    path, got = conn.choose(local, remote, 12)
    assert path is conn.plan_path and np.array_equal(got, rows)
    conn.local.pack_threshold = threshold_rows - 1
    assert conn.choose(local, remote, 12) == (conn.packed, None)


def test_nixl_on_cuda_packs_like_auto_but_never_maps(rig: Rig) -> None:
    conn = build(rig, "nixl", spec=PREFILL, cuda=True)
    assert conn.ipc is None and conn.ipc_reason == "strategy 'nixl' forced"
    assert conn.choose(blocks(5), blocks(5), 20) == (conn.packed, None)
    assert conn.describe() == "\n".join([
        conn.plan.describe(), "auto: a request whose plan needs more than 8 descriptors reads "
        "packed; packed: the fake"])


def test_auto_on_cuda_without_a_pack_buffer_follows_the_plan_naming_why(rig: Rig) -> None:
    rig.ipc_refusal, rig.sizing_reason = "no peer access", "prefill rank 0 serves no pack buffer"
    conn = build(rig, spec=PREFILL, cuda=True)
    assert conn.packed is None and conn.choose(blocks(9), blocks(9), 36) == (conn.plan_path, None)
    assert said(conn) == [
        "ipc: off (no peer access)",
        "packed reads off (prefill rank 0 serves no pack buffer): every request follows the plan"]


def test_auto_packs_only_when_every_rank_read_is_on_cuda(rig: Rig) -> None:
    """Decode on CUDA, the prefill ranks in DRAM: no packed reads."""
    rig.ipc_refusal = "no peer access"
    conn = build(rig, spec=PREFILL, cuda=True, prefill_mem=["DRAM"])
    assert conn.packed is None and rig.sizings == []
    rig.sizings.clear()
    conn = build(rig, spec=NHD, remote=PREFILL.evolve(num_kv_heads=1), prefill_tp=2, cuda=True,
                 prefill_mem=["VRAM", "DRAM"])
    assert conn.packed is None and rig.sizings == []
    assert conn.packed_reason == ("'auto' packs only when the caches of both sides are on CUDA "
                                  "(strategy='packed' forces packed reads)")


def test_packed_forced_reads_every_request_packed(rig: Rig) -> None:
    conn = build(rig, "packed", spec=PREFILL)
    assert rig.sizings == ["direct"] and conn.ipc_reason == "strategy 'packed' forced"
    assert conn.choose(ids(1), ids(1), 4) == (conn.packed, None)
    assert conn.describe() == "\n".join([conn.plan.describe(),
                                         f"same host: direct: the plan's rows {COPIED}",
                                         "packed: the fake"])


def test_packed_forced_without_a_pack_buffer_is_refused_naming_why(rig: Rig) -> None:
    rig.sizing_reason = "prefill rank 0 serves no pack buffer (serve(..., pack_bytes=0))"
    with pytest.raises(FkvError) as e:
        build(rig, "packed")
    assert str(e.value) == ("strategy='packed' is not possible with prefill engine 'p': prefill "
                            "rank 0 serves no pack buffer (serve(..., pack_bytes=0))")
    assert rig.log == [] and rig.hellos == []


def test_a_packed_path_that_fails_closes_the_plan_path_and_the_link(rig: Rig) -> None:
    rig.packed_fails = True
    with pytest.raises(FkvError, match="^packed path failed$"):
        build(rig, "packed")
    assert [e[0] for e in rig.log] == ["link", "copier", "copier.close", "link.close"]


def test_auto_on_cuda_maps_and_every_request_goes_ipc(rig: Rig) -> None:
    conn = build(rig, spec=PREFILL, cuda=True)
    assert conn.ipc is not None and conn.ipc_reason == ""
    assert rig.log == [("link", 0, 4096), ("packed", 4096), ("ipc", "p")]
    assert conn.choose(blocks(40), blocks(40), 160) == (conn.ipc, None)
    assert conn.describe() == f"{conn.plan.describe()}\nevery request: ipc: the fake"
    del rig.log[:]
    conn.close()
    assert rig.log == [("ipc.close",), ("packed.close",), ("link.close", [])]
    assert (conn.ipc, conn.packed, conn.link) == (None, None, None)
    conn.close()  # twice: nothing more
    assert rig.log == [("ipc.close",), ("packed.close",), ("link.close", [])]


def test_ipc_forced_refused_before_anything_is_made(rig: Rig) -> None:
    rig.ipc_refusal = "prefill rank 0 is on another GPU without peer access"
    with pytest.raises(FkvError) as e:
        build(rig, "ipc", spec=PREFILL, cuda=True)
    assert str(e.value) == ("strategy='ipc' is not possible with prefill engine 'p': prefill "
                            "rank 0 is on another GPU without peer access; use strategy='auto' "
                            "(NIXL)")
    assert rig.log == [] and rig.hellos == []


def test_ipc_forced_on_the_cpu_is_refused(rig: Rig) -> None:
    with pytest.raises(FkvError) as e:
        build(rig, "ipc", spec=PREFILL)
    assert str(e.value) == ("strategy='ipc' is not possible with prefill engine 'p': the decode "
                            "caches are not on CUDA (ipc maps GPU memory); use strategy='auto' "
                            "(NIXL)")


def test_ipc_forced_whose_mapping_fails_closes_everything(rig: Rig) -> None:
    rig.ipc_fails = "cudaIpcOpenMemHandle failed"
    with pytest.raises(FkvError) as e:
        build(rig, "ipc", spec=PREFILL, cuda=True)
    assert str(e.value) == ("strategy='ipc' with prefill engine 'p': cudaIpcOpenMemHandle "
                            "failed; use strategy='auto' (NIXL)")
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert rig.log == [("link", 0, 0), ("link.close", [])]


def test_ipc_forced_maps_and_describes(rig: Rig) -> None:
    conn = build(rig, "ipc", spec=PREFILL, cuda=True)
    assert conn.packed is None and conn.packed_reason == "strategy 'ipc' forced"
    assert conn.choose(ids(1), ids(1), 4) == (conn.ipc, None)


def test_auto_whose_mapping_fails_reads_over_nixl_naming_why(rig: Rig) -> None:
    rig.ipc_fails = "cudaIpcOpenMemHandle failed"
    conn = build(rig, spec=PREFILL, cuda=True)
    assert conn.ipc is None
    assert conn.ipc_reason == "mapping the prefill caches failed: cudaIpcOpenMemHandle failed"
    assert conn.choose(blocks(1), blocks(1), 4) == (conn.plan_path, None)
    assert said(conn)[0] == \
        "ipc: off (mapping the prefill caches failed: cudaIpcOpenMemHandle failed)"


def test_the_first_rank_ipc_refuses_names_why(rig: Rig, monkeypatch: Any) -> None:
    seen: list[int] = []

    def refusal(peer: Any, device: Any) -> str:
        seen.append(peer.engine.tp_rank)
        return "" if peer.engine.tp_rank == 0 else f"rank {peer.engine.tp_rank} elsewhere"

    monkeypatch.setattr(_ipc, "ipc_refusal", refusal)
    conn = build(rig, spec=NHD, remote=PREFILL.evolve(num_kv_heads=1), prefill_tp=2, cuda=True)
    assert seen == [0, 1] and conn.ipc is None and conn.ipc_reason == "rank 1 elsewhere"


# -- the Hello ---------------------------------------------------------------------------------

def test_every_rank_read_then_every_notify_only_rank_gets_a_hello_with_an_outbox(
        rig: Rig) -> None:
    """MLA, prefill tp 2: rank 0 read, rank 1 only notified; both on this host: an outbox
    each, the one rank 0 takes kept (its name unlinked), the one rank 1 declines closed."""
    rig.outbox_wanted = True
    rig.replies = {0: _side.Ok(engine_id="p", outbox=True), 1: _side.Ok(engine_id="p")}
    conn = build(rig, spec=MLA, remote=MLA, prefill_tp=2, curve="the-curve")
    assert (conn.plan.remote_ranks, conn.plan.notify_only_ranks) == ((0,), (1,))
    first, second = rig.outboxes
    assert [(a, m, c) for a, m, _, c in rig.hellos] == [
        ("tcp://p0:1", _side.Hello(engine_id="d", rank=0, tp_size=1, agent="agent-d",
                                   secret=SECRET, outbox=_side.OutboxInfo(
                                       host=HOST, name=first.name, token=first.token)),
         "the-curve"),
        ("tcp://p1:1", _side.Hello(engine_id="d", rank=0, tp_size=1, agent="agent-d",
                                   secret=SECRET, outbox=_side.OutboxInfo(
                                       host=HOST, name=second.name, token=second.token)),
         "the-curve")]
    assert all(25.0 < t <= 30.0 for _, _, t, _ in rig.hellos)
    assert conn.link.outboxes == {0: first}
    assert (first.unlinked, first.closed, second.unlinked, second.closed) == (True, False,
                                                                              True, True)
    conn.close()
    assert first.closed


def test_the_hello_names_this_decode_rank_and_its_engines_size(rig: Rig) -> None:
    build(rig, spec=NHD.evolve(num_kv_heads=1), decode=(1, 2))
    assert [m for _, m, _, _ in rig.hellos] == [_side.Hello(
        engine_id="d", rank=1, tp_size=2, agent="agent-d", secret=SECRET, outbox=None)]


def test_each_ranks_outbox_names_that_ranks_host(rig: Rig) -> None:
    """MLA, prefill tp 2: rank 0 announced no board (no outbox), rank 1 is on this host."""
    rig.outbox_wanted = True
    build(rig, spec=MLA, remote=MLA, prefill_tp=2, hosts=[None, HOST])
    (box,) = rig.outboxes
    assert [m.outbox for _, m, _, _ in rig.hellos] == [
        None, _side.OutboxInfo(host=HOST, name=box.name, token=box.token)]


def test_a_hello_past_the_deadline_still_waits_50_ms(rig: Rig) -> None:
    build(rig, spec=PREFILL, deadline=-5.0)
    assert [t for _, _, t, _ in rig.hellos] == [0.05]


@pytest.mark.parametrize(("hosts", "wanted", "oserror"), [
    (["host-b"], True, False), ([None], True, False), ([HOST], False, False),
    ([HOST], True, True)])
def test_no_outbox_for_a_rank_elsewhere_or_when_none_can_be_made(
        rig: Rig, hosts: list, wanted: bool, oserror: bool) -> None:
    rig.outbox_wanted, rig.outbox_oserror = wanted, oserror
    rig.replies = {0: _side.Ok(engine_id="p", outbox=True)}
    conn = build(rig, spec=PREFILL, hosts=hosts)
    assert [m.outbox for _, m, _, _ in rig.hellos] == [None]
    assert rig.outboxes == [] and conn.link.outboxes == {}


@pytest.mark.parametrize(("reply", "shown"), [
    (_side.Error(message="go away"), "go away"),
    (_side.Ranks(ranks=[]), "Ranks(ranks=[])"),
    (_side.Layers(token=1, layers_ready=2, held=True),
     "Layers(token=1, layers_ready=2, held=True)"),
])
def test_a_refused_hello_fails_the_connect_closing_its_outbox_and_the_link(
        rig: Rig, reply: Any, shown: str) -> None:
    rig.outbox_wanted, rig.replies = True, {1: reply}
    with pytest.raises(SideChannelError) as e:
        build(rig, spec=MLA, remote=MLA, prefill_tp=2)
    assert str(e.value) == ("prefill rank 1 of engine 'p' refused this decode rank's hello: "
                            + shown)
    first, second = rig.outboxes
    assert (second.unlinked, second.closed) == (True, True)
    assert rig.log == [("link", 0, 0), ("outbox.close", first.name),
                       ("outbox.close", second.name), ("link.close", [])]


def test_an_ok_with_an_outbox_kept_then_a_refusal_closes_both(rig: Rig) -> None:
    rig.outbox_wanted = True
    rig.replies = {0: _side.Ok(engine_id="p", outbox=True), 1: _side.Error(message="no")}
    with pytest.raises(SideChannelError):
        build(rig, spec=MLA, remote=MLA, prefill_tp=2)
    first, second = rig.outboxes
    assert rig.log == [("link", 0, 0), ("outbox.close", second.name), ("link.close", [0]),
                       ("outbox.close", first.name)]


def test_a_hello_that_raises_closes_its_outbox_and_the_link(rig: Rig) -> None:
    rig.outbox_wanted = True
    rig.raises = {0: SideChannelError("prefill side channel at tcp://p0:1: timed out")}
    with pytest.raises(SideChannelError, match="timed out$"):
        build(rig, spec=PREFILL)
    (box,) = rig.outboxes
    assert rig.log == [("link", 0, 0), ("outbox.close", box.name), ("link.close", [])]
    assert not box.unlinked


def test_a_failed_hello_makes_no_plan_path_and_close_still_works(rig: Rig) -> None:
    rig.outbox_wanted, rig.replies = True, {0: _side.Error(message="no")}
    with pytest.raises(SideChannelError):
        build(rig, spec=PREFILL, cuda=True)
    assert [e[0] for e in rig.log] == ["link", "outbox.close", "link.close"]


def test_notify_after_a_path_that_notifies_with_its_read(rig: Rig) -> None:
    conn = build(rig, spec=MLA, remote=MLA, prefill_tp=2)
    assert conn.notify_after(SimpleNamespace(notifies_with_read=True)) == (1,)
    assert conn.notify_after(SimpleNamespace(notifies_with_read=False)) == (0, 1)


class FakeWatch:
    def __init__(self, rig: Rig, zctx: Any, entries: list, ranks: tuple, engine_id: str, *,
                 curve: Any, boards: dict) -> None:
        rig.log.append(("watch", ranks, engine_id, curve, boards))
        self.rig = rig

    def close(self) -> None:
        self.rig.log.append(("watch.close",))


@pytest.mark.parametrize(("knob", "boards"), [(None, {0: "view of fkv-board-0"}),
                                               ("1", {0: "view of fkv-board-0"}), ("0", {})])
def test_the_watch_is_made_once_with_the_boards_of_this_host_and_closed_with_the_connection(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, knob: str | None, boards: dict) -> None:
    """Prefill tp 2: rank 0's board opens, rank 1 has none; ``FKV_PUBLISH_BOARD=0``: none."""
    from fkv.connector.transport import _board, _stream

    if knob is not None:
        monkeypatch.setenv("FKV_PUBLISH_BOARD", knob)
    else:
        monkeypatch.delenv("FKV_PUBLISH_BOARD", raising=False)
    monkeypatch.setattr(_board, "open_board",
                        lambda info: None if info is None else f"view of {info.name}")
    monkeypatch.setattr(_stream, "Watch", lambda *a, **k: FakeWatch(rig, *a, **k))
    conn = build(rig, remote=PREFILL.evolve(num_kv_heads=1), prefill_tp=2, hosts=[HOST, None],
                 curve="the-curve")
    del rig.log[:]
    watch = conn.watch()
    assert conn.watch() is watch
    assert rig.log == [("watch", (0, 1), "p", "the-curve", boards)]
    del rig.log[:]
    conn.close()
    assert rig.log == [("watch.close",), ("link.close", [])] and conn._watch is None
    conn.close()
    assert rig.log == [("watch.close",), ("link.close", [])]


def test_the_watch_asks_only_the_ranks_read(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLA, prefill tp 2: rank 1 is only notified: no status requests to it, no board of it."""
    from fkv.connector.transport import _board, _stream

    monkeypatch.delenv("FKV_PUBLISH_BOARD", raising=False)
    monkeypatch.setattr(_board, "open_board",
                        lambda info: None if info is None else f"view of {info.name}")
    monkeypatch.setattr(_stream, "Watch", lambda *a, **k: FakeWatch(rig, *a, **k))
    conn = build(rig, spec=MLA, remote=MLA, prefill_tp=2)
    del rig.log[:]
    conn.watch()
    assert rig.log == [("watch", (0,), "p", None, {0: "view of fkv-board-0"})]


# -- _base: results, errors, defaults ----------------------------------------------------------

def test_a_read_result_defaults_to_no_error_no_path_and_no_layers() -> None:
    r = ReadResult(True, "req-1", 512, 2, 0.001)
    assert (r.ok, r.request_id, r.bytes, r.descriptors, r.seconds) == (True, "req-1", 512, 2,
                                                                       0.001)
    assert (r.error, r.transfer_seconds, r.strategy, r.pack_seconds, r.layer_seconds) == (
        None, 0.0, "", 0.0, ())
    assert Tally() == Tally(bytes=0, descriptors=0, transfer_seconds=0.0, pack_seconds=0.0)


def test_the_defaults_are_the_documented_ones() -> None:
    assert (_base.DEFAULT_LEASE, _base.DEFAULT_STAGING_BYTES, _base.DEFAULT_PACK_BYTES,
            _base.DEFAULT_PACK_THRESHOLD) == (120.0, 128 << 20, 256 << 20, 64)
    assert _base.STRATEGIES == ("auto", "ipc", "nixl", "packed", "direct", "staging")
    assert issubclass(TransferFailed, FkvError) and issubclass(SideChannelError, FkvError)
    e = HandshakeRejected("no", ("a", "b"))
    assert (str(e), e.reasons, isinstance(e, FkvError)) == ("no", ("a", "b"), True)


def test_check_engine_seconds_and_curve() -> None:
    engine = EngineDesc(engine_id="d", tp_size=1, tp_rank=0, total_num_kv_heads=2)
    assert _base.check_engine(engine) is engine
    with pytest.raises(FkvError) as e:
        _base.check_engine("d")
    assert str(e.value) == "'engine' must be an fkv.connector.EngineDesc (got 'str')"
    assert _base.check_seconds("timeout", 2) == 2.0 and type(_base.check_seconds("t", 2)) is float
    assert _base.check_seconds("timeout", 1e-9) == 1e-9
    for bad in (True, 0, -0.0, float("nan"), float("inf"), "1", None):
        with pytest.raises(FkvError, match=r"^'timeout' must be a finite positive number of "):
            _base.check_seconds("timeout", bad)
    assert _base.check_curve(None, client=True) is None


def test_check_curve_takes_curve_keys_and_a_client_needs_the_servers_key() -> None:
    from fkv.connector import CurveKeys, curve_keypair

    public, secret = curve_keypair()
    server = CurveKeys(public, secret)
    assert _base.check_curve(server, client=False) is server
    with pytest.raises(FkvError) as e:
        _base.check_curve(server, client=True)
    assert str(e.value) == ("'curve.server' must be the server's public key (Z85, 40 bytes) (got "
                            "None); pass CurveKeys(public, secret, server=<server public key>)")
    client = CurveKeys(public, secret, server=public)
    assert _base.check_curve(client, client=True) is client
    with pytest.raises(FkvError) as e:
        _base.check_curve((public, secret), client=False)
    assert str(e.value) == ("'curve' must be None (plain TCP) or an fkv.connector.CurveKeys (got "
                            "'tuple'); make keys with fkv.connector.curve_keypair()")


def test_spin_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in ((None, 0.0), ("", 0.0), ("abc", 0.0), ("-1", 0.0), ("0.25", 0.25)):
        if raw is None:
            monkeypatch.delenv("FKV_TRANSPORT_SPIN", raising=False)
        else:
            monkeypatch.setenv("FKV_TRANSPORT_SPIN", raw)
        assert _base.spin_seconds() == want, raw


def test_split_chunks_cuts_at_per_tokens_with_each_pieces_own_blocks() -> None:
    local, remote = np.arange(10), np.arange(100, 120)
    (whole,) = _base.split_chunks(local, remote, 8, 8, 4, 2)
    assert whole[0] is local and whole[1] is remote and whole[2] == 8
    pieces = _base.split_chunks(local, remote, 10, 4, 4, 2)
    assert [(a.tolist(), b.tolist(), n) for a, b, n in pieces] == [
        ([0], [100, 101], 4), ([1], [102, 103], 4), ([2], [104], 2)]
    # a last piece of 1 token: its one local block of 2 and one remote block of 4 tokens
    pieces = _base.split_chunks(local, remote, 9, 4, 2, 4)
    assert [(a.tolist(), b.tolist(), n) for a, b, n in pieces] == [
        ([0, 1], [100], 4), ([2, 3], [101], 4), ([4], [102], 1)]


def test_a_process_we_may_not_signal_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    def kill(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    assert _base.process_alive(1) is True


def test_load_nixl_turns_nixls_logging_down_unless_set_and_imports_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import nixl

    monkeypatch.setattr(_base, "_NIXL", None)
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)
    assert _base.load_nixl() is nixl and os.environ["NIXL_LOG_LEVEL"] == "WARN"
    assert _base._NIXL is nixl
    monkeypatch.setattr(_base, "_NIXL", None)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "DEBUG")
    assert _base.load_nixl() is nixl and os.environ["NIXL_LOG_LEVEL"] == "DEBUG"
    monkeypatch.setattr(_base, "_NIXL", "cached")
    assert _base.load_nixl() == "cached"


def test_process_alive() -> None:
    assert _base.process_alive(os.getpid())
    assert not _base.process_alive(1 << 62) and not _base.process_alive(-(1 << 70))
    child = os.fork()
    if child == 0:  # pragma: no cover - the child leaves at once
        os._exit(0)
    os.waitpid(child, 0)
    assert not _base.process_alive(child)


def test_tensor_memory_names_vram_with_its_gpu_dram_or_refuses() -> None:
    def on(device: str) -> Any:
        return SimpleNamespace(device=torch.device(device))

    assert _base.tensor_memory(on("cuda:3")) == ("VRAM", 3)
    assert _base.tensor_memory(on("cuda")) == ("VRAM", 0)
    assert _base.tensor_memory(on("cpu")) == ("DRAM", 0)
    with pytest.raises(FkvError) as e:
        _base.tensor_memory(on("meta"))
    assert str(e.value) == "'caches' must live on a CPU or CUDA device (got meta)"


def test_kernels_are_triton_on_cuda_or_under_the_interpreter_else_the_references(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import fkv.ops as ops
    from fkv.ops import reference

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = _base.kernels(torch.device("cpu"))
    assert (k.move, k.gather, k.scatter) == (ops.move, ops.gather, ops.scatter)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k = _base.kernels(torch.device("cpu"))
    assert (k.move, k.gather, k.scatter) == (reference.move, reference.gather, reference.scatter)
    assert reference.move is not ops.move
    k = _base.kernels(torch.device("cuda"))
    assert (k.move, k.gather, k.scatter) == (ops.move, ops.gather, ops.scatter)


def test_on_device_sets_the_gpu_and_waits_for_it_and_does_nothing_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log: list = []

    @contextlib.contextmanager
    def device(d: Any) -> Any:
        log.append(("enter", str(d)))
        yield
        log.append(("exit", str(d)))

    class Stream:
        def synchronize(self) -> None:
            log.append(("sync",))

    def current_stream(d: Any) -> Stream:
        log.append(("stream", str(d)))
        return Stream()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    with _base.on_device(torch.device("cpu")):
        log.append("body")
    assert log == ["body"]
    del log[:]
    with _base.on_device(torch.device("cuda:1")):
        log.append("body")
    assert log == [("enter", "cuda:1"), "body", ("stream", "cuda:1"), ("sync",),
                   ("exit", "cuda:1")]
    del log[:]
    with _base.on_device(torch.device("cuda:1"), sync=False):
        log.append("body")
    assert log == [("enter", "cuda:1"), "body", ("exit", "cuda:1")]


# -- cache_regions ---------------------------------------------------------------------------

def test_cache_regions_of_allocated_views_are_each_layers_bytes() -> None:
    caches = fkv.allocate(PREFILL)
    regions, mem, device_id, device = cache_regions(PREFILL, caches)
    assert regions == [(t.data_ptr(), PREFILL.region_bytes) for t in caches]
    assert (mem, device_id, device) == ("DRAM", 0, torch.device("cpu"))
    one = PREFILL.evolve(num_layers=1)
    single = fkv.allocate(one)[0]
    assert cache_regions(one, single)[0] == [(single.data_ptr(), one.region_bytes)]


def test_cache_regions_of_one_cross_layer_buffer_is_one_region() -> None:
    spec = PREFILL.evolve(cross_layer=True)
    caches = fkv.allocate(spec)
    assert cache_regions(spec, caches)[0] == [(caches[0].data_ptr(), spec.region_bytes)]
    with pytest.raises(FkvError) as e:
        cache_regions(spec, [caches[1], caches[0]])
    want = caches[1].data_ptr() + spec.layer_stride * spec.itemsize
    assert str(e.value) == (f"'caches[1]' must be layer 1 of one cross-layer buffer at "
                            f"0x{want:x} (got 'data at 0x{caches[0].data_ptr():x}')")
    # the layers of two buffers, each at its right place in its own: still refused
    other = fkv.allocate(spec)
    with pytest.raises(FkvError, match=r"^'caches\[1\]' must be layer 1 of one cross-layer"):
        cache_regions(spec, [caches[0], other[1]])


def test_cache_regions_refuses_what_is_not_the_specs_views_naming_it() -> None:
    caches = fkv.allocate(PREFILL)
    with pytest.raises(FkvError) as e:
        cache_regions("spec", caches)
    assert str(e.value) == "'spec' must be a KVCacheSpec (got 'spec')"
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, 5)
    assert str(e.value) == ("'caches' must be the list of per-layer views fkv.allocate(spec) "
                            "returns (got 'int')")
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, caches[:1])
    assert str(e.value) == ("'caches' must be 2 views (spec.num_layers) (got '1 views'); pass the "
                            "list fkv.allocate(spec, device) returns")
    with pytest.raises(FkvError, match=r"^'caches' must be 2 views \(spec.num_layers\) \(got "
                                       r"'3 views'\)"):
        cache_regions(PREFILL, [*caches, caches[0]])
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, [caches[0], [1, 2]])
    assert str(e.value) == "'caches[1]' must be a torch.Tensor (got 'list')"
    with pytest.raises(FkvError) as e:  # shape and dtype, but not a tensor
        cache_regions(PREFILL, [caches[0], np.zeros(PREFILL.logical_shape, np.float32)])
    assert str(e.value) == "'caches[1]' must be a torch.Tensor (got 'ndarray')"
    shape = PREFILL.logical_shape
    half = caches[1].to(torch.float16)
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, [caches[0], half])
    assert str(e.value) == (f"'caches[1]' must be shape {shape} dtype torch.bfloat16 (the spec's "
                            f"logical view) (got 'shape {shape} dtype torch.float16')")
    short = fkv.allocate(PREFILL.evolve(num_blocks=7))
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, [caches[0], short[1]])
    assert str(e.value).startswith(f"'caches[1]' must be shape {shape} dtype torch.bfloat16 ")
    nhd = fkv.allocate(NHD)
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, [caches[0], nhd[1]])
    assert str(e.value) == (f"'caches[1].stride()' must be {PREFILL.element_strides} (the HND "
                            f"layout of the spec) (got {nhd[1].stride()}); allocate caches with "
                            f"fkv.allocate(spec), or pass the spec fkv.infer_spec derives from "
                            f"them")
    meta = torch.empty_strided(shape, caches[1].stride(), dtype=torch.bfloat16, device="meta")
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, [caches[0], meta])
    assert str(e.value) == "'caches[1].device' must be cpu like caches[0] (got 'meta')"
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, [meta, meta])
    assert str(e.value) == "'caches' must live on a CPU or CUDA device (got meta)"


def test_cache_regions_ignores_the_stride_of_a_size_1_dim_only() -> None:
    """One KV head: the head dim's stride says nothing (NHD == HND); a size-2 dim's does."""
    one = PREFILL.evolve(num_kv_heads=1)
    nhd = fkv.allocate(one.evolve(layout="NHD"))
    assert cache_regions(one, nhd)[0] == [(t.data_ptr(), one.region_bytes) for t in nhd]


def test_cache_regions_refuses_a_view_whose_storage_ends_before_its_region() -> None:
    """Layer 1's storage shrunk by one element: its region's last bytes are not its own."""
    caches = fkv.allocate(PREFILL)
    full = caches[1].untyped_storage().nbytes()
    assert full == PREFILL.region_bytes
    caches[1].untyped_storage().resize_(full - 2)
    with pytest.raises(FkvError) as e:
        cache_regions(PREFILL, caches)
    assert str(e.value) == (f"'caches[1]' must be {PREFILL.region_bytes} bytes "
                            f"(spec.region_bytes) (got 'a view with {full - 2} bytes of "
                            f"storage')")


def test_cache_regions_counts_the_storage_after_the_views_offset() -> None:
    """A view starting one element into a storage of exactly region_bytes + 2 bytes fits; one
    starting two elements in does not."""
    spec = PREFILL.evolve(num_layers=1)
    n = spec.region_bytes // 2
    base = torch.empty(n + 1, dtype=torch.bfloat16)
    view = fkv.allocate(spec)[0]
    fits = base.as_strided(view.shape, view.stride(), 1)
    assert cache_regions(spec, [fits])[0] == [(fits.data_ptr(), spec.region_bytes)]
    base.untyped_storage().resize_(spec.region_bytes + 1)  # half an element short
    with pytest.raises(FkvError) as e:
        cache_regions(spec, [fits])
    assert str(e.value).endswith(f"(got 'a view with {spec.region_bytes - 1} bytes of storage')")
