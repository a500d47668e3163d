"""Bad arguments to ``serve``/``connect`` and to a server's ``hold``/``publish`` and a client's
``read``/``reconnect``: each raises FkvError naming the field, the value and what is allowed,
before anything is recorded or moves; nothing hangs (a NaN deadline never expires, a socket left
open blocks the ZMQ context's shutdown for ever). CPU, one process, real NIXL."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fkv
from fkv.connector import CurveKeys, EngineDesc, connect, curve_keypair, serve
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=2)
CURVE_TYPE = ("'curve' must be None (plain TCP) or an fkv.connector.CurveKeys (got {!r}); make "
              "keys with fkv.connector.curve_keypair()")
SECONDS = "{!r} must be a finite positive number of seconds (got {!r})"
_DECODE_IDS = itertools.count()  # one decode engine id per client of the shared server


def engine(name: str) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)


def isolated(code: str, timeout: float = 120.0) -> str:
    """Run ``code`` in a fresh interpreter (a hang must fail the test, not stop the run), on the
    fkv this process imported, and return its stdout."""
    prelude = ("import fkv\nfrom fkv.connector import CurveKeys, EngineDesc, curve_keypair, serve\n"
               "SPEC = fkv.KVCacheSpec(layout='HND', num_blocks=8, block_size=4, num_kv_heads=2, "
               "head_size=8, num_layers=2)\n"
               "P = EngineDesc(engine_id='p', tp_size=1, tp_rank=0, total_num_kv_heads=2)\n")
    try:
        done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=timeout,
                              cwd=Path(fkv.__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout:g} s:\n{code}")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# -- serve ---------------------------------------------------------------------------------------

def test_serve_refuses_a_curve_that_is_not_curve_keys_without_hanging() -> None:
    """Before: harden_server raised AttributeError with the ROUTER socket open, and the server's
    clean-up then blocked in ctx.term() for ever. A key pair (a tuple) is named by its type only:
    it holds the secret key."""
    out = isolated("""
        for curve in ("abc", curve_keypair()):
            try:
                serve(P, SPEC, fkv.allocate(SPEC), curve=curve).close()
            except fkv.FkvError as e:
                print(e)
        """)
    assert out.splitlines() == [CURVE_TYPE.format("str"), CURVE_TYPE.format("tuple")]


def test_a_failed_side_channel_set_up_closes_its_socket() -> None:
    """Any failure while the CURVE side channel is set up (here: after its limits and keys were
    set and its authenticator started) closes the socket, so the server's clean-up ends."""
    out = isolated("""
        from fkv.connector.transport import _sidelimits

        real = _sidelimits.harden_server

        def failing(sock, **kw):
            real(sock, **kw)
            raise RuntimeError("set-up failed")

        _sidelimits.harden_server = failing
        server_pub, server_sec = curve_keypair()
        client_pub, _ = curve_keypair()
        try:
            serve(P, SPEC, fkv.allocate(SPEC),
                  curve=CurveKeys(server_pub, server_sec, allowed=frozenset({client_pub})))
        except RuntimeError as e:
            print(e)
        _sidelimits.harden_server = real  # and the next server starts as usual
        with serve(P, SPEC, fkv.allocate(SPEC), curve=CurveKeys(server_pub, server_sec)) as s:
            print(s.address.startswith("tcp://"))
        """)
    assert out.splitlines() == ["set-up failed", "True"]


def test_a_rank_above_0_needs_rank_0s_public_key_up_front() -> None:
    pub, sec = curve_keypair()
    rank1 = EngineDesc(engine_id="p", tp_size=2, tp_rank=1, total_num_kv_heads=2)
    with pytest.raises(FkvError) as e:
        serve(rank1, SPEC.evolve(num_kv_heads=1), fkv.allocate(SPEC.evolve(num_kv_heads=1)),
              join="tcp://127.0.0.1:1", curve=CurveKeys(pub, sec))
    assert str(e.value) == ("'curve.server' must be the server's public key (Z85, 40 bytes) (got "
                            "None); pass CurveKeys(public, secret, server=<server public key>)")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lease": float("nan")}, SECONDS.format("lease", float("nan"))),
    ({"lease": float("inf")}, SECONDS.format("lease", float("inf"))),
    ({"lease": "10"}, SECONDS.format("lease", "10")),
    ({"lease": 0}, SECONDS.format("lease", 0)),
    ({"join_timeout": float("nan")}, SECONDS.format("join_timeout", float("nan"))),
    ({"on_release": 5},
     "'on_release' must be None or a callable on_release(request_id, block_ids, why) (got 5)"),
    ({"port": -1}, "'port' must be an int in [0, 65535] (0: any free port) (got -1)"),
    ({"port": 65536}, "'port' must be an int in [0, 65535] (0: any free port) (got 65536)"),
    ({"port": "80"}, "'port' must be an int in [0, 65535] (0: any free port) (got '80')"),
    ({"port": True}, "'port' must be an int in [0, 65535] (0: any free port) (got True)"),
    ({"host": 5}, "'host' must be a non-empty str: the interface to bind, like '127.0.0.1' "
                  "(got 5)"),
    ({"host": ""}, "'host' must be a non-empty str: the interface to bind, like '127.0.0.1' "
                   "(got '')"),
    ({"join": "tcp://127.0.0.1:1"}, "'join' must be None on rank 0 (rank 0 answers the side "
                                    "channel) (got 'tcp://127.0.0.1:1')"),
    ({"pack_bytes": -1}, "'pack_bytes' must be None (default) or a non-negative int (got -1)"),
    ({"pack_bytes": True}, "'pack_bytes' must be None (default) or a non-negative int (got True)"),
])
def test_serve_refuses_bad_arguments_up_front(kwargs: dict, message: str) -> None:
    with pytest.raises(FkvError) as e:
        serve(engine("p"), SPEC, fkv.allocate(SPEC), **kwargs).close()
    assert str(e.value) == message


# -- hold ----------------------------------------------------------------------------------------

OUTSIDE = "'block_ids'[{}] = {} is outside the block cache's [0, num_blocks=8)"


@pytest.mark.parametrize(("block_ids", "message"), [
    ([1, 1], "'block_ids' must be distinct block ids (got '[1, 1]'); block 1 is listed more "
             "than once"),
    ([4, 2, 7, 2], "'block_ids' must be distinct block ids (got '[4, 2, 7, 2]'); block 2 is "
                   "listed more than once"),
    ([-1], OUTSIDE.format(0, -1)),
    ([3, 8], OUTSIDE.format(1, 8)),
    ([1.0], "'block_ids' must hold integers (got dtype float64)"),
    ([True], "'block_ids' must hold integers (got dtype bool)"),
    ("12", "'block_ids' must be 1-D (got shape ())"),
    (3, "'block_ids' must be 1-D (got shape ())"),
    ([[3]], "'block_ids' must be 1-D (got shape (1, 1))"),
    (torch.tensor([[1, 2]]), "'block_ids' must be 1-D (got shape (1, 2))"),
])
def test_hold_refuses_block_ids_that_are_not_this_ranks_blocks(block_ids: object,
                                                               message: str) -> None:
    released = []
    with serve(engine("p"), SPEC, fkv.allocate(SPEC),
               on_release=lambda *a: released.append(a)) as server:
        with pytest.raises(FkvError) as e:
            server.hold("r1", block_ids)
        assert str(e.value) == message
        assert server.pending() == set() and server.layers_ready("r1") is None
        server.hold("r1", [2, 5], lease=0.05)  # nothing of the refused hold was recorded
        assert server.pending() == {"r1"}
        with pytest.raises(FkvError) as e:  # a renewal's ids are checked the same way
            server.hold("r1", block_ids)
        assert str(e.value) == message
    assert list(server.errors) == []


@pytest.mark.parametrize("block_ids", [[0, 7], (3,), np.array([6, 1]), torch.tensor([2, 4]),
                                       np.array([5], dtype=np.uint8), [], None])
def test_hold_takes_this_ranks_block_ids_in_any_1d_container(block_ids: object) -> None:
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("r1", block_ids)
        server.hold("r1", block_ids)  # renewed
        assert server.pending() == {"r1"}


# -- publish -------------------------------------------------------------------------------------

CPU_EVENT = ("'event' must be None or a torch.cuda.Event (an object with its query() and "
             "synchronize() methods) (got {}); this rank's caches are on CPU: pass None once the "
             "host wrote the layers, an event only when asynchronous CUDA copies write them")


class QueryOnly:
    """Half an event: the event waiter would fail on ``synchronize()``."""

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "QueryOnly()"


@pytest.mark.parametrize(("event", "shown"), [("x", "'x'"), (True, "True"), (0.5, "0.5"),
                                              (QueryOnly(), "QueryOnly()")])
def test_publish_refuses_an_event_before_any_state_changes(event: object, shown: str) -> None:
    """Before: an event without ``query()`` raised AttributeError after the layers were counted
    as announced, so a later publish of fewer layers was refused."""
    with serve(engine("p"), SPEC.evolve(num_layers=3), fkv.allocate(SPEC.evolve(num_layers=3))
               ) as server:
        server.hold("s1", [5], layers_ready=0)
        with pytest.raises(FkvError) as e:
            server.publish("s1", 2, event=event)
        assert str(e.value) == CPU_EVENT.format(shown)
        assert server.layers_ready("s1") == 0
        server.publish("s1", 1)
        assert server.layers_ready("s1") == 1
        server.publish("s1", 3, event=None)
        assert server.layers_ready("s1") == 3
        assert list(server.errors) == []


@pytest.mark.parametrize(("kwargs", "shown"), [({"decode_engine_id": "d"}, "('d', None)"),
                                               ({"decode_tp": 2}, "(None, 2)")])
def test_hold_takes_the_readers_engine_and_tp_together(kwargs: dict, shown: str) -> None:
    """``decode_engine_id`` without ``decode_tp`` (or the reverse) is refused naming both, before
    anything is recorded: before the check, ``decode_tp`` alone was dropped without a word."""
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        with pytest.raises(FkvError) as e:
            server.hold("r1", [1], **kwargs)
        assert str(e.value) == f"'decode_engine_id/decode_tp' must be both or neither (got {shown})"
        assert server.pending() == set()


@pytest.mark.parametrize("layers_ready", [True, 1.0, "1", -1, 4])
def test_publish_refuses_layers_ready_that_is_not_an_int_in_range(layers_ready: object) -> None:
    with serve(engine("p"), SPEC.evolve(num_layers=3), fkv.allocate(SPEC.evolve(num_layers=3))
               ) as server:
        server.hold("s1", [5], layers_ready=0)
        with pytest.raises(FkvError) as e:
            server.publish("s1", layers_ready)
        assert str(e.value) == (f"'layers_ready' must be an int in [0, 3] (layers only move "
                                f"forward, up to spec.num_layers=3) (got {layers_ready!r})")
        assert server.layers_ready("s1") == 0


def test_publish_refuses_going_back_and_the_count_stays() -> None:
    spec = SPEC.evolve(num_layers=3)
    with serve(engine("p"), spec, fkv.allocate(spec)) as server:
        server.hold("s1", [5], layers_ready=0)
        server.publish("s1", 2)
        with pytest.raises(FkvError) as e:
            server.publish("s1", 1)
        assert str(e.value) == ("'layers_ready' must be an int in [2, 3] (layers only move "
                                "forward, up to spec.num_layers=3) (got 1)")
        assert server.layers_ready("s1") == 2
        server.publish("s1", 2)  # the same count again: allowed
        server.publish("s1", 3)
        assert server.layers_ready("s1") == 3
        assert list(server.errors) == []

# -- connect, read, reconnect --------------------------------------------------------------------

@pytest.fixture(scope="module")
def prefill():
    src = fkv.allocate(SPEC)
    for layer in src:
        layer.copy_(torch.randn(layer.shape))
    with serve(engine("p"), SPEC, src) as server:
        yield server, src


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"curve": "abc"}, CURVE_TYPE.format("str")),
    ({"curve": b"k" * 40}, CURVE_TYPE.format("bytes")),
    ({"telemetry": "no"}, "'telemetry' must be a bool (got 'no')"),
    ({"telemetry": 1}, "'telemetry' must be a bool (got 1)"),
    ({"timeout": float("nan")}, SECONDS.format("timeout", float("nan"))),
    ({"timeout": float("inf")}, SECONDS.format("timeout", float("inf"))),
    ({"timeout": -1}, SECONDS.format("timeout", -1)),
    ({"timeout": 0}, SECONDS.format("timeout", 0)),
    ({"timeout": True}, SECONDS.format("timeout", True)),
])
def test_connect_refuses_bad_arguments_up_front(prefill, kwargs: dict, message: str) -> None:
    server, _ = prefill
    with pytest.raises(FkvError) as e:
        connect(engine("d"), SPEC, fkv.allocate(SPEC), remote_address=server.address,
                **kwargs).close()
    assert str(e.value) == message


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), float("-inf"), 0, -2.5, "1"])
def test_read_and_reconnect_refuse_timeouts_that_never_or_already_expire(prefill,
                                                                          timeout: object) -> None:
    server, src = prefill
    dst = fkv.allocate(SPEC)
    with connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, dst, remote_address=server.address
                 ) as client:
        server.hold("t1", [3, 1], lease=5.0)
        with pytest.raises(FkvError) as e:
            client.read("t1", [0, 5], [3, 1], timeout=timeout)
        assert str(e.value) == SECONDS.format("timeout", timeout)
        with pytest.raises(FkvError) as e:
            client.reconnect(timeout=timeout)
        assert str(e.value) == SECONDS.format("timeout", timeout)
        result = client.read("t1", [0, 5], [3, 1])  # still connected, nothing moved before
        assert result.ok, result.error
    assert torch.equal(dst[1][0], src[1][3]) and torch.equal(dst[1][5], src[1][1])


class HostEvent:
    """An event the host can query and wait for, but no CUDA stream can wait on."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "HostEvent()"


@pytest.mark.gpu
def test_publish_on_cuda_takes_a_cuda_event_and_refuses_what_a_stream_cannot_wait_on() -> None:
    """On CUDA caches with interprocess publish events, the event is also waited on by this
    rank's stream (``wait()``): an object without it is refused before the request changes."""
    spec = SPEC.evolve(num_layers=3)
    caches = fkv.allocate(spec, "cuda")
    with serve(engine("p"), spec, caches) as server:
        assert server.ipc_reason == "" and list(server.errors) == []  # publish events made
        server.hold("s1", [5], layers_ready=0)
        for event, shown in (("x", "'x'"), (HostEvent(), "HostEvent()")):
            with pytest.raises(FkvError) as e:
                server.publish("s1", 2, event=event)
            assert str(e.value) == (
                f"'event' must be None or a torch.cuda.Event (an object with its query(), "
                f"synchronize() and wait() methods) (got {shown}); record one after the layers' "
                f"writes: event = torch.cuda.Event(); event.record()")
            assert server.layers_ready("s1") == 0
        caches[0].fill_(1.0)
        event = torch.cuda.Event()
        event.record()
        server.publish("s1", 1, event=event)
        event.synchronize()
        deadline = time.monotonic() + 10.0
        while server.layers_ready("s1") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.layers_ready("s1") == 1
        server.publish("s1", 3)
        assert server.layers_ready("s1") == 3
        assert list(server.errors) == []


# -- caches whose spec fkv.infer_spec derived: a size-1 dim's stride is never compared ---------

@pytest.mark.parametrize(("total_heads", "decode_tp", "block_size", "inferred"), [
    (2, 2, 4, "decode"),   # one head per decode rank: its HND cache is inferred NHD
    (1, 1, 4, "prefill"),  # one head in all (MQA): the prefill's HND cache is inferred NHD
    (2, 1, 1, "both"),     # one token per block: NHD == HND on both sides
])
def test_serve_and_connect_take_the_spec_infer_spec_derives_when_a_dim_has_size_1(
        total_heads: int, decode_tp: int, block_size: int, inferred: str) -> None:
    p_spec = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=block_size,
                             num_kv_heads=total_heads, head_size=8, num_layers=2)
    d_spec = p_spec.evolve(num_kv_heads=total_heads // decode_tp)
    src, dst = fkv.allocate(p_spec), fkv.allocate(d_spec)
    for layer in src:
        layer.copy_(torch.randn(layer.shape))
    if inferred in ("prefill", "both"):
        p_spec = fkv.infer_spec(src[0], backend="triton", num_layers=2)
        assert p_spec.layout is fkv.Layout.NHD  # the strides cannot tell: NHD, the same bytes
    if inferred in ("decode", "both"):
        d_spec = fkv.infer_spec(dst[0], backend="triton", num_layers=2)
        assert d_spec.layout is fkv.Layout.NHD
    prefill = EngineDesc(engine_id="p1", tp_size=1, tp_rank=0, total_num_kv_heads=total_heads)
    decode = EngineDesc(engine_id=f"d{next(_DECODE_IDS)}", tp_size=decode_tp,
                        tp_rank=decode_tp - 1, total_num_kv_heads=total_heads)
    blocks = 2 if block_size == 1 else 1  # whole tokens either way
    with serve(prefill, p_spec, src) as server, connect(decode, d_spec, dst,
                                                        remote_address=server.address) as client:
        server.hold("one", [3, 1][:blocks])
        result = client.read("one", [0, 5][:blocks], [3, 1][:blocks])
        assert result.ok, result.error
    heads = slice(total_heads - total_heads // decode_tp, total_heads)  # the last rank's heads
    for layer in range(2):
        for d, s in list(zip([0, 5], [3, 1]))[:blocks]:
            assert torch.equal(dst[layer][d], src[layer][s][:, :, heads])


def test_a_full_prefix_hit_only_notifies_and_the_prefill_releases_the_request(prefill) -> None:
    """Both id lists empty: the decode rank has every token already. No READ, nothing written;
    the prefill ranks are notified and release the request; ``strategy`` says ``"none"``."""
    server, _ = prefill
    dst = fkv.allocate(SPEC)
    for layer in dst:
        layer.fill_(7.0)
    with connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, dst, remote_address=server.address
                 ) as client:
        server.hold("hit", [3, 1], lease=30.0)
        result = client.read("hit", [], [])
        assert (result.ok, result.bytes, result.descriptors, result.strategy, result.error) == \
            (True, 0, 0, "none", None)
        assert len(result.layer_seconds) == SPEC.num_layers
        deadline = time.monotonic() + 10.0
        while "hit" in server.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.released().get("hit") == "notified"
        stats = client.stats()["paths"]["none"]
        assert stats["count"] == 1 and stats["bytes"]["sum"] == 0 and stats["gbps"]["count"] == 0
        with pytest.raises(FkvError) as e:
            client.read("hit2", [], [1])
        assert str(e.value) == ("block id lists must both be empty or both non-empty (local 0, "
                                "remote 1 blocks); nothing was transferred")
    assert all(bool((layer == 7.0).all()) for layer in dst)
