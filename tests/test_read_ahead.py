"""What a read prepares before its bytes can move: a streaming read creates the awaited layer's
READs in NIXL while it waits (posting them is all that is left once the layer is published), and
every read makes its done notification before the first READ. Each READ created is posted or
released, whichever way the read ends. The descriptor indices of a READ, both sides at once.
CPU, real NIXL, one process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fkv
from fkv.connector import EngineDesc, connect, serve
from fkv.connector.transport import _agent
from fkv.connector.transport._base import TransferFailed
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=3)


def engine(name: str) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)


def _zeros() -> list[torch.Tensor]:
    caches = fkv.allocate(SPEC)
    for layer in caches:
        layer.zero_()
    return caches


def _filled() -> list[torch.Tensor]:
    caches = fkv.allocate(SPEC)
    for i, layer in enumerate(caches):
        layer.copy_(torch.arange(layer.numel()).view(layer.shape) % 251 + 1000 * i)
    return caches


class _Handles:
    """Every READ the agents create, post, discard and release (by NIXL handle)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.created: list[Any] = []
        self.posted: list[Any] = []
        self.released: list[Any] = []
        real_create, real_post, real_release = (_agent.Agent.create_read, _agent.Agent._post,
                                                _agent.Agent.release)

        def create_read(agent: Any, *args: Any, **kwargs: Any) -> Any:
            handle = real_create(agent, *args, **kwargs)
            self.created.append(handle)
            return handle

        def post(agent: Any, handle: Any, *args: Any) -> Any:
            self.posted.append(handle)
            return real_post(agent, handle, *args)

        def release(agent: Any, xfer: Any) -> None:
            self.released.append(xfer.handle)
            real_release(agent, xfer)

        monkeypatch.setattr(_agent.Agent, "create_read", create_read)
        monkeypatch.setattr(_agent.Agent, "_post", post)
        monkeypatch.setattr(_agent.Agent, "release", release)

    def unreleased(self) -> list[Any]:
        return [h for h in self.created if not any(h is r for r in self.released)]


@pytest.fixture(autouse=True)
def _nixl_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about NIXL READs: same-host copies off, except where a test copies."""
    if "copies" not in request.node.name:
        monkeypatch.setenv("FKV_CMA", "0")


def _stream_in_a_thread(client: Any, timeout: float = 20.0) -> tuple[threading.Thread, dict]:
    out: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: out.update(
        r=client.read("s1", [1, 2], [3, 5], timeout=timeout, stream=True)))
    reader.start()
    return reader, out


def _await_creates(handles: _Handles, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(handles.created) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(handles.created) == n, handles.created


@contextlib.contextmanager
def _copying() -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor], Any, Any]]:
    """A prefill server on filled caches and a client on zeroed ones that copies same-host
    rows (``process_vm_readv``) instead of posting NIXL READs: (caches, local, server, client)."""
    caches = _filled()
    with serve(engine("p"), SPEC, caches) as server:
        local = _zeros()
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            assert client._state.plan_path.copier is not None, client.describe()
            yield caches, local, server, client


def test_a_streamed_read_posts_the_read_it_made_during_the_wait_and_releases_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 is published alone: the READ created while it was awaited is the one posted.
    Layers 1 and 2 come together: the READ created for layer 1 alone is released unposted and
    one READ of both layers moves them. Every byte lands; no created READ stays unreleased."""
    handles = _Handles(monkeypatch)
    caches = _filled()
    with serve(engine("p"), SPEC, caches) as server:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            server.hold("s1", [3, 5], layers_ready=0)
            reader, out = _stream_in_a_thread(client)
            _await_creates(handles, 1)  # layer 0's READ exists before layer 0 is published
            assert handles.posted == []
            server.publish("s1", 1)
            _await_creates(handles, 2)  # then layer 1's, while layer 1 is awaited
            first = handles.created[0]
            assert len(handles.posted) == 1 and handles.posted[0] is first
            server.publish("s1", 3)
            reader.join(30)
            result = out["r"]
            assert result.ok, result.error
            for mine, theirs in zip(local, caches, strict=True):
                assert torch.equal(mine[1:3], theirs[[3, 5]])
            path = client._state.plan_path
            assert (path.prepared_reads, path.discarded_reads, path._ahead) == (1, 1, [])
    # layer 0's READ posted as created; layer 1's released unposted; layers 1-2 read anew
    assert len(handles.created) == 3 and len(handles.posted) == 2
    assert handles.posted[1] is handles.created[2]
    assert not any(handles.created[1] is p for p in handles.posted)
    assert handles.unreleased() == []


def test_a_streamed_read_that_times_out_releases_the_read_it_made_unposted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    handles = _Handles(monkeypatch)
    with serve(engine("p"), SPEC, _filled()) as server:
        local = _zeros()
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            server.hold("s1", [3, 5], layers_ready=0)
            result = client.read("s1", [1, 2], [3, 5], timeout=0.5, stream=True)
            assert not result.ok
            assert "no layer landed, layer 0 of 3 was not published" in result.error
            assert result.layer_seconds == () and result.bytes == 0
            path = client._state.plan_path
            assert (path.prepared_reads, path.discarded_reads, path._ahead) == (0, 1, [])
            assert all(torch.count_nonzero(layer) == 0 for layer in local)
    assert len(handles.created) == 1 and handles.posted == []
    assert handles.unreleased() == []


def test_same_host_copies_compute_the_awaited_layer_ahead_and_create_no_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With same-host copies (the CPU default on one host) a streamed read computes the awaited
    layer's copy vectors while it waits, copies with them once the layer is published, and never
    creates a NIXL READ; the bytes are those of the prefill cache."""
    handles = _Handles(monkeypatch)
    with _copying() as (caches, local, server, client):
        path = client._state.plan_path
        # connect READ 64 bytes from the rank to finish NIXL's connection (notifications
        # may need it); no READ after that
        assert handles.created == [] and len(handles.posted) == 1
        server.hold("s1", [3, 5], layers_ready=0)
        reader, out = _stream_in_a_thread(client)
        time.sleep(0.2)
        assert all(torch.count_nonzero(layer) == 0 for layer in local)
        server.publish("s1", 1)
        deadline = time.monotonic() + 10
        while not torch.equal(local[0][1:3], caches[0][[3, 5]]) and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        assert torch.equal(local[0][1:3], caches[0][[3, 5]])
        assert torch.count_nonzero(local[1]) == 0  # not published, not copied
        server.publish("s1", 3)
        reader.join(30)
        result = out["r"]
        assert result.ok, result.error
        # layers x blocks x (K, V) x heads x tokens x head size x 2 bytes (bf16)
        assert result.strategy == "direct" and result.bytes == 3 * 2 * 2 * 2 * 4 * 8 * 2
        for mine, theirs in zip(local, caches, strict=True):
            assert torch.equal(mine[1:3], theirs[[3, 5]])
            assert torch.count_nonzero(mine[[0, 3, 4, 5, 6, 7]]) == 0
        # layer 0 from the vectors computed while it was awaited; layers 1-2 came together
        assert (path.prepared_reads, path.discarded_reads, path._ahead) == (1, 0, [])
    assert handles.created == [] and len(handles.posted) == 1


def test_same_host_copies_prime_the_awaited_layer_as_the_wait_spins_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a wait spins ahead of a predicted publish (here: the window is open), the
    awaited layer's copy is primed first (its pages touched on both sides), then copied when
    the layer comes: one prime per layer, each of that layer's vectors, and the bytes are the
    prefill cache's."""
    from fkv.connector.transport import _stream
    from fkv.connector.transport._plan_path import PlanPath

    start = time.monotonic()  # a window open from now on for two hours
    monkeypatch.setattr(_stream, "spin_window", lambda *a: (start, start + 7200.0))
    primed: list[tuple[int, int] | None] = []
    real_prime = PlanPath.prime

    def prime(path: Any, reads: Any, budget: float) -> None:
        primed.append(reads.layers)
        assert 3500 < budget < 3600  # until the middle of that window
        real_prime(path, reads, budget)

    monkeypatch.setattr(PlanPath, "prime", prime)
    with _copying() as (caches, local, server, client):
        path = client._state.plan_path
        server.hold("s1", [3, 5], layers_ready=0)
        reader, out = _stream_in_a_thread(client)
        for layer in range(3):
            deadline = time.monotonic() + 10
            while len(primed) <= layer and time.monotonic() < deadline:
                time.sleep(0.005)
            assert primed == [(n, n + 1) for n in range(layer + 1)]
            assert torch.count_nonzero(local[layer]) == 0  # primed, not copied
            server.publish("s1", layer + 1)
        reader.join(30)
        result = out["r"]
        assert result.ok, result.error
        for mine, theirs in zip(local, caches, strict=True):
            assert torch.equal(mine[1:3], theirs[[3, 5]])
            assert torch.count_nonzero(mine[[0, 3, 4, 5, 6, 7]]) == 0
        assert path.copier.primed == 3 and path.prepared_reads == 3


def test_a_created_read_whose_post_fails_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL refuses the post of the READ created during the wait: the read fails naming the
    prefill rank, the handle is released, and the next read of the connection works."""
    handles = _Handles(monkeypatch)
    caches = _filled()
    with serve(engine("p"), SPEC, caches) as server:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            nixl = client._agent._agent
            real_transfer = nixl.transfer
            calls = []

            def transfer(handle: Any, *args: Any) -> str:
                calls.append(handle)
                if len(calls) == 1:
                    raise RuntimeError("NIXL_ERR_BACKEND")
                return real_transfer(handle, *args)

            monkeypatch.setattr(nixl, "transfer", transfer)
            server.hold("s1", [3, 5], layers_ready=0)
            reader, out = _stream_in_a_thread(client)
            _await_creates(handles, 1)
            server.publish("s1", 3)
            reader.join(30)
            result = out["r"]
            assert not result.ok
            assert "prefill rank 0 of engine 'p'" in result.error
            assert "could not post a READ" in result.error and "NIXL_ERR_BACKEND" in result.error
            assert handles.unreleased() == []
            server.hold("w", [3, 5])
            again = client.read("w", [1, 2], [3, 5])
            assert again.ok, again.error
            for mine, theirs in zip(local, caches, strict=True):
                assert torch.equal(mine[1:3], theirs[[3, 5]])


def test_a_request_id_too_long_to_notify_fails_before_anything_moves() -> None:
    """The done notification is made before the first READ: an id it cannot carry is refused
    with nothing moved (it used to be refused after the bytes had landed)."""
    with serve(engine("p"), SPEC, _filled()) as server:
        local = _zeros()
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            with pytest.raises(FkvError) as e:
                client.read("r" * 4097, [1, 2], [3, 5])
            assert "'request_id'" in str(e.value) and "at most 4096 UTF-8 bytes" in str(e.value)
            assert str(e.value).endswith("; nothing was transferred")
            assert all(torch.count_nonzero(layer) == 0 for layer in local)
            assert client.stats()["failures"] == {}


def test_a_post_failure_is_a_transfer_failure() -> None:
    """``Agent.post`` reports NIXL's refusal as TransferFailed naming the remote."""
    class Refusing:
        def transfer(self, handle: Any) -> str:
            raise RuntimeError("no")

    class Handle:
        released = False

        def release(self) -> None:
            self.released = True

    agent = object.__new__(_agent.Agent)
    agent._agent, agent._leaked = Refusing(), []
    handle = Handle()
    with pytest.raises(TransferFailed, match="could not post a READ from 'peer': RuntimeError: no"):
        agent.post(handle, "peer", 10)
    assert handle.released


@settings(max_examples=300)
@given(st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 2**20), st.integers(0, 9)),
                max_size=40), st.booleans())
def test_run_indices_are_every_run_concatenated_on_both_sides(runs: list, uniform: bool) -> None:
    if uniform and runs:
        runs = [(a, b, runs[0][2]) for a, b, _ in runs]
    a = np.array([r[0] for r in runs], dtype=np.int64)
    b = np.array([r[1] for r in runs], dtype=np.int64)
    count = np.array([r[2] for r in runs], dtype=np.int64)
    local, remote = _agent.run_indices((a, b), count)
    want_a = [x + k for x, _, c in runs for k in range(c)]
    want_b = [y + k for _, y, c in runs for k in range(c)]
    assert local.dtype == remote.dtype == np.int32
    assert (local.tolist(), remote.tolist()) == (want_a, want_b)
    assert _agent.row_indices(a, count).tolist() == want_a
