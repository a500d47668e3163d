"""The NIXL agent wrapper (``_agent``) and a decode rank's link to one prefill engine (``_link``),
in one process: granule descriptor tables, the exact calls the wrapper makes into NIXL (a fake
recording them) and what it releases on every path, polling against a deadline, and the tables,
indices, registrations and errors of a :class:`Link` (a fake agent under it). One test moves
bytes between two real NIXL agents on DRAM."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

import fkv
from fkv.connector.handshake import EngineDesc, handshake
from fkv.connector.transport import _agent, _link, _metadata
from fkv.connector.transport._agent import Agent, Xfer, granule_table
from fkv.connector.transport._base import TransferFailed
from fkv.connector.wire import Peer
from fkv.errors import FkvError

pytestmark = pytest.mark.transport


# -- granule tables --------------------------------------------------------------------------------

def test_a_granule_table_cuts_each_region_into_granules_in_order() -> None:
    table = granule_table([(4096, 8192), (1 << 40, 4096)], 4096, device_id=3)
    assert table.dtype == np.uint64
    assert table.tolist() == [[4096, 4096, 3], [8192, 4096, 3], [1 << 40, 4096, 3]]
    assert granule_table([], 64, device_id=0).shape == (0, 3)


def test_a_granule_table_with_a_limit_samples_the_first_granules_of_every_region() -> None:
    regions = [(0, 4 * 64), (1 << 20, 2 * 64), (1 << 30, 4 * 64)]
    # limit 6 over 3 regions: 2 each, fewer where a region has fewer
    assert granule_table(regions, 64, device_id=1, limit=6).tolist() == [
        [0, 64, 1], [64, 64, 1], [1 << 20, 64, 1], [(1 << 20) + 64, 64, 1],
        [1 << 30, 64, 1], [(1 << 30) + 64, 64, 1]]
    assert granule_table(regions, 64, device_id=1, limit=9).tolist() == [
        [0, 64, 1], [64, 64, 1], [128, 64, 1], [1 << 20, 64, 1], [(1 << 20) + 64, 64, 1],
        [1 << 30, 64, 1], [(1 << 30) + 64, 64, 1], [(1 << 30) + 128, 64, 1]]
    # a limit below the region count still takes one of each
    assert granule_table(regions, 64, device_id=0, limit=1)[:, 0].tolist() == [0, 1 << 20, 1 << 30]


def test_a_granule_table_refuses_a_region_the_granule_does_not_divide() -> None:
    with pytest.raises(FkvError, match=r"^region of 200 bytes is not a multiple of the granule "
                                       r"64$"):
        granule_table([(0, 128), (4096, 200)], 64, device_id=0)


# -- the wrapper's calls into NIXL (a fake agent) --------------------------------------------------

class Handle:
    """A NIXL handle: its release is logged (``fail``: NIXL refuses to release it)."""

    def __init__(self, name: str, log: list, fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def release(self) -> None:
        self.log.append(("release", self.name))
        if self.fail:
            raise RuntimeError(f"{self.name} busy")

    def __repr__(self) -> str:
        return self.name


class FakeNixl:
    """NIXL's agent as ``Agent`` calls it: every call logged in order (handle releases too);
    ``fail`` names the methods that raise; ``states`` scripts what ``check_xfer_state`` says
    of each handle (the last one repeats)."""

    backends = {"UCX": object()}

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.log: list[tuple] = []
        self.fail = set(fail)
        self.states: dict[str, list[str]] = {}
        self.posted = "PROC"
        self.notifs: Any = {}
        self.made = 0

    def _call(self, name: str, *args: Any) -> None:
        self.log.append((name, *args))
        if name in self.fail:
            raise RuntimeError(f"{name} refused")

    def _handle(self, kind: str) -> Handle:
        self.made += 1
        return Handle(f"{kind}{self.made}", self.log, fail=f"release {kind}" in self.fail)

    def get_plugin_list(self) -> list[str]:
        return ["UCX"]

    def register_memory(self, descs: list, mem_type: str) -> Handle:
        self._call("register_memory", descs, mem_type)
        return self._handle("reg")

    def deregister_memory(self, reg: Any) -> None:
        self._call("deregister_memory", reg.name)

    def remove_remote_agent(self, name: str) -> None:
        self._call("remove_remote_agent", name)

    def prep_xfer_dlist(self, agent: str, table: np.ndarray, mem_type: str) -> Handle:
        self._call("prep_xfer_dlist", agent, table.tolist(), mem_type)
        return self._handle("dlist")

    def make_prepped_xfer(self, op: str, local: Any, local_idx: Any, remote: Any,
                          remote_idx: Any, notif: bytes) -> Handle:
        self._call("make_prepped_xfer", op, local, list(local_idx), remote, list(remote_idx),
                   notif)
        return self._handle("xfer")

    def get_xfer_descs(self, table: np.ndarray, mem_type: str) -> tuple:
        self._call("get_xfer_descs", table.tolist(), mem_type)
        return ("descs", mem_type)

    def initialize_xfer(self, op: str, local: Any, remote: Any, name: str,
                        notif: bytes) -> Handle:
        self._call("initialize_xfer", op, local, remote, name, notif)
        return self._handle("xfer")

    def transfer(self, handle: Handle) -> str:
        self._call("transfer", handle.name)
        return self.posted

    def check_xfer_state(self, handle: Handle) -> str:
        self._call("check_xfer_state", handle.name)
        states = self.states[handle.name]
        return states.pop(0) if len(states) > 1 else states[0]

    def get_xfer_telemetry(self, handle: Handle) -> Any:
        self._call("get_xfer_telemetry", handle.name)
        return type("Telemetry", (), {"descCount": np.int64(7)})()

    def get_new_notifs(self) -> Any:
        self._call("get_new_notifs")
        if isinstance(self.notifs, Exception):
            raise self.notifs
        return self.notifs

    def send_notif(self, remote: str, message: bytes) -> None:
        self._call("send_notif", remote, message)


def _wrapped(monkeypatch: pytest.MonkeyPatch, nixl: FakeNixl, progress: str = "0") -> Agent:
    """An :class:`Agent` made by its own ``__init__`` around ``nixl``."""
    monkeypatch.setattr(_agent, "_make_agent", lambda *a: nixl)
    monkeypatch.delenv("FKV_NIXL_PROGRESS_DELAY_US", raising=False)
    return Agent("decode", progress_thread=progress)


def test_an_agent_is_made_with_the_progress_it_was_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple] = []

    def make(nixl: Any, name: str, mode: str, delay_us: int, telemetry: bool,
             num_threads: int) -> FakeNixl:
        made.append((name, mode, delay_us, telemetry, num_threads))
        return FakeNixl()

    monkeypatch.setattr(_agent, "_make_agent", make)
    monkeypatch.setenv("FKV_NIXL_PROGRESS_DELAY_US", "250")
    monkeypatch.setenv("FKV_NIXL_NUM_THREADS", "3")
    agent = Agent("decode", progress_thread=True, telemetry=True)
    assert agent.progress == "poll(250 us)" and agent.name.startswith("fkv-decode-")
    assert made == [(agent.name, "poll", 250, True, 3)]
    assert Agent("decode", progress_thread=False, num_threads=0).progress == "off"
    monkeypatch.setenv("FKV_NIXL_PROGRESS_DELAY_US", "10000000")  # the largest delay taken
    assert _agent.progress_mode(True) == ("poll", 10_000_000)


def test_an_agent_that_nixl_cannot_make_or_that_has_no_ucx_is_a_transfer_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any) -> None:
        raise RuntimeError("no plugins")

    monkeypatch.setattr(_agent, "_make_agent", refuse)
    with pytest.raises(TransferFailed, match=r"^could not create a NIXL agent with the UCX "
                                             r"backend: RuntimeError: no plugins$"):
        Agent("decode", progress_thread=False)
    nixl = FakeNixl()
    nixl.backends = {}
    monkeypatch.setattr(_agent, "_make_agent", lambda *a: nixl)
    with pytest.raises(TransferFailed, match=r"^NIXL has no UCX backend here \(plugins: "
                                             r"\['UCX'\]\); fkv transfers need UCX$"):
        Agent("decode", progress_thread=False)


def test_register_passes_every_region_with_its_device_and_deregister_undoes_it_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    assert agent.register([], "DRAM", 0) is None and nixl.log == []
    reg = agent.register([(np.int64(4096), np.uint64(8192)), (65536, 128)], "VRAM", 3)
    assert nixl.log == [("register_memory", [(4096, 8192, 3, ""), (65536, 128, 3, "")], "VRAM")]
    assert all(type(v) is int for d in nixl.log[0][1] for v in d[:3])
    agent.deregister(None)
    agent.deregister(Handle("reg-unknown", []))
    agent.deregister(reg)
    agent.deregister(reg)  # once only
    agent.close()
    assert nixl.log[1:] == [("deregister_memory", "reg1")]


def test_a_refused_registration_or_deregistration(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl(fail=("register_memory",))
    agent = _wrapped(monkeypatch, nixl)
    with pytest.raises(TransferFailed, match=r"^NIXL could not register 2 DRAM region\(s\): "
                                             r"RuntimeError: register_memory refused$"):
        agent.register([(0, 64), (64, 64)], "DRAM", 0)
    assert agent._registered == []
    nixl.fail = {"deregister_memory"}
    reg = agent.register([(0, 64)], "DRAM", 0)
    agent.deregister(reg)  # NIXL's refusal is swallowed, the handle forgotten
    agent.close()
    assert [c[0] for c in nixl.log] == ["register_memory", "register_memory", "deregister_memory"]


def test_a_handle_nixl_cannot_release_keeps_memory_registered_until_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ handle NIXL refuses to release (in flight on a dead connection) is kept and retried
    at close; until then a deregister keeps the memory registered and its owner referenced."""
    nixl = FakeNixl(fail=("release xfer",))
    agent = _wrapped(monkeypatch, nixl)
    reg = agent.register([(0, 4096)], "DRAM", 0)
    dlist = agent.prep(None, granule_table([(0, 4096)], 1024, device_id=0), "DRAM")
    monkeypatch.setattr(_metadata, "add_remote_checked", lambda *a, **k: "peer")
    assert agent.add_remote(b"blob") == "peer"
    xfer = agent.read(dlist, np.array([0]), dlist, np.array([1]), "peer", 1024)
    agent.release(xfer)
    owner = object()
    agent.deregister(reg, keep=owner)
    assert agent._kept == [owner]
    del nixl.log[:]
    agent.close()
    assert nixl.log == [("release", "xfer3"), ("release", "dlist2"),
                        ("remove_remote_agent", "peer"), ("deregister_memory", "reg1")]
    assert agent._kept == [] and agent._leaked == [] and agent._agent is None
    agent.close()  # idempotent
    assert len(nixl.log) == 4


def test_close_goes_on_past_handles_and_peers_nixl_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl(fail=("release dlist", "remove_remote_agent", "deregister_memory"))
    agent = _wrapped(monkeypatch, nixl)
    monkeypatch.setattr(_metadata, "add_remote_checked", lambda *a, **k: "peer")
    agent.register([(0, 64)], "DRAM", 0)
    agent.register([(64, 64)], "DRAM", 0)
    agent.prep(None, granule_table([(0, 64)], 64, device_id=0), "DRAM")
    agent.prep(None, granule_table([(64, 64)], 64, device_id=0), "DRAM")
    agent.add_remote(b"blob")
    del nixl.log[:]
    agent.close()
    assert nixl.log == [("release", "dlist3"), ("release", "dlist4"),
                        ("remove_remote_agent", "peer"),
                        ("deregister_memory", "reg1"), ("deregister_memory", "reg2")]
    assert agent._agent is None


def test_remove_remote_removes_only_an_added_peer_and_only_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    seen: list[tuple] = []

    def add(nixl_agent: Any, blob: bytes, *, timeout: float, prep: Any) -> str:
        seen.append((nixl_agent, blob, timeout, prep))
        return "peer"

    monkeypatch.setattr(_metadata, "add_remote_checked", add)
    assert agent.add_remote(b"blob", timeout=3.0, prep=("DRAM", "table")) == "peer"
    assert seen == [(nixl, b"blob", 3.0, ("DRAM", "table"))]
    agent.remove_remote("other")
    agent.remove_remote("peer")
    agent.remove_remote("peer")
    nixl.fail = {"remove_remote_agent"}
    agent.add_remote(b"blob")
    agent.remove_remote("peer")  # NIXL's refusal is swallowed, the peer forgotten
    agent.close()
    assert nixl.log == [("remove_remote_agent", "peer"), ("remove_remote_agent", "peer")]


def test_prep_names_local_memory_or_the_remote_and_release_dlist_releases_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    table = granule_table([(4096, 128)], 64, device_id=2)
    mine = agent.prep(None, table, "DRAM")
    theirs = agent.prep("peer", table, "VRAM")
    assert nixl.log == [("prep_xfer_dlist", "NIXL_INIT_AGENT", table.tolist(), "DRAM"),
                        ("prep_xfer_dlist", "peer", table.tolist(), "VRAM")]
    agent.release_dlist(theirs)
    agent.release_dlist(theirs)
    agent.release_dlist(Handle("dlist-unknown", nixl.log))
    agent.close()
    assert nixl.log[2:] == [("release", "dlist2"), ("release", "dlist1")]
    assert mine.name == "dlist1"
    nixl = FakeNixl(fail=("prep_xfer_dlist",))
    agent = _wrapped(monkeypatch, nixl)
    with pytest.raises(TransferFailed, match=r"^NIXL could not prepare 2 descriptors of local "
                                             r"memory: RuntimeError: prep_xfer_dlist refused$"):
        agent.prep(None, table, "DRAM")
    with pytest.raises(TransferFailed, match=r"^NIXL could not prepare 2 descriptors of remote "
                                             r"agent 'peer': RuntimeError: prep_xfer_dlist "
                                             r"refused$"):
        agent.prep("peer", table, "DRAM")
    assert agent._dlists == []


def test_a_read_is_created_with_its_notification_then_posted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    xfer = agent.read("L", np.array([4, 5]), "R", np.array([9, 1]), "peer", 2048, notif=b"done")
    assert nixl.log == [("make_prepped_xfer", "READ", "L", [4, 5], "R", [9, 1], b"done"),
                        ("transfer", "xfer1")]
    assert (xfer.handle.name, xfer.remote, xfer.nbytes, xfer.state) == ("xfer1", "peer", 2048,
                                                                       "PROC")
    handle = agent.create_read("L", np.array([0]), "R", np.array([3]), "peer")
    assert nixl.log[2] == ("make_prepped_xfer", "READ", "L", [0], "R", [3], b"")
    nixl.posted = "DONE"
    posted = agent.post(handle, "peer", 512)
    assert (posted.handle, posted.nbytes, posted.state) == (handle, 512, "DONE")
    assert agent.poll(posted) == "DONE" and nixl.log[-1] == ("transfer", "xfer2")
    agent.discard(agent.create_read("L", np.array([0]), "R", np.array([3]), "peer"))
    assert nixl.log[-1] == ("release", "xfer3")
    nixl.fail = {"make_prepped_xfer"}
    with pytest.raises(TransferFailed, match=r"^could not create a READ from 'peer': "
                                             r"RuntimeError: make_prepped_xfer refused$"):
        agent.create_read("L", np.array([0]), "R", np.array([3]), "peer")


def test_a_post_nixl_refuses_releases_the_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl(fail=("transfer",))
    agent = _wrapped(monkeypatch, nixl)
    with pytest.raises(TransferFailed, match=r"^could not post a READ from 'peer': RuntimeError: "
                                             r"transfer refused$"):
        agent.read("L", np.array([0]), "R", np.array([1]), "peer", 64)
    assert [c[0] for c in nixl.log] == ["make_prepped_xfer", "transfer", "release"]
    with pytest.raises(TransferFailed, match=r"^could not post a READ from 'peer'"):
        agent.read_descs(np.zeros((1, 3), np.uint64), "DRAM", np.ones((1, 3), np.uint64),
                         "VRAM", "peer", 64)
    assert nixl.log[-1] == ("release", "xfer2")


def test_read_descs_builds_both_sides_from_their_tables_and_memory_types(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    mine = np.array([[4096, 64, 0], [8192, 32, 0]], dtype=np.uint64)
    theirs = np.array([[1 << 33, 64, 5], [(1 << 33) + 64, 32, 5]], dtype=np.uint64)
    xfer = agent.read_descs(mine, "DRAM", theirs, "VRAM", "peer", 96, b"n")
    assert nixl.log == [("get_xfer_descs", mine.tolist(), "DRAM"),
                        ("get_xfer_descs", theirs.tolist(), "VRAM"),
                        ("initialize_xfer", "READ", ("descs", "DRAM"), ("descs", "VRAM"), "peer",
                         b"n"),
                        ("transfer", "xfer1")]
    assert (xfer.remote, xfer.nbytes) == ("peer", 96)
    nixl.fail = {"initialize_xfer"}
    with pytest.raises(TransferFailed, match=r"^could not create a READ of 2 descriptor\(s\) from "
                                             r"'peer': RuntimeError: initialize_xfer refused$"):
        agent.read_descs(mine, "DRAM", theirs, "VRAM", "peer", 96)


def _posted(agent: Agent, nixl: FakeNixl, *states: list[str]) -> list[Xfer]:
    """One posted READ per ``states`` (what NIXL says of it poll after poll)."""
    xfers = []
    for s in states:
        xfer = agent.read("L", np.array([0]), "R", np.array([0]), f"p{len(xfers)}", 64)
        nixl.states[xfer.handle.name] = list(s)
        xfers.append(xfer)
    del nixl.log[:]
    return xfers


def _polls(nixl: FakeNixl) -> list[str]:
    return [c[1] for c in nixl.log if c[0] == "check_xfer_state"]


def test_wait_polls_until_every_read_is_done_and_stops_polling_the_done_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    a, b = _posted(agent, nixl, ["DONE"], ["PROC", "PROC", "DONE"])
    assert agent.wait([a, b], time.monotonic() + 60) is None
    assert _polls(nixl) == ["xfer1", "xfer2", "xfer2", "xfer2"]
    assert (a.state, b.state) == ("DONE", "DONE")
    assert agent.wait([], time.monotonic() - 1) is None


def test_wait_returns_the_first_failed_read_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    a, b, c = _posted(agent, nixl, ["PROC"], ["ERR"], ["ERR"])
    assert agent.wait([a, b, c], time.monotonic() + 5) is b
    assert (a.state, b.state, c.state) == ("PROC", "ERR", "ERR")
    assert _polls(nixl) == ["xfer1", "xfer2", "xfer3"]
    assert agent.poll(b) == "ERR" and len(_polls(nixl)) == 3  # a final state is not asked again


def test_an_exception_from_nixl_while_polling_is_err(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl(fail=("check_xfer_state",))
    agent = _wrapped(monkeypatch, nixl)
    (a,) = _posted(agent, nixl, ["PROC"])
    assert agent.wait([a], time.monotonic() + 5) is a and a.state == "ERR"


def test_wait_past_its_deadline_returns_the_first_unfinished_read_after_one_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    a, b, c = _posted(agent, nixl, ["DONE"], ["PROC"], ["PROC"])
    assert agent.wait([a, b, c], time.monotonic()) is b
    assert b.state == "PROC" and _polls(nixl) == ["xfer1", "xfer2", "xfer3"]
    # a read that is DONE at its first poll is done even with the deadline passed
    (d,) = _posted(agent, nixl, ["DONE"])
    assert agent.wait([d], time.monotonic() - 10) is None


def test_telemetry_is_nixls_descriptor_count_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    (a,) = _posted(agent, nixl, ["DONE"])
    count = agent.telemetry(a)
    assert count == 7 and type(count) is int
    nixl.fail = {"get_xfer_telemetry"}
    assert agent.telemetry(a) is None


def test_notifications_come_one_per_message_and_an_undecodable_batch_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl)
    nixl.notifs = {"a": [b"x", bytearray(b"y")], "b": [b"z"]}
    got = agent.notifications()
    assert got == [("a", b"x"), ("a", b"y"), ("b", b"z")] and type(got[1][1]) is bytes
    nixl.notifs = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    with pytest.raises(_agent.UndecodableNotifications,
                       match=r"^a batch of NIXL notifications had a sender name that is not "
                             r"UTF-8 \(.*invalid start byte\); the batch was dropped$"):
        agent.notifications()


@pytest.mark.parametrize(("progress", "drained"), [("0", True), ("1", False), ("spin", False)])
def test_notify_sends_and_drains_notifications_only_without_a_progress_thread(
        monkeypatch: pytest.MonkeyPatch, progress: str, drained: bool) -> None:
    nixl = FakeNixl()
    agent = _wrapped(monkeypatch, nixl, progress)
    agent.notify("peer", b"m")
    assert nixl.log == [("send_notif", "peer", b"m")] + ([("get_new_notifs",)] if drained else [])
    for failure in (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), RuntimeError("gone")):
        nixl.notifs = failure  # whatever comes in while draining, the send succeeded
        agent.notify("peer", b"m")
    nixl.fail = {"send_notif"}
    del nixl.log[:]
    with pytest.raises(TransferFailed, match=r"^could not notify 'peer': RuntimeError: "
                                             r"send_notif refused$"):
        agent.notify("peer", b"m")
    assert nixl.log == [("send_notif", "peer", b"m")]


# -- two real NIXL agents on DRAM, one process -----------------------------------------------------

def test_two_real_agents_read_granules_and_descriptor_tables_and_notify() -> None:
    prefill = Agent("prefill", progress_thread="poll")
    decode = Agent("decode", progress_thread=False)
    try:
        src = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:512].clone()
        dst = torch.zeros(512, dtype=torch.uint8)
        prefill.register([(src.data_ptr(), 512)], "DRAM", 0)
        reg = decode.register([(dst.data_ptr(), 512)], "DRAM", 0)
        name = decode.add_remote(prefill.metadata())
        mine = decode.prep(None, granule_table([(dst.data_ptr(), 512)], 64, device_id=0), "DRAM")
        theirs = decode.prep(name, granule_table([(src.data_ptr(), 512)], 64, device_id=0),
                             "DRAM")
        xfer = decode.read(mine, np.array([0, 1, 7]), theirs, np.array([5, 6, 0]), name, 192,
                           b"granules")
        assert decode.wait([xfer], time.monotonic() + 30) is None
        decode.release(xfer)
        want = torch.zeros(512, dtype=torch.uint8)
        want[0:128], want[448:512] = src[320:448], src[0:64]
        assert torch.equal(dst, want)
        xfer = decode.read_descs(np.array([[dst.data_ptr() + 200, 24, 0]], dtype=np.uint64),
                                 "DRAM",
                                 np.array([[src.data_ptr() + 100, 24, 0]], dtype=np.uint64),
                                 "DRAM", name, 24, b"descs")
        assert decode.wait([xfer], time.monotonic() + 30) is None
        decode.release(xfer)
        want[200:224] = src[100:124]
        assert torch.equal(dst, want)
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            got += prefill.notifications()
            time.sleep(0.01)
        assert got == [(decode.name, b"granules"), (decode.name, b"descs")]
        decode.deregister(reg, keep=dst)
        assert decode._leaked == [] and decode._kept == []
    finally:
        decode.close()
        prefill.close()
    assert (decode._registered, decode._dlists, decode._remotes) == ([], [], set())


# -- a decode rank's link (a fake agent) -----------------------------------------------------------

#: Prefill TP 4 with one KV head each, a decode rank of both heads: it reads P0 and P2 (staging)
#: and only notifies P1 and P3.
REMOTE = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=1, head_size=8,
                         num_layers=2)
LOCAL = REMOTE.evolve(num_kv_heads=2)
GRANULE = 128  # gcd of region sizes, block strides, sample rows


class LinkAgent:
    """An ``Agent`` as a :class:`Link` calls it: calls logged in order, tables as lists."""

    def __init__(self, progress: str = "off") -> None:
        self.progress = progress
        self.log: list[tuple] = []
        self.stuck: tuple[int, str] | None = None  # (index, state) of the READ wait returns
        self.fail_prep: str | None = None  # a remote name whose prep fails
        self.made = 0

    def _name(self, kind: str) -> str:
        self.made += 1
        return f"{kind}{self.made}"

    def add_remote(self, metadata: bytes, *, timeout: float, prep: Any) -> str:
        self.log.append(("add_remote", metadata, None if prep is None else
                         (prep[0], prep[1].tolist())))
        return "agent-" + metadata.decode()

    def remove_remote(self, name: str) -> None:
        self.log.append(("remove_remote", name))

    def register(self, regions: list, mem_type: str, device_id: int) -> str:
        self.log.append(("register", regions, mem_type, device_id))
        return self._name("reg")

    def deregister(self, reg: Any, keep: Any = None) -> None:
        self.log.append(("deregister", reg, keep))

    def prep(self, remote: str | None, table: np.ndarray, mem_type: str) -> str:
        self.log.append(("prep", remote, table.tolist(), mem_type))
        if remote is not None and remote == self.fail_prep:
            raise TransferFailed(f"NIXL could not prepare descriptors of {remote!r}")
        return self._name("dlist")

    def release_dlist(self, handle: Any) -> None:
        self.log.append(("release_dlist", handle))

    def read_descs(self, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str,
                   remote_name: str, nbytes: int, notif: bytes = b"") -> Xfer:
        self.log.append(("read_descs", local.tolist(), local_mem, remote.tolist(), remote_mem,
                         remote_name, nbytes))
        return Xfer(self._name("xfer"), remote_name, nbytes)

    def wait(self, xfers: list[Xfer], deadline: float, spin: float = 0.0) -> Xfer | None:
        self.log.append(("wait", [x.handle for x in xfers], spin))
        if self.stuck is None:
            return None
        index, xfers[index].state = self.stuck
        return xfers[index]

    def release(self, xfer: Xfer) -> None:
        self.log.append(("release", xfer.handle))

    def notify(self, remote: str, message: bytes) -> None:
        self.log.append(("notify", remote, message))


class Verdict:
    """``check_each``'s verdict on one peer's metadata: which regions it registers."""

    def __init__(self, missing: tuple[int, ...] = ()) -> None:
        self.missing = missing

    def covers(self, base: int, nbytes: int, mem_type: str) -> bool:
        return base not in self.missing


def _base(rank: int, region: int) -> int:
    return ((rank + 1) << 32) + region * (1 << 20)


def _peers(small_first_region: bool = False) -> list[Peer]:
    """Prefill ranks 0..3 with device ids 10..13, regions at distinct bases."""
    return [Peer(engine=EngineDesc(engine_id="p", tp_size=4, tp_rank=r, total_num_kv_heads=2),
                 spec=REMOTE, regions=tuple((_base(r, i), REMOTE.region_bytes)
                                            for i in range(REMOTE.num_regions)),
                 device_id=10 + r, agent_metadata=f"p{r}".encode()) for r in range(4)]


class Entry:
    def __init__(self, mem_type: str) -> None:
        self.mem_type = mem_type


def _plan() -> Any:
    return handshake((EngineDesc(engine_id="d", tp_size=1, tp_rank=0, total_num_kv_heads=2),
                      LOCAL), (EngineDesc(engine_id="p", tp_size=4, tp_rank=0,
                                          total_num_kv_heads=2), REMOTE)).plan


LOCAL_REGIONS = [(1 << 24, LOCAL.region_bytes), ((1 << 24) + (1 << 20), LOCAL.region_bytes)]


def _local(agent: LinkAgent) -> _link.Local:
    return _link.Local(engine=EngineDesc(engine_id="d", tp_size=1, tp_rank=0,
                                         total_num_kv_heads=2),
                       spec=LOCAL, views=[], regions=list(LOCAL_REGIONS), mem_type="DRAM",
                       device_id=0, device=torch.device("cpu"), agent=agent, zctx=None,
                       strategy="auto", staging_bytes_max=1 << 20, pack_threshold=0)


def _make_link(monkeypatch: pytest.MonkeyPatch, agent: LinkAgent, *, verdicts: Any = None,
          staging_blocks: int = 2, extra_staging: int = 4096, peers: Any = None,
          prep_rows: list | None = None, local: Any = None) -> _link.Link:
    """A :class:`Link` over ``agent`` (``check_each`` faked: ``verdicts`` per checked rank);
    ``prep_rows`` collects the probe's preps."""
    def check_each(blobs: list, *, timeout: float, preps: list) -> list:
        if prep_rows is not None:
            prep_rows.extend(None if p is None else (p[0], p[1].tolist()) for p in preps)
        return list(verdicts) if verdicts is not None else [Verdict() for _ in blobs]

    monkeypatch.setattr(_metadata, "check_each", check_each)
    plan = _plan()
    assert (plan.remote_ranks, plan.notify_only_ranks, plan.strategy) == ((0, 2), (1, 3),
                                                                           "staging")
    local = local or _local(agent)
    path_bytes = plan.staging_bytes(staging_blocks)
    return _link.Link(local, plan, peers or _peers(), [Entry(m) for m in ("VRAM",) * 4],
                      staging_path_bytes=path_bytes, staging_bytes=path_bytes + extra_staging,
                      deadline=time.monotonic() + 30)


def _table(regions: Any, granule: int, device_id: int) -> list:
    return [[base + k * granule, granule, device_id]
            for base, nbytes in regions for k in range(nbytes // granule)]


def _remote_regions(rank: int) -> list:
    return [(_base(rank, i), REMOTE.region_bytes) for i in range(REMOTE.num_regions)]


def test_a_link_adds_every_rank_registers_the_staging_buffer_and_prepares_every_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    preps: list = []
    monkeypatch.setattr(_link, "_PROBE_ROWS", 4)  # the probe prepares 2 rows of each region
    link = _make_link(monkeypatch, agent, prep_rows=preps)
    plan = link.plan
    path_bytes = plan.staging_bytes(2)
    assert path_bytes == 1024 and link.staging.numel() == path_bytes + 4096
    assert link.granule == GRANULE and link.local.tainted
    assert (link.local_per_region, link.staging_base, link.remote_per_region) == (16, 32, 8)
    probe = {r: ("VRAM", [row for base, n in _remote_regions(r)
                          for row in _table([(base, 2 * GRANULE)], GRANULE, 10 + r)])
             for r in (0, 2)}
    assert preps == [probe[0], probe[2], None, None]
    staging = link.staging.data_ptr()
    local_table = _table([*LOCAL_REGIONS, (staging, path_bytes)], GRANULE, 0)
    assert agent.log == [
        ("add_remote", b"p0", probe[0]), ("add_remote", b"p2", probe[2]),
        ("add_remote", b"p1", None), ("add_remote", b"p3", None),
        ("register", [(staging, path_bytes + 4096)], "DRAM", 0),
        ("prep", None, local_table, "DRAM"),
        ("prep", "agent-p0", _table(_remote_regions(0), GRANULE, 10), "VRAM"),
        ("prep", "agent-p2", _table(_remote_regions(2), GRANULE, 12), "VRAM")]
    assert link.names == {0: "agent-p0", 2: "agent-p2", 1: "agent-p1", 3: "agent-p3"}
    assert (link.local_dlist, link.remote_dlists) == ("dlist2", {0: "dlist3", 2: "dlist4"})
    staging_tensor = link.staging
    del agent.log[:]
    box = Box(True)
    link.outboxes[1] = box
    link.close()
    assert agent.log == [("release_dlist", "dlist2"), ("release_dlist", "dlist3"),
                         ("release_dlist", "dlist4"), ("remove_remote", "agent-p0"),
                         ("remove_remote", "agent-p2"), ("remove_remote", "agent-p1"),
                         ("remove_remote", "agent-p3"), ("deregister", "reg1", staging_tensor)]
    assert box.closed and link.outboxes == {} and link.names == {}
    assert link.staging is None and link._staging_reg is None and link.local_dlist is None


def test_a_link_without_a_progress_thread_reads_from_each_notify_only_rank_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="off")
    link = _make_link(monkeypatch, agent)
    scratch = agent.log[8][1][0][0]
    assert agent.log[8:] == [
        ("register", [(scratch, 64)], "DRAM", 0),
        ("read_descs", [[scratch, 64, 0]], "DRAM", [[_base(1, 0), 64, 11]], "VRAM", "agent-p1",
         64),
        ("wait", ["xfer6"], 0.0), ("release", "xfer6"),
        ("read_descs", [[scratch, 64, 0]], "DRAM", [[_base(3, 0), 64, 13]], "VRAM", "agent-p3",
         64),
        ("wait", ["xfer7"], 0.0), ("release", "xfer7"),
        ("deregister", "reg5", agent.log[-1][2])]
    assert isinstance(agent.log[-1][2], torch.Tensor) and agent.log[-1][2].data_ptr() == scratch
    link.close()


def test_wire_up_reads_no_more_than_a_small_first_region(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent)
    peers = list(link.peers)
    peers[1] = Peer(engine=peers[1].engine, spec=REMOTE, regions=((1 << 40, 48),), device_id=11)
    link.peers = tuple(peers)
    del agent.log[:]
    link.wire_up([1], time.monotonic() + 30)
    scratch = agent.log[0][1][0][0]
    assert agent.log[1] == ("read_descs", [[scratch, 48, 0]], "DRAM", [[1 << 40, 48, 11]],
                            "VRAM", "agent-p1", 48)


def test_a_wire_up_read_that_fails_names_the_rank_and_releases_everything(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent)
    del agent.log[:]
    agent.stuck = (0, "ERR")
    with pytest.raises(TransferFailed, match=r"^READ from prefill rank 3 of engine 'p' "
                                             r"\(agent-p3\) failed \(NIXL state ERR\)"):
        link.wire_up([3, 1], time.monotonic() + 30)
    assert [c[0] for c in agent.log] == ["register", "read_descs", "wait", "release",
                                         "deregister"]
    assert agent.log[3] == ("release", "xfer6") and agent.log[4][1] == "reg5"
    assert isinstance(agent.log[4][2], torch.Tensor)


def test_wait_reads_names_the_prefill_rank_of_the_read_that_failed_or_hung() -> None:
    agent = LinkAgent()
    xfers = [Xfer("x0", "agent-p0", 64), Xfer("x1", "agent-p2", 64)]
    _link.wait_reads(agent, xfers, [0, 2], "p", time.monotonic() + 30, spin=0.25)
    assert agent.log == [("wait", ["x0", "x1"], 0.25)]
    for state, why in (("ERR", "failed (NIXL state ERR): the prefill process may have died: "
                                "reconnect once it is back (client.reconnect())"),
                       ("PROC", "did not finish before the read's timeout: the prefill process "
                                "is hung, dead or unreachable")):
        agent.stuck = (1, state)
        with pytest.raises(TransferFailed) as e:
            _link.wait_reads(agent, xfers, [0, 2], "p", time.monotonic() + 30)
        assert str(e.value) == f"READ from prefill rank 2 of engine 'p' (agent-p2) {why}"


def test_a_peer_whose_metadata_fails_its_check_fails_the_link_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent()
    with pytest.raises(FkvError, match=r"^prefill rank 1 of engine 'p': corrupt blob$"):
        _make_link(monkeypatch, agent, verdicts=[Verdict(), Verdict(), FkvError("corrupt blob"),
                                            Verdict()])
    assert agent.log == [("deregister", None, None)]  # no staging buffer yet: nothing to undo
    missing = _base(2, 1)
    with pytest.raises(FkvError) as e:
        _make_link(monkeypatch, agent, verdicts=[Verdict(), Verdict((missing,)), Verdict(),
                                            Verdict()])
    assert str(e.value) == (f"prefill rank 2 of engine 'p' announced region 1 at 0x{missing:x} "
                            f"(+1024 B, VRAM) that its NIXL metadata does not register; refusing "
                            f"to read from it")
    # a notify-only rank's regions are never read as a cache: not checked
    _make_link(monkeypatch, agent, verdicts=[Verdict(), Verdict(), Verdict((_base(1, 0),)),
                                        Verdict()]).close()


def test_a_link_that_fails_part_way_releases_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    agent.fail_prep = "agent-p2"
    with pytest.raises(TransferFailed, match="'agent-p2'"):
        _make_link(monkeypatch, agent)
    kinds = [c for c in agent.log if c[0] in ("release_dlist", "remove_remote", "deregister")]
    assert [c[:2] for c in kinds] == [
        ("release_dlist", "dlist2"), ("release_dlist", "dlist3"),
        ("remove_remote", "agent-p0"), ("remove_remote", "agent-p2"),
        ("remove_remote", "agent-p1"), ("remove_remote", "agent-p3"), ("deregister", "reg1")]
    assert isinstance(kinds[-1][2], torch.Tensor)


def test_indices_of_staging_and_cache_rows_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    link = _make_link(monkeypatch, LinkAgent(progress="poll(1000 us)"))
    rows = link.plan.segments([1, 2], [3, 5])
    assert rows[:4].tolist() == [[0, 0, 384, -1, 0, 128], [0, 0, 640, -1, 128, 128],
                                 [0, 1, 384, -1, 256, 128], [0, 1, 640, -1, 384, 128]]
    local, remote = link.indices(rows[:4])
    assert (local.tolist(), remote.tolist()) == ([32, 33, 34, 35], [3, 5, 11, 13])
    # rows into the cache (region >= 0), runs of two granules
    cache = np.array([[0, 0, 256, 0, 512, 256], [0, 1, 0, 1, 1792, 256]])
    local, remote = link.indices(cache)
    assert (local.tolist(), remote.tolist()) == ([4, 5, 30, 31], [2, 3, 8, 9])


def test_ensure_granule_prepares_again_with_the_finer_granule_every_row_needs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent)
    del agent.log[:]
    link.ensure_granule(np.empty((0, 6), dtype=np.int64))
    link.ensure_granule(np.array([[0, 0, 384, -1, 0, 128], [0, 1, 0, 0, 1920, 128]]))
    assert agent.log == [] and link.granule == GRANULE
    for row, granule in (([0, 0, 192, -1, 0, 192], 64),     # the rows' own gcd is coarser
                         ([0, 0, 384, -1, 32, 128], 32),     # a local offset
                         ([0, 0, 16, -1, 0, 64], 16),        # a remote offset
                         ([0, 0, 0, -1, 0, 24], 8)):         # a size
        del agent.log[:]
        old = (link.local_dlist, *link.remote_dlists.values())
        link.ensure_granule(np.array([row]))
        assert link.granule == granule
        assert [c[0] for c in agent.log].count("prep") == 3
        assert [c for c in agent.log if c[0] == "release_dlist"] == [("release_dlist", h)
                                                                     for h in old]
        preps = [c for c in agent.log if c[0] == "prep"]
        assert preps[2] == ("prep", "agent-p2", _table(_remote_regions(2), granule, 12), "VRAM")
        assert link.remote_per_region == 1024 // granule
        assert link.local_per_region == 2048 // granule
        assert link.staging_base == 2 * 2048 // granule


def test_ensure_granule_on_a_granule_that_is_not_a_power_of_two(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent, peers=None)
    link._prep(64)
    link.granule = 96  # as if regions and rows were multiples of 96 (the tables don't matter)
    del agent.log[:]
    link.ensure_granule(np.array([[0, 0, 192, -1, 96, 288]]))
    assert agent.log == [] and link.granule == 96
    monkeypatch.setattr(link, "_prep", lambda g: agent.log.append(("_prep", g)))
    link.ensure_granule(np.array([[0, 0, 192, -1, 96, 48]]))
    assert agent.log == [("_prep", 48)]


def test_the_remote_descriptor_limit_is_inclusive_and_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_link, "MAX_PREPARED_DESCRIPTORS", 16)  # 2 regions x 8 granules: fits
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent)
    monkeypatch.setattr(_link, "MAX_PREPARED_DESCRIPTORS", 15)
    with pytest.raises(FkvError) as e:
        link._prep(GRANULE)
    assert str(e.value) == ("prefill engine 'p' announced a cache of 8 blocks x 2 region(s) "
                            "(1024 B each): 16 descriptors of 128 B to prepare, over this decode "
                            "rank's limit of 15 (MAX_PREPARED_DESCRIPTORS); nothing was allocated")


def _granule_state(link: Any) -> tuple:
    return (link.granule, link.local_dlist, dict(link.remote_dlists), link.local_per_region,
            link.staging_base, link.remote_per_region)


def test_a_finer_granule_over_the_limit_keeps_the_prepared_lists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that needs a granule whose tables would pass the limit fails that read; the link
    keeps its granule and its lists, and the next read's indices use them (it used to release
    them first and keep the new granule: the next read found no remote descriptor list)."""
    monkeypatch.setattr(_link, "MAX_PREPARED_DESCRIPTORS", 16)
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent)
    before = _granule_state(link)
    del agent.log[:]
    with pytest.raises(FkvError, match=r": 32 descriptors of 64 B to prepare, over this decode "
                                       r"rank's limit of 16 \(MAX_PREPARED_DESCRIPTORS\); "
                                       r"nothing was allocated$"):
        link.ensure_granule(np.array([[0, 0, 64, -1, 0, 128]]))
    assert agent.log == [] and _granule_state(link) == before
    rows = np.array([[0, 0, 384, -1, 0, 128]])
    link.ensure_granule(rows)
    assert agent.log == []
    assert [a.tolist() for a in link.indices(rows)] == [[32], [3]]


def test_a_finer_granule_nixl_cannot_prepare_keeps_the_prepared_lists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL refuses one rank's list at the finer granule: the read fails, the lists prepared
    for it are released, and the link's granule and lists stay those that worked."""
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent)
    before = _granule_state(link)
    del agent.log[:]
    agent.fail_prep = "agent-p2"
    with pytest.raises(TransferFailed, match="'agent-p2'"):
        link.ensure_granule(np.array([[0, 0, 64, -1, 0, 128]]))
    assert [c[:2] for c in agent.log] == [("prep", None), ("prep", "agent-p0"),
                                          ("prep", "agent-p2"), ("release_dlist", "dlist5"),
                                          ("release_dlist", "dlist6")]
    assert _granule_state(link) == before
    agent.fail_prep = None
    del agent.log[:]
    link.ensure_granule(np.array([[0, 0, 64, -1, 0, 128]]))
    assert link.granule == 64 and [c[:2] for c in agent.log] == [
        ("prep", None), ("prep", "agent-p0"), ("prep", "agent-p2"),
        ("release_dlist", "dlist2"), ("release_dlist", "dlist3"), ("release_dlist", "dlist4")]


class Box:
    """A same-host outbox: ``put`` takes the message or not."""

    def __init__(self, takes: bool) -> None:
        self.takes, self.put_messages, self.closed = takes, [], False

    def put(self, message: bytes) -> bool:
        self.put_messages.append(message)
        return self.takes

    def close(self) -> None:
        self.closed = True


def test_notify_goes_into_an_outbox_that_takes_it_else_through_nixl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent)
    taking, full = Box(True), Box(False)
    link.outboxes.update({0: taking, 2: full})
    del agent.log[:]
    link.notify((0, 2, 1), b"msg")
    assert taking.put_messages == [b"msg"] and full.put_messages == [b"msg"]
    assert agent.log == [("notify", "agent-p2", b"msg"), ("notify", "agent-p1", b"msg")]
    assert link.notif("r1") == _notification("r1")
    link.close()
    assert taking.closed and full.closed


def _notification(request_id: str) -> bytes:
    from fkv.connector.transport._lifecycle import notification

    return notification(request_id, "d", 0)


def test_a_link_whose_peer_cannot_be_added_still_marks_the_agent_tainted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent counts as tainted once a peer's metadata may have been loaded into it, even
    when loading it failed (a reconnect then replaces the agent)."""
    agent = LinkAgent()

    def refuse(metadata: bytes, *, timeout: float, prep: Any) -> str:
        raise FkvError("NIXL refused the peer's agent metadata")

    agent.add_remote = refuse  # type: ignore[method-assign]
    local = _local(agent)
    assert not local.tainted
    with pytest.raises(FkvError, match="refused"):
        _make_link(monkeypatch, agent, local=local)
    assert local.tainted


def test_a_staging_buffer_only_packed_reads_use_is_registered_but_not_prepared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LinkAgent(progress="poll(1000 us)")
    link = _make_link(monkeypatch, agent, staging_blocks=0, extra_staging=4096)
    staging = link.staging.data_ptr()
    assert link.staging.numel() == 4096 and link.staging_path_bytes == 0
    assert agent.log[4:6] == [("register", [(staging, 4096)], "DRAM", 0),
                              ("prep", None, _table(LOCAL_REGIONS, GRANULE, 0), "DRAM")]
    link.close()
