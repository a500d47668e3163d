"""The ipc path (``_ipc_path.IpcPath``) on CPU: a real plan, peers decoded from their wire bytes
and real ``LayerMove`` kernels (Triton's interpreter) moving the prefill ranks' CPU caches into
the decode's. Only what needs a CUDA driver stands in: the mapping (``_ipc.Mapping`` hands back
the prefill rank's own views), the device's UUID, ``torch.cuda.device`` / ``current_stream`` /
``Event`` (they log; events answer as a test says) and the clock the waits read. Real handles
are mapped in the GPU tests (tests/test_ipc.py, ``-m gpu``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

import fkv
from fkv.connector import EngineDesc, decode_untrusted, encode
from fkv.connector.handshake import handshake
from fkv.connector.transport import _ipc, _ipc_path
from fkv.connector.transport._base import Tally, TransferFailed, cache_regions, layer_views
from fkv.connector.transport._ipc_path import IpcPath
from fkv.connector.transport._link import Local
from fkv.connector.wire import IpcInfo
from fkv.errors import FkvError
from fkv.ops import reference
from fkv.ops.layers import LayerMove

# the plan-path tests' caches of distinct finite values (pytest runs with --import-mode=importlib)
sys.path.insert(0, os.path.dirname(__file__))
from test_plan_path import _caches  # noqa: E402

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=6, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=3)
ONE = SPEC.evolve(num_kv_heads=1)  # one rank of a TP-2 prefill engine of SPEC's heads
MLA = fkv.KVCacheSpec(backend="mla", num_blocks=6, block_size=4, num_kv_heads=1, head_size=16,
                      num_layers=2)
DEV = torch.device("cpu", 3)  # a device with an index (a CUDA device's stands in)
UUID = "GPU-decode-3"  # the decode device's UUID (``_uuid`` of its index)
WARM = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)


def handle(rank: int, slot: int) -> bytes:
    """Prefill rank ``rank``'s publish event of layer slot ``slot`` (64 bytes)."""
    return bytes([rank + 1, slot]) * 32


class Clock:
    """``time`` as ``_ipc_path`` reads it: it moves only when a test's event is queried (by
    ``tick``); sleeps are recorded as ``(when, seconds)``."""

    def __init__(self) -> None:
        self.now, self.tick, self.sleeps = 100.0, 0.0, []

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.sleeps.append((round(self.now, 9), seconds))  # time passes only in queries


class Rig:
    """A decode rank (``local`` caches on DEV, rank ``local_rank`` of ``local_tp``) and the
    prefill ranks its plan reads (``remote`` each), connected through a fake CUDA."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, remote: fkv.KVCacheSpec = ONE,
                 ranks: int = 2, *, local: fkv.KVCacheSpec = SPEC, local_tp: int = 1,
                 local_rank: int = 0, pids: tuple[int, ...] = (), uuids: tuple[str, ...] = (),
                 slots: tuple[int, ...] = (), device: Any = DEV) -> None:
        self.log: list[tuple] = []
        self.clock = Clock()
        self.refuse: dict[int, BaseException] = {}  # rank -> what mapping it raises
        self.events_ok = [True] * ranks  # per rank: the probe took its events
        self.bad_events: set[bytes] = set()  # handles CUDA refuses to open
        self.completed: set[bytes] = set()  # publish events that completed
        self.complete_at: dict[bytes, float] = {}  # and those that complete at a time
        self.copy_after = 0  # queries of the copy's event that say "not yet"
        self.queries = 0  # of every event, so far
        total = remote.num_kv_heads * ranks
        self.plan = handshake((EngineDesc(engine_id="d", tp_size=local_tp, tp_rank=local_rank,
                                          total_num_kv_heads=total), local),
                              (EngineDesc(engine_id="p", tp_size=ranks, tp_rank=0,
                                          total_num_kv_heads=total), remote)).plan
        self.remote, self.local = remote, local
        self.theirs = [_caches(remote, 100 + r) for r in range(ranks)]
        self.mine = _caches(local, 1)
        self.before = [t.clone() for t in self.mine]
        self.peers = []
        for r, caches in enumerate(self.theirs):
            regions = cache_regions(remote, caches)[0]
            info = IpcInfo(host=_ipc.host_identity(),
                           device_uuid=uuids[r] if uuids else f"GPU-prefill-{r}",
                           handles=(bytes([r]) * 64,) * len(regions),
                           offsets=(0,) * len(regions), pid=pids[r] if pids else 0,
                           events=tuple(handle(r, s) for s in range(slots[r] if slots else 0)))
            engine = EngineDesc(engine_id="p", tp_size=ranks, tp_rank=r, total_num_kv_heads=total)
            self.peers.append(decode_untrusted(encode(engine, remote, regions, ipc=info)))
        self.views = layer_views(local, self.mine)
        self.local_side = Local(engine=None, spec=local, views=self.views, regions=[],
                                mem_type="DRAM", device_id=3, device=device, agent=None,
                                zctx=None, strategy="ipc", staging_bytes_max=0, pack_threshold=0)
        self._patch(monkeypatch)

    def _patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        rig, log = self, self.log

        class Mapping:
            def __init__(self, peer: Any, device: Any) -> None:
                self.rank = peer.engine.tp_rank
                log.append(("map", self.rank, device))
                if self.rank in rig.refuse:
                    raise rig.refuse[self.rank]
                self.views = layer_views(peer.spec, rig.theirs[self.rank])
                self.events_ok = rig.events_ok[self.rank]

            def close(self) -> None:
                log.append(("unmap", self.rank))

        @contextlib.contextmanager
        def device(d: Any) -> Any:
            log.append(("enter", d))
            yield
            log.append(("exit", d))

        class Stream:
            def __init__(self, d: Any) -> None:
                self.device = d

            def synchronize(self) -> None:
                log.append(("sync", self.device))

        class Event:
            def __init__(self) -> None:
                self.handle: bytes | None = None
                self.queries = 0
                log.append(("new event",))

            @classmethod
            def from_ipc_handle(cls, d: Any, h: bytes) -> Event:
                log.append(("open event", d, h[0] - 1, h[1]))
                if h in rig.bad_events:
                    raise RuntimeError("CUDA error: invalid resource handle")
                event = object.__new__(cls)
                event.handle, event.queries = h, 0
                return event

            def record(self, stream: Stream) -> None:
                log.append(("record", stream.device))

            def query(self) -> bool:
                rig.clock.now += rig.clock.tick
                rig.queries += 1
                assert rig.queries < 10_000, "a wait that never ends"
                if self.handle is not None:
                    log.append(("query", self.handle[0] - 1, self.handle[1]))
                    return self.handle in rig.completed or \
                        rig.clock.now >= rig.complete_at.get(self.handle, float("inf"))
                self.queries += 1
                log.append(("query copy",))
                return self.queries > rig.copy_after

        monkeypatch.setattr(_ipc_path, "Mapping", Mapping)
        monkeypatch.setattr(_ipc_path, "_uuid", lambda index: log.append(("uuid", index)) or UUID)
        monkeypatch.setattr(_ipc_path, "time", self.clock)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "current_stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        call = LayerMove.__call__

        def spy(move: LayerMove, src: Any, dst: Any, tokens: Any = None, **kw: Any) -> None:
            log.append(("warm", move, tuple(src.tolist()), tuple(dst.tolist()), str(src.device),
                        tokens, kw))
            call(move, src, dst, tokens, **kw)

        monkeypatch.setattr(LayerMove, "__call__", spy)

    def connect(self) -> IpcPath:
        return IpcPath(self.local_side, self.plan, list(self.peers), "p")

    def expected(self, local: list[int], remote: list[int], tokens: int,
                 layers: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """The decode caches once ``layers`` of the request moved (the reference move)."""
        want = [t.clone() for t in self.before]
        a, b = layers or (0, self.local.num_layers)
        for read in self.plan.reads:
            heads = {} if self.remote.is_mla else {"src_heads": read.remote_heads,
                                                   "dst_heads": read.local_heads}
            for layer in range(a, b):
                reference.move(self.theirs[read.remote_rank][layer], self.remote, remote,
                               want[layer], self.local, local, num_tokens=tokens, **heads)
        return want

    def assert_caches(self, want: list[torch.Tensor]) -> None:
        for layer, (got, expected) in enumerate(zip(self.mine, want, strict=True)):
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), layer


def warm_log(path: IpcPath) -> list[tuple]:
    far = (-1,) * 33
    return [("warm", mover, far, far, "cpu", tokens, {"validate": False})
            for _, mover in path.movers for tokens in WARM]


# -- connecting ------------------------------------------------------------------------------------

def test_connecting_maps_each_rank_read_once_and_warms_every_variant_into_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, pids=(os.getpid(), 0))
    path = rig.connect()
    assert [(rank, m.src_heads, m.dst_heads) for rank, m in path.movers] == [
        (0, (0, 1), (0, 1)), (1, (0, 1), (1, 2))]
    assert all(m.src[0].data_ptr() == rig.theirs[rank][0].data_ptr() and
               m.dst[0].data_ptr() == rig.mine[0].data_ptr() for rank, m in path.movers)
    assert rig.log == [("map", 0, DEV), ("map", 1, DEV), ("uuid", 3), ("enter", DEV),
                       *warm_log(path), ("sync", DEV), ("exit", DEV)]
    assert IpcPath.WARM_TOKENS == WARM
    assert list(path.mappings) == [0, 1]
    assert path.pids == {0: os.getpid()}  # rank 1 said no pid (another PID namespace)
    assert path.events == {} and not path.waits_on_events()
    assert path.shared_gpu == []
    # K and V, one head per rank, 8 fp16 values each, 3 layers, 2 ranks
    assert path.bytes_per_token == 2 * (2 * 1 * 8 * 2 * 3)
    rig.assert_caches(rig.before)  # the warm-up moved nothing
    assert (path.name, path.notifies_with_read, path.layered()) == ("ipc", False, True)


def test_bytes_per_token_count_the_heads_read_from_inside_a_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # decode rank 1 of TP 2 reads heads 2..4 of the one prefill rank's 4
    rig = Rig(monkeypatch, SPEC.evolve(num_kv_heads=4), 1, local_tp=2, local_rank=1)
    path = rig.connect()
    assert [(rank, m.src_heads, m.dst_heads) for rank, m in path.movers] == [(0, (2, 4), (0, 2))]
    assert path.bytes_per_token == 2 * 2 * 8 * 2 * 3
    tally = Tally()
    path.read("r", np.array([4, 1]), np.array([2, 5]), 7, 1e9, tally)
    rig.assert_caches(rig.expected([4, 1], [2, 5], 7))
    assert tally.bytes == 7 * 2 * 2 * 8 * 2 * 3


def test_an_mla_rank_moves_its_latent_of_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, MLA, 1, local=MLA)
    path = rig.connect()
    assert [(rank, m.src_heads, m.dst_heads) for rank, m in path.movers] == [(0, (0, 1), (0, 1))]
    assert path.bytes_per_token == 1 * 1 * 16 * 2 * 2  # one latent, no K and V
    tally = Tally()
    path.read("r", np.array([3, 0]), np.array([1, 4]), 6, 1e9, tally)
    rig.assert_caches(rig.expected([3, 0], [1, 4], 6))
    assert tally.bytes == 6 * 64


@pytest.mark.parametrize("error", [FkvError("cannot map prefill rank 1's caches: no"),
                                   KeyboardInterrupt()])
def test_a_mapping_that_fails_unmaps_the_ranks_mapped_before(monkeypatch: pytest.MonkeyPatch,
                                                              error: BaseException) -> None:
    rig = Rig(monkeypatch)
    rig.refuse[1] = error
    with pytest.raises(type(error)) as e:
        rig.connect()
    assert e.value is error
    assert rig.log == [("map", 0, DEV), ("map", 1, DEV), ("unmap", 0)]


def test_a_warm_up_that_fails_unmaps_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch)
    rig.local_side.views = rig.views[:2]  # a decode side of fewer layers: LayerMove refuses
    with pytest.raises(FkvError, match="^LayerMove: 'src' holds 3 layers but 'dst' 2;"):
        rig.connect()
    assert rig.log == [("map", 0, DEV), ("unmap", 0)]


def test_prefill_ranks_on_the_decode_gpu_are_named_by_describe(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    rig = Rig(monkeypatch, uuids=("GPU-other", UUID))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    path = rig.connect()
    assert path.shared_gpu == [1]
    mapped = ("ipc: the prefill caches of P0, P1 are mapped into cuda:3; one kernel per read "
              "moves every layer")
    assert path.describe() == mapped + _ipc.sharing_note([1], mps=False)
    (tmp_path / "control").touch()
    assert path.describe() == mapped + "; P1 on this GPU too, under MPS (their kernels overlap)"


def test_a_device_without_an_index_is_device_0(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, ONE, 1, local=ONE, uuids=(UUID,), device=torch.device("cpu"))
    path = rig.connect()
    assert rig.log[:3] == [("map", 0, torch.device("cpu")), ("uuid", 0),
                           ("enter", torch.device("cpu"))]
    assert path.shared_gpu == [0]


# -- publish events ----------------------------------------------------------------------------

def test_publish_events_of_every_rank_open_on_the_decode_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, slots=(2, 3))
    path = rig.connect()
    opened = [("open event", DEV, 0, 0), ("open event", DEV, 0, 1), ("open event", DEV, 1, 0),
              ("open event", DEV, 1, 1), ("open event", DEV, 1, 2)]
    assert rig.log[2:7] == opened and rig.log[7] == ("uuid", 3)
    assert {rank: [e.handle for e in events] for rank, events in path.events.items()} == {
        0: [handle(0, 0), handle(0, 1)], 1: [handle(1, 0), handle(1, 1), handle(1, 2)]}
    assert path.waits_on_events()


@pytest.mark.parametrize("slots,probe_ok,refused,opened", [
    ((2, 0), (True, True), (), 2),   # rank 1 exports none
    ((0, 2), (True, True), (), 0),   # rank 0 exports none
    ((2, 2), (True, False), (), 2),  # the probe could not use rank 1's
    ((2, 2), (False, True), (), 0),  # nor rank 0's
    ((2, 2), (True, True), (handle(1, 1),), 4),  # CUDA refuses one of rank 1's here
])
def test_no_publish_events_unless_every_rank_has_them_and_they_open(
        monkeypatch: pytest.MonkeyPatch, slots: tuple[int, int], probe_ok: tuple[bool, bool],
        refused: tuple[bytes, ...], opened: int) -> None:
    rig = Rig(monkeypatch, slots=slots)
    rig.events_ok = list(probe_ok)
    rig.bad_events.update(refused)
    path = rig.connect()
    assert path.events == {} and not path.waits_on_events()
    assert len([x for x in rig.log if x[0] == "open event"]) == opened


def test_written_is_the_run_of_layers_whose_events_completed_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, slots=(2, 3))  # layer 2 is rank 0's slot 0 again
    path = rig.connect()
    del rig.log[:]
    assert path.written(0, 3) == 0
    assert rig.log == [("query", 0, 0)]
    rig.completed |= {handle(0, 0), handle(0, 1), handle(1, 0)}
    del rig.log[:]
    assert path.written(0, 3) == 1
    assert rig.log == [("query", 0, 0), ("query", 1, 0), ("query", 0, 1), ("query", 1, 1)]
    rig.completed.add(handle(1, 1))
    assert (path.written(0, 3), path.written(0, 2), path.written(1, 1), path.written(2, 2)) == (
        2, 2, 1, 2)
    del rig.log[:]
    assert path.written(2, 3) == 2
    assert rig.log == [("query", 0, 0), ("query", 1, 2)]
    rig.completed.add(handle(1, 2))
    assert path.written(0, 3) == 3 and path.written(1, 3) == 3


@pytest.mark.parametrize("start", [0.0, 50.0])
def test_waiting_for_a_layer_polls_its_events_busy_for_2_ms_then_sleeping(
        monkeypatch: pytest.MonkeyPatch, start: float) -> None:
    rig = Rig(monkeypatch, slots=(2, 3))  # layer 2: rank 0's slot 0, rank 1's slot 2
    path = rig.connect()
    rig.completed.add(handle(1, 2))
    rig.clock.now, rig.clock.tick = start, 0.001
    rig.complete_at[handle(0, 0)] = start + 0.0035
    del rig.log[:]
    path._wait_written(2, start + 1.0)
    assert rig.log == [("query", 0, 0)] * 4 + [("query", 1, 2)]
    # busy for the first 2 ms, then a 50 us nap between polls
    assert rig.clock.sleeps == [(round(start + 0.003, 9), 0.00005)]


def test_a_layer_whose_events_never_complete_costs_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, slots=(2, 3))
    path = rig.connect()
    rig.completed.add(handle(0, 1))
    rig.clock.now, rig.clock.tick = 0.0, 0.25
    del rig.log[:]
    with pytest.raises(TransferFailed) as e:
        path._wait_written(1, 1.0)
    assert str(e.value) == ("the writes of layer 1 on prefill engine 'p' did not finish before "
                            "the read's timeout (its publish event never completed)")
    assert rig.log == [("query", 0, 1), ("query", 1, 1)] * 3
    assert rig.clock.now == 1.5  # polled until the clock passed the deadline


# -- reads ---------------------------------------------------------------------------------------

def test_a_read_moves_the_requests_tokens_from_every_rank_and_waits_for_the_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, pids=(os.getpid(), os.getpid()))
    path = rig.connect()
    rig.copy_after, rig.clock.tick = 2, 0.25
    del rig.log[:]
    tally = Tally(bytes=5, transfer_seconds=1.0)
    path.read("r", np.array([5, 2, 0]), np.array([1, 3, 4]), 9, rig.clock.now + 10.0, tally)
    rig.assert_caches(rig.expected([5, 2, 0], [1, 3, 4], 9))
    assert rig.log == [("enter", DEV), ("new event",), ("record", DEV), ("query copy",),
                       ("query copy",), ("query copy",), ("exit", DEV)]
    assert tally.transfer_seconds == 1.0 + 0.75
    assert tally.bytes == 5 + 9 * path.bytes_per_token
    assert tally.descriptors == 0


@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (2, 3), (1, 1)])
def test_a_layer_range_moves_those_layers_and_counts_their_share(
        monkeypatch: pytest.MonkeyPatch, layers: tuple[int, int]) -> None:
    rig = Rig(monkeypatch)
    path = rig.connect()
    tally = Tally()
    path.read("r", np.array([4, 1]), np.array([0, 2]), 6, 1e9, tally, layers=layers)
    rig.assert_caches(rig.expected([4, 1], [0, 2], 6, layers))
    assert tally.bytes == 6 * 2 * 1 * 8 * 2 * 2 * (layers[1] - layers[0])


def test_a_layer_ranges_share_of_the_bytes_is_rounded_not_truncated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ONE.evolve(num_layers=10)
    rig = Rig(monkeypatch, spec, 1, local=spec)
    path = rig.connect()
    assert path.bytes_per_token == 2 * 1 * 8 * 2 * 10
    tally = Tally()
    path.read("r", np.array([2, 5, 0]), np.array([4, 1, 3]), 9, 1e9, tally, layers=(0, 7))
    rig.assert_caches(rig.expected([2, 5, 0], [4, 1, 3], 9, (0, 7)))
    assert tally.bytes == 9 * 2 * 8 * 2 * 7  # 2016: 9 * 320 * 0.7 is 2015.9999999999998


@pytest.mark.parametrize("layers,last", [((0, 2), 1), ((2, 3), 2), (None, 2)])
def test_a_read_after_events_first_waits_for_the_last_layers_events(
        monkeypatch: pytest.MonkeyPatch, layers: tuple[int, int] | None, last: int) -> None:
    rig = Rig(monkeypatch, slots=(2, 3))
    path = rig.connect()
    rig.completed |= {handle(0, last % 2), handle(1, last)}
    del rig.log[:]
    tally = Tally()
    path.read("r", np.array([3]), np.array([4]), 4, 1e9, tally, layers=layers, after_events=True)
    rig.assert_caches(rig.expected([3], [4], 4, layers))
    assert rig.log == [("enter", DEV), ("query", 0, last % 2), ("query", 1, last),
                       ("new event",), ("record", DEV), ("query copy",), ("exit", DEV)]
    del rig.log[:]
    path.read("r", np.array([3]), np.array([4]), 4, 1e9, tally, layers=layers)
    assert rig.log == [("enter", DEV), ("record", DEV), ("query copy",), ("exit", DEV)]


def test_a_read_whose_events_never_complete_moves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, slots=(2, 3))
    path = rig.connect()
    rig.completed.add(handle(0, 1))
    rig.clock.tick = 1.0
    tally = Tally()
    with pytest.raises(TransferFailed, match=r"^the writes of layer 1 on prefill engine 'p' "):
        path.read("r", np.array([3]), np.array([4]), 4, rig.clock.now + 5, tally, layers=(0, 2),
                  after_events=True)
    rig.assert_caches(rig.before)
    assert tally == Tally()


def test_a_copy_that_never_finishes_costs_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch)
    path = rig.connect()
    rig.copy_after, rig.clock.tick = 10**9, 1.0
    tally = Tally()
    deadline = rig.clock.now + 3.0
    with pytest.raises(TransferFailed) as e:
        path.read("r", np.array([3]), np.array([4]), 4, deadline, tally)
    assert str(e.value) == ("the ipc copy from prefill engine 'p' did not finish before the "
                            "read's timeout")
    assert rig.clock.now == deadline + 1.0  # polled until the clock passed the deadline
    assert tally == Tally()


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_a_prefill_rank_that_exited_fails_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = _exited_pid()
    rig = Rig(monkeypatch, pids=(os.getpid(), gone))
    path = rig.connect()
    assert path.pids == {0: os.getpid(), 1: gone}
    rig.clock.tick = 0.5
    tally = Tally()
    with pytest.raises(TransferFailed) as e:
        path.read("r", np.array([3]), np.array([4]), 4, 1e9, tally)
    assert str(e.value) == ("prefill rank(s) [1] of engine 'p' exited during the read: its bytes "
                            "are not trusted; reconnect once it is back (client.reconnect())")
    assert tally == Tally(transfer_seconds=0.5)


def test_a_request_keeps_its_prepared_moves_until_ids_or_tokens_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch)
    path = rig.connect()
    local, remote = np.array([4, 1], dtype=np.int32), np.array([0, 2])
    first = path._prepared(local, remote, 6)
    assert [(m.move, m.src_ids.tolist(), m.dst_ids.tolist(), m.num_tokens) for m in first] == [
        (mover, [0, 2], [4, 1], 6) for _, mover in path.movers]
    assert all(m.src_ids.dtype == m.dst_ids.dtype == torch.int64 for m in first)
    assert path._prepared(np.array([4, 1]), np.array([0, 2]), 6) is first
    local[0] = 5  # the caller's arrays change after the call: the kept request does not
    assert path._prepared(np.array([4, 1]), remote, 6) is first
    for other in (([4, 1], [0, 2], 5), ([4, 3], [0, 2], 6), ([4, 1], [0, 3], 6),
                  ([4, 1, 5], [0, 2, 3], 6)):
        again = path._prepared(np.array(other[0]), np.array(other[1]), other[2])
        assert again is not first
        assert [(m.src_ids.tolist(), m.dst_ids.tolist(), m.num_tokens) for m in again] == [
            (other[1], other[0], other[2])] * 2
        first = path._prepared(np.array([4, 1]), np.array([0, 2]), 6)


def test_the_reads_of_a_request_share_one_done_event(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch)
    path = rig.connect()
    tally = Tally()
    for layers in ((0, 1), (1, 2), (2, 3)):
        path.read("r", np.array([4, 1]), np.array([0, 2]), 6, 1e9, tally, layers=layers)
    rig.assert_caches(rig.expected([4, 1], [0, 2], 6))
    assert len([x for x in rig.log if x == ("new event",)]) == 1
    assert tally.bytes == 6 * path.bytes_per_token


def test_close_unmaps_every_rank_and_forgets_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch)
    path = rig.connect()
    path._prepared(np.array([1]), np.array([2]), 3)
    del rig.log[:]
    path.close()
    assert rig.log == [("unmap", 0), ("unmap", 1)]
    assert (path._request, path.movers, path.mappings) == (None, [], {})
    path.close()
    assert rig.log == [("unmap", 0), ("unmap", 1)]
