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

import msgspec
import numpy as np
import pytest
import torch

import fkv
from fkv.connector import CurveKeys, EngineDesc, connect, curve_keypair, serve
from fkv.errors import FkvError

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared fakes
from _fake_prefill import FakePrefill  # noqa: E402

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
        server.hold("r1", [2, 5], lease=60.0)  # nothing of the refused hold was recorded
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
    ({"staging_bytes": -1}, "'staging_bytes' must be a non-negative int (got -1)"),
    ({"staging_bytes": True}, "'staging_bytes' must be a non-negative int (got True)"),
    ({"staging_bytes": 1.5}, "'staging_bytes' must be a non-negative int (got 1.5)"),
    ({"pack_threshold": -1}, "'pack_threshold' must be a non-negative int (got -1)"),
    ({"pack_threshold": False}, "'pack_threshold' must be a non-negative int (got False)"),
    ({"strategy": "fast"}, "'strategy' must be one of ('auto', 'ipc', 'nixl', 'packed', 'direct', "
                           "'staging') (got 'fast')"),
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
    with _decode(server, dst) as client:
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
    dst = _sevens()
    with _decode(server, dst) as client:
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


# -- holes found by the _client mutation audit (2026-12-04) ----------------------------------------

@pytest.mark.parametrize("address", [5, None, b"tcp://127.0.0.1:1"])
def test_connect_refuses_an_address_that_is_not_a_str(address: object) -> None:
    with pytest.raises(FkvError) as e:
        connect(engine("d"), SPEC, fkv.allocate(SPEC), remote_address=address, timeout=2.0)
    assert str(e.value) == (f"'remote_address' must be a str like 'tcp://127.0.0.1:5555' "
                            f"(got {address!r})")


def test_connect_takes_a_zero_staging_buffer_and_pack_threshold(prefill) -> None:
    """0 is a non-negative int: no staging buffer, pack every request (where packing applies)."""
    server, src = prefill
    dst = fkv.allocate(SPEC)
    with _decode(server, dst, staging_bytes=0, pack_threshold=0) as client:
        server.hold("z1", [2], lease=5.0)
        result = client.read("z1", [6], [2])
        assert result.ok, result.error
    assert all(torch.equal(dst[i][6], src[i][2]) for i in range(SPEC.num_layers))


@pytest.mark.parametrize("request_id", ["", 5, None, b"r", ["r"]])
def test_read_refuses_a_request_id_that_is_not_a_non_empty_str(prefill,
                                                                request_id: object) -> None:
    server, _ = prefill
    dst = _sevens()
    with _decode(server, dst) as client:
        server.hold("q1", [3], lease=5.0)
        with pytest.raises(FkvError) as e:
            client.read(request_id, [0], [3])
        assert str(e.value) == f"'request_id' must be a non-empty str (got {request_id!r})"
        assert client.stats()["paths"] == {} and client.stats()["failures"] == {}
    assert all(bool((layer == 7.0).all()) for layer in dst)


_WHO = "prefill rank 1 of engine 'p' (agent-p1)"


@pytest.mark.parametrize(("error", "kind"), [
    (f"READ from {_WHO} did not finish before the read's timeout: the prefill process is hung, "
     f"dead or unreachable", "timeout"),
    # the plan path's wrapping of that timeout also says the process may have died: a timeout
    (f"prefill rank 1 of engine 'p': READ from {_WHO} did not finish before the read's timeout: "
     f"the prefill process is hung, dead or unreachable; the prefill process may have died: "
     f"reconnect once it is back (client.reconnect())", "timeout"),
    ("prefill rank 0 of engine 'p': the pack buffer stayed busy until the read's timeout (busy)",
     "timeout"),
    (f"READ from {_WHO} failed (NIXL state ERR): the prefill process may have died: reconnect "
     f"once it is back (client.reconnect())", "peer_failed"),
    ("prefill engine 'p': prefill process 4242 exited during the read", "peer_failed"),
    ("prefill rank 1 of engine 'p': boom; the prefill process may have died: reconnect once it "
     "is back (client.reconnect())", "peer_failed"),
    ("prefill rank 0 of engine 'p': pack refused: 'layers' must be ...", "refused"),
    ("prefill rank 0 of engine 'p': pack failed on prefill rank 0: RuntimeError: x", "refused"),
    ("prefill side channel at tcp://127.0.0.1:1: no reply within 1 s", "other"),
])
def test_failure_kind_names_the_reason_of_each_failure_text(error: str, kind: str) -> None:
    """The telemetry reason (``stats()["failures"]``) of a failed read, from its error text:
    a timeout first (a wrapped timeout also says the process may have died), then a dead peer,
    then a refusal, else "other"."""
    from fkv.connector.transport._client import failure_kind

    assert failure_kind(error) == kind


def test_read_refuses_a_repeated_local_block_before_anything_moves(prefill) -> None:
    """Two remote blocks into one local block would land two tokens in one slot: refused
    before any READ (a repeated *remote* block is a legal read)."""
    server, src = prefill
    dst = _sevens()
    with _decode(server, dst) as client:
        server.hold("dup1", [3, 1], lease=5.0)
        with pytest.raises(FkvError) as e:
            client.read("dup1", [4, 4], [3, 1])
        assert str(e.value) == ("'local_block_ids' repeats block 4: two tokens would land in one "
                                "slot; pass each local block once; nothing was transferred")
        assert all(bool((layer == 7.0).all()) for layer in dst)
        result = client.read("dup1", [4, 5], [3, 3])
        assert result.ok, result.error
    assert all(torch.equal(dst[i][4], src[i][3]) and torch.equal(dst[i][5], src[i][3])
               for i in range(SPEC.num_layers))


def _sevens() -> list:
    """Decode caches of SPEC filled with 7.0 (a read that writes nothing leaves them so)."""
    dst = fkv.allocate(SPEC)
    for layer in dst:
        layer.fill_(7.0)
    return dst


def _random(spec) -> list:
    """Prefill caches of ``spec`` filled with normal random values."""
    src = fkv.allocate(spec)
    for layer in src:
        layer.copy_(torch.randn(layer.shape))
    return src


def _decode(server, dst, **kwargs):
    """A decode client of a new engine id on ``dst``, connected to ``server``."""
    return connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, dst, remote_address=server.address,
                   **kwargs)


def _rank(rank: int, engine_id: str = "p", tp: int = 2, spec=SPEC):
    from fkv.connector import wire
    from fkv.connector.transport import _side

    peer = wire.encode(EngineDesc(engine_id=engine_id, tp_size=tp, tp_rank=rank,
                                  total_num_kv_heads=2 * tp),
                       spec, [((1 << 30) + i * spec.region_bytes, spec.region_bytes)
                             for i in range(spec.num_regions)], agent_metadata=b"\0" * 64)
    return _side.RankEntry(peer=peer, mem_type="DRAM")


def _connect_to(address: str, timeout: float = 10.0):
    return connect(engine("d"), SPEC, fkv.allocate(SPEC), remote_address=address, timeout=timeout)


def test_connect_refuses_ranks_listed_out_of_order() -> None:
    from fkv.connector.transport import SideChannelError, _side

    with FakePrefill(lambda i: _side.Ranks(ranks=[_rank(1), _rank(0)])) as fake:
        with pytest.raises(SideChannelError) as e:
            _connect_to(fake.address)
        assert str(e.value) == (f"prefill side channel at {fake.address} listed ranks [1, 0] out "
                                f"of order")
        assert fake.fetches == 1


def test_connect_refuses_ranks_that_disagree_naming_every_reason() -> None:
    from fkv.connector.transport import HandshakeRejected, _side

    with FakePrefill(lambda i: _side.Ranks(ranks=[_rank(0), _rank(1, engine_id="q")])) as fake:
        with pytest.raises(HandshakeRejected) as e:
            _connect_to(fake.address)
        assert str(e.value).startswith(f"prefill side channel at {fake.address}: its ranks "
                                       f"disagree:\n  - ")
        assert [r.path for r in e.value.reasons] == ["remote[1].engine.engine_id"], e.value.reasons


def test_connect_asks_again_while_ranks_join_and_not_after_a_refusal() -> None:
    """A retry Error (ranks still joining) is asked again until the Ranks come (here: out of
    order, refused with that error); a plain Error fails the connect at once, its text kept."""
    from fkv.connector.transport import SideChannelError, _side

    joining = _side.Error(message="ranks [1] of tp_size 2 have not joined yet", retry=True)
    with FakePrefill(lambda i: joining if i < 3 else _side.Ranks(ranks=[_rank(1), _rank(0)])
                   ) as fake:
        with pytest.raises(SideChannelError, match="listed ranks \\[1, 0\\] out of order"):
            _connect_to(fake.address)
        assert fake.fetches == 4
    with FakePrefill(lambda i: _side.Error(message="go away")) as fake:
        with pytest.raises(SideChannelError) as e:
            _connect_to(fake.address)
        assert str(e.value) == f"prefill side channel at {fake.address}: go away"
        assert fake.fetches == 1
    with FakePrefill(lambda i: _side.Ok(engine_id="p")) as fake:
        with pytest.raises(SideChannelError) as e:
            _connect_to(fake.address)
        assert str(e.value) == (f"prefill side channel at {fake.address}: "
                                f"{_side.Ok(engine_id='p')!r}")
        assert fake.fetches == 1


@pytest.mark.timeout(60)
def test_connect_stops_asking_a_rank_0_that_says_retry_for_ever_at_its_timeout() -> None:
    from fkv.connector.transport import SideChannelError, _side

    joining = _side.Error(message="ranks [1] of tp_size 2 have not joined yet", retry=True)
    with FakePrefill(lambda i: joining) as fake:
        with pytest.raises(SideChannelError) as e:
            _connect_to(fake.address, timeout=0.5)
        assert str(e.value) == (f"prefill side channel at {fake.address}: ranks [1] of tp_size 2 "
                                f"have not joined yet")


def test_a_read_maps_tokens_across_different_block_sizes() -> None:
    """Remote blocks of 8 tokens, local blocks of 4: token ``i`` comes from remote block
    ``rids[i // 8]`` and lands in local block ``lids[i // 4]`` (each list's own block size)."""
    p_spec = SPEC.evolve(block_size=8, num_blocks=4)
    src, dst = _random(p_spec), _sevens()
    with serve(engine("p8"), p_spec, src) as server, _decode(server, dst) as client:
        server.hold("bs", [3, 1], lease=5.0)
        result = client.read("bs", [5, 0, 6], [3, 1], num_tokens=12)
        assert result.ok, result.error
        with pytest.raises(FkvError) as e:
            client.read("bs", [5, 0], [3, 1])
        assert str(e.value) == ("local_block_ids has 2 blocks of 4 tokens and remote_block_ids 2 "
                                "blocks of 8; 8 tokens need 2 local and 1 remote blocks: pass the "
                                "blocks of the same tokens on both sides; nothing was transferred")
    for i in range(SPEC.num_layers):
        assert torch.equal(dst[i][5], src[i][3][:, :4]) and torch.equal(dst[i][0], src[i][3][:, 4:])
        assert torch.equal(dst[i][6], src[i][1][:, :4])
        assert bool((dst[i][[1, 2, 3, 4, 7]] == 7.0).all())


def test_reconnect_goes_to_the_new_address_and_a_failed_one_keeps_the_last_good_address(
        prefill) -> None:
    """``reconnect(address)`` connects there (and remembers it); a reconnect that fails leaves
    the client disconnected (reads say so) with the address it last connected to, where a plain
    ``reconnect()`` goes back."""
    import socket

    from fkv.connector.transport import SideChannelError

    server_a, _ = prefill
    src_b = fkv.allocate(SPEC)
    for layer in src_b:
        layer.copy_(torch.randn(layer.shape))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    dst = fkv.allocate(SPEC)
    with serve(engine("pb"), SPEC, src_b) as server_b, \
            connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, dst, remote_address=server_a.address
                    ) as client:
        assert client.peers[0].engine.engine_id == "p"
        client.reconnect(server_b.address)
        assert client.address == server_b.address
        assert client.peers[0].engine.engine_id == "pb"
        server_b.hold("rb", [2], lease=5.0)
        result = client.read("rb", [1], [2])
        assert result.ok, result.error
        assert all(torch.equal(dst[i][1], src_b[i][2]) for i in range(SPEC.num_layers))
        with pytest.raises(SideChannelError):
            client.reconnect(dead, timeout=0.5)
        assert client.address == server_b.address
        with pytest.raises(FkvError) as e:
            client.read("rb", [1], [2])
        assert str(e.value) == ("the client is not connected (a previous reconnect failed or it "
                                "was closed): call reconnect()")
        client.reconnect()
        assert client.address == server_b.address and client.peers[0].engine.engine_id == "pb"
        server_b.hold("rb2", [3], lease=5.0)
        result = client.read("rb2", [4], [3])
        assert result.ok, result.error
        assert all(torch.equal(dst[i][4], src_b[i][3]) for i in range(SPEC.num_layers))


def test_a_connect_that_fails_closes_what_it_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connect releases its NIXL agent and ZMQ context (``close``) before raising."""
    from fkv.connector.transport import SideChannelError, _side
    from fkv.connector.transport._client import Client

    closed: list[tuple[object, object]] = []
    real_close = Client.close

    def close(self: Client) -> None:
        agent, zctx = self._agent, self._zctx
        real_close(self)
        closed.append((agent is not None and agent._agent is None and self._agent is None,
                       zctx is not None and zctx.closed and self._zctx is None))

    monkeypatch.setattr(Client, "close", close)
    with FakePrefill(lambda i: _side.Error(message="go away")) as fake:
        with pytest.raises(SideChannelError):
            _connect_to(fake.address)
    assert closed == [(True, True)]


def test_a_reads_result_matches_what_its_telemetry_recorded(prefill) -> None:
    """``ReadResult``'s bytes, descriptors, seconds and the per-stage waits are the ones the
    client's telemetry recorded for the read (a direct read packs nothing: ``pack_seconds`` 0);
    every layer is reported landed at the end of a whole read."""
    server, _ = prefill
    with connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, fkv.allocate(SPEC),
                 remote_address=server.address) as client:
        server.hold("tm", [2, 6], lease=5.0)
        r = client.read("tm", [3, 4], [2, 6])
        assert r.ok, r.error
        (path, stats), = client.stats()["paths"].items()
        assert path == r.strategy
        assert (r.bytes, r.descriptors) == (stats["bytes"]["sum"], stats["descriptors"]["sum"])
        assert r.bytes == 2 * 2 * (2 * 4 * 2 * 8) * 2  # blocks * layers * K+V elements * bf16
        assert r.seconds == stats["seconds"]["sum"]
        assert r.transfer_seconds == stats["waits"]["transfer"]["sum"] > 0
        assert r.pack_seconds == stats["waits"]["pack"]["sum"] == 0.0
        assert r.layer_seconds == (r.seconds,) * SPEC.num_layers


@pytest.mark.parametrize("strategy", ["direct", "packed"])
def test_a_failed_read_names_its_path_and_counts_one_failure_by_reason(strategy: str) -> None:
    """A read from a prefill that closed fails (``ok=False``, the error) on the path it took,
    counted once under its reason; no read is recorded as done."""
    from fkv.connector.transport._client import failure_kind

    src, dst = fkv.allocate(SPEC), fkv.allocate(SPEC)
    for layer in src:
        layer.copy_(torch.randn(layer.shape))
    server = serve(engine("pc"), SPEC, src)
    with connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, dst, remote_address=server.address,
                 strategy=strategy) as client:
        server.hold("gone", [2], lease=30.0)
        server.close()
        r = client.read("gone", [5], [2], timeout=2.0)
        assert (r.ok, r.strategy) == (False, strategy), r
        assert r.error, r
        assert client.stats()["failures"] == {failure_kind(r.error): 1}
        assert client.stats()["paths"] == {}


def test_a_reconnect_that_fails_after_loading_a_peers_metadata_replaces_the_nixl_agent(
        prefill) -> None:
    """A rank 0 listing a real rank (its NIXL metadata) that then refuses the Hello fails the
    reconnect after the metadata was loaded: the client drops that agent for a fresh one
    (registration included), and the next reconnect reads as before."""
    from fkv.connector.transport import SideChannelError, _side
    from fkv.connector.transport._sidelimits import frame_request

    server, src = prefill
    ranks = _side.decode_reply(frame_request(server.address, _side.encode_message(_side.Fetch()),
                                             timeout=10.0, max_frame=_side.MAX_SIDE_MESSAGE_BYTES))
    dst = fkv.allocate(SPEC)
    with _decode(server, dst) as client:
        with FakePrefill(lambda i: _side.Ranks(ranks=[msgspec.structs.replace(
                           ranks.ranks[0], address=fake.address)]),
                       other=lambda msg: _side.Error(message="not you")) as fake:
            agent = client._agent
            with pytest.raises(SideChannelError) as e:
                client.reconnect(fake.address, timeout=5.0)
            assert str(e.value) == ("prefill rank 0 of engine 'p' refused this decode rank's "
                                    "hello: not you")
            assert client._agent is not agent and agent._agent is None
        client.reconnect(server.address)
        server.hold("fa", [5], lease=5.0)
        result = client.read("fa", [2], [5])
        assert result.ok, result.error
    assert all(torch.equal(dst[i][2], src[i][5]) for i in range(SPEC.num_layers))


@pytest.mark.parametrize("layers", [SPEC.num_layers + 1, 1 << 16])
def test_a_streamed_read_refuses_a_prefill_announcing_more_layers_than_its_spec(
        prefill, layers: int) -> None:
    """A prefill rank answering the layer status with more layers published than its spec has
    fails the read naming the count; nothing is reported as done and no block is written."""
    from fkv.connector.transport import _side
    from fkv.connector.transport._sidelimits import frame_request

    server, _ = prefill
    ranks = _side.decode_reply(frame_request(server.address, _side.encode_message(_side.Fetch()),
                                             timeout=10.0, max_frame=_side.MAX_SIDE_MESSAGE_BYTES))

    def other(msg):
        if isinstance(msg, _side.Status):
            return _side.Layers(token=msg.token, layers_ready=layers, held=True)
        return _side.Ok(engine_id="p")

    dst = _sevens()
    with FakePrefill(lambda i: _side.Ranks(ranks=[msgspec.structs.replace(
                       ranks.ranks[0], address=fake.address)]), other=other) as fake, \
            connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, dst, remote_address=fake.address,
                    strategy="direct") as client:
        r = client.read("more", [1, 2], [3, 5], timeout=5.0, stream=True)
        assert (r.ok, r.bytes, r.layer_seconds) == (False, 0, ()), r
        assert r.error == (f"streaming request 'more': prefill engine 'p' announced {layers} "
                           f"layers published of the {SPEC.num_layers} its spec has; nothing is "
                           f"reported as done")
    assert all(bool((layer == 7.0).all()) for layer in dst)


@pytest.mark.parametrize(("local", "remote", "path"), [([], [], "none"), ([6], [4], "direct")])
def test_a_read_whose_notification_fails_is_not_reported_done(
        prefill, monkeypatch: pytest.MonkeyPatch, local: list, remote: list, path: str) -> None:
    """The prefill ranks are told after the last byte; when that fails the read fails (its
    error, one failure counted, no read recorded), a full prefix hit included."""
    from fkv.connector.transport import TransferFailed

    server, _ = prefill
    with connect(engine(f"d{next(_DECODE_IDS)}"), SPEC, fkv.allocate(SPEC),
                 remote_address=server.address, strategy="direct") as client:
        told: list[tuple[tuple[int, ...], bytes]] = []

        def notify(ranks, message):
            told.append((tuple(ranks), message))
            raise TransferFailed("notification to prefill rank 0 refused")

        monkeypatch.setattr(client._state.link, "notify", notify)
        server.hold("nf", [4], lease=5.0)
        r = client.read("nf", local, remote)
        assert (r.ok, r.strategy, r.error) == (False, path, "notification to prefill rank 0 "
                                                            "refused"), r
        assert [ranks for ranks, _ in told] == [(0,)]
        assert client.stats()["failures"] == {"refused": 1} and client.stats()["paths"] == {}


def test_a_full_prefix_hit_notifies_the_notify_only_ranks_too() -> None:
    """MLA, a 2-rank prefill engine read by one decode rank: it reads rank 0 and only
    notifies rank 1. A full prefix hit tells both, and both release the request."""
    spec = fkv.KVCacheSpec(backend="mla", num_blocks=8, block_size=4, num_kv_heads=1,
                           head_size=32, num_layers=2)
    prefill = [EngineDesc(engine_id="p2", tp_size=2, tp_rank=r, total_num_kv_heads=1)
               for r in range(2)]
    decode = EngineDesc(engine_id=f"d{next(_DECODE_IDS)}", tp_size=1, tp_rank=0,
                        total_num_kv_heads=1)
    with serve(prefill[0], spec, fkv.allocate(spec)) as rank0, \
            serve(prefill[1], spec, fkv.allocate(spec), join=rank0.address) as rank1, \
            connect(decode, spec, fkv.allocate(spec), remote_address=rank0.address) as client:
        assert (client.plan.remote_ranks, client.plan.notify_only_ranks) == ((0,), (1,))
        for server in (rank0, rank1):
            server.hold("hit", [3], lease=30.0)
        result = client.read("hit", [], [])
        assert (result.ok, result.strategy) == (True, "none"), result
        deadline = time.monotonic() + 10.0
        while (rank0.pending() or rank1.pending()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (rank0.released().get("hit"), rank1.released().get("hit")) == \
            ("notified", "notified")


def test_a_streamed_read_from_a_cross_layer_prefill_waits_for_every_layer() -> None:
    """A cross-layer prefill cache (one buffer of all layers) moves as a whole: a streamed read
    of a request with 1 of 2 layers published fails at its timeout naming the missing layer,
    nothing reported done; once every layer is published the read lands it all."""
    p_spec = SPEC.evolve(backend="flash_attn", cross_layer=True)
    src, dst = _random(p_spec), _sevens()
    with serve(engine("px"), p_spec, src) as server, \
            _decode(server, dst, strategy="direct") as client:
        server.hold("half", [3, 1], lease=30.0, layers_ready=1)
        r = client.read("half", [0, 5], [3, 1], timeout=1.0, stream=True)
        assert (r.ok, r.bytes, r.layer_seconds) == (False, 0, ()), r
        assert r.error == ("streaming request 'half': no layer landed, layer 0 of 2 was not "
                           "published by prefill engine 'px' before the read's timeout; the read "
                           "is not complete and nothing is reported as done")
        assert all(bool((layer == 7.0).all()) for layer in dst)
        server.publish("half", 2)
        r = client.read("half", [0, 5], [3, 1], timeout=10.0, stream=True)
        assert r.ok and len(r.layer_seconds) == 2 and r.bytes == 2 * 2 * 256, r
    assert all(not bool((dst[i][b] == 7.0).all()) for i in range(2) for b in (0, 5))
    assert all(bool((dst[i][[1, 2, 3, 4, 6, 7]] == 7.0).all()) for i in range(2))
