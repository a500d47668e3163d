"""Hostile and faulty peers (issue 12): real processes, real NIXL and the side channel, on CPU.

Two kinds of attacker, each against a real fkv process (``tests/_transport_worker.py``):

- a **fake prefill rank** (:class:`FakePrefill`, a side-channel server in this process answering
  ``Fetch`` with crafted ``Ranks``, ``Hello`` with ``Ok`` and ``Pack`` with crafted or no replies)
  against a real decode worker: corrupt NIXL metadata (the 0xff UCX address version, the remote
  keys that once killed a decode worker, and >= 1000 seeded mutations), huge and coprime
  geometry, bad pack replies and pack replies that never come;
- a **fake decode client** against a real prefill worker: double, foreign, impersonating,
  unknown, malformed and failed notifications (raw NIXL notifications from a real reader's agent
  or from a fresh agent that added the prefill's metadata), oversized and many-frame side-channel
  messages, connection floods, and a re-Publish of another prefill rank.

Each case asserts a clear FkvError (or a refused, counted message), that the attacked process
still serves afterwards, that no block was freed before its expected readers finished, and that
the attacked process's RSS grew less than 64 MiB. ``test_zz_summary`` prints the counts
(``pytest -s``); README.md's "Reliability" section quotes them.
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

# the transport tests' harness (pytest runs with --import-mode=importlib)
sys.path.insert(0, str(Path(__file__).parent))
from _fake_prefill import FakePrefill  # noqa: E402
from test_metadata_probe import mutations  # noqa: E402
from test_transport import (  # noqa: E402
    HEADS,
    SEED,
    TCP_LO,
    Pair,
    Proc,
    _counter,
    engine_dict,
    request_blocks,
    spec_dict,
    worker_procs,
)

from fkv.connector.transport import _metadata as M  # noqa: E402
from fkv.connector.transport import _side  # noqa: E402
from fkv.connector.transport._lifecycle import notification  # noqa: E402
from fkv.connector.transport._sidelimits import (  # noqa: E402
    FrameDecoder,
    encode_frame,
    frame_request,
)
from fkv.connector.wire import decode_untrusted, encode  # noqa: E402

pytestmark = pytest.mark.transport

MiB = 1 << 20
RSS_LIMIT = 64 * MiB
#: what the suite tried and how it ended (printed by test_zz_summary)
TALLY: dict[str, Any] = {"mutations": collections.Counter(), "refused": collections.Counter()}


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from worker_procs(tmp_path_factory.mktemp("hostile"), "h", 2, 2)


def rss(proc: Proc) -> int:
    return proc.call("rss")["rss"]


def poll(fn: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    """``fn()`` until truthy (returned) or ``timeout`` (AssertionError with the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            assert value, f"{what} not reached within {timeout} s: {value!r}"
            return value
        time.sleep(0.02)


def fetch_ranks(address: str) -> list[_side.RankEntry]:
    raw = frame_request(address, _side.encode_message(_side.Fetch()), timeout=10.0,
                        max_frame=_side.MAX_SIDE_MESSAGE_BYTES)
    reply = _side.decode_reply(raw)
    assert isinstance(reply, _side.Ranks), reply
    return list(reply.ranks)


def ask(address: str, msg: Any) -> Any:
    return _side.decode_reply(frame_request(address, _side.encode_message(msg), timeout=10.0,
                                            max_frame=_side.MAX_SIDE_MESSAGE_BYTES))


def crafted(entry: _side.RankEntry, address: str, *, spec: Any = None,
            metadata: bytes | None = None) -> _side.RankEntry:
    """A real rank's entry with its wire bytes re-encoded: another spec (regions laid out
    contiguously from the real first region) and/or other NIXL metadata; pack requests and
    Hello go to ``address`` (the fake)."""
    peer = decode_untrusted(entry.peer)
    regions = peer.regions
    if spec is not None and spec != peer.spec:
        base = peer.regions[0][0]
        regions = [(base + i * spec.region_bytes, spec.region_bytes)
                   for i in range(spec.num_regions)]
    wire = encode(peer.engine, spec or peer.spec, regions, device_id=peer.device_id,
                  agent_metadata=peer.agent_metadata if metadata is None else metadata,
                  ipc=peer.ipc)
    return msgspec.structs.replace(entry, peer=wire, address=address)


def widen(blob: bytes, base: int, nbytes: int) -> bytes:
    """The NIXL metadata with its descriptor at ``base`` announcing ``nbytes`` (so the huge
    regions of a crafted spec are "registered" and connect gets past the coverage check)."""
    for section in M.parse_agent_metadata(blob).sections:
        for a, n, _ in section.descs:
            if a == base:
                old = a.to_bytes(8, "little") + n.to_bytes(8, "little")
                assert blob.count(old) == 1
                return blob.replace(old, a.to_bytes(8, "little") + nbytes.to_bytes(8, "little"))
    raise AssertionError(f"no descriptor at 0x{base:x}")


def serve(P: Proc, spec: dict[str, Any], **kw: Any) -> tuple[str, str]:
    name = f"h{next(_counter)}"
    address = P.call("serve", name=name, spec=spec, engine=engine_dict(f"P-{name}", 1, 0),
                     seed=SEED, **kw)["address"]
    return name, address


# -- fake prefill rank vs a real decode worker -----------------------------------------------------

def rkey_regressions(blob: bytes) -> list[tuple[str, bytes]]:
    """Blobs that passed the structural check and the probe and then killed the decode worker
    (SIGSEGV in ``add_remote_agent``: UCX's remote-key unpack indexes its tables with the key's
    memory-type byte, unchecked, and what it reads there differs between the probe child and the
    decode process): a campaign's seed-2 overwrite (0x9f), and 109 and 115 from a sweep of that
    byte on descriptor 0. The structural walk of the remote key refuses them now."""
    out = []
    for d, (a, n, _) in enumerate(M.parse_agent_metadata(blob).sections[0].descs):
        at = blob.index(a.to_bytes(8, "little") + n.to_bytes(8, "little")) + 24 + 8
        for value in ((0x9F, 109, 115) if d == 0 else (0x9F,)):
            b = bytearray(blob)
            b[at] = value
            out.append((f"regression: descriptor {d} remote key memory type {value}", bytes(b)))
    return out


def test_corrupt_metadata_never_kills_the_decode_worker(procs: Any) -> None:
    """The 0xff UCX address version, the remote keys that once killed a decode worker, and >= 1000
    seeded mutations of a real prefill's NIXL metadata, served by a fake rank 0: every connect
    of a real decode worker raises FkvError or connects (the blob was harmless); the worker
    lives through all of them, its RSS grows < 64 MiB, and it then connects to the real prefill
    and reads bit for bit."""
    P = procs["P"][0]
    spec = spec_dict(tp=1)
    name, address = serve(P, spec)
    fake = victim = None
    try:
        real = fetch_ranks(address)[0]
        blob = decode_untrusted(real.peer).agent_metadata
        start, _ = M.parse_agent_metadata(blob).conn_spans[0]
        ff = bytearray(blob)
        ff[start] = 0xFF
        fixed = [("0xff version", bytes(ff)), *rkey_regressions(blob)]
        cases = fixed + mutations(blob, seed=1212)
        assert len(cases) >= 1000
        entries = [crafted(real, "", metadata=b) for _, b in cases]
        fake = FakePrefill(lambda i: _side.Ranks(
            ranks=[msgspec.structs.replace(entries[i], address=fake.address)]))
        # The campaign runs in a decode worker of its own (a death fails the test, naming the
        # batch). It checks every blob first, in one batch, preparing what its connects prepare
        # (the cache key connect looks up): the connects that follow start no probe child.
        # Each connect loads the blob into the worker's own NIXL agent when the checks pass.
        victim = Proc("hDv", procs["logdir"])
        victim.call("ping", wait=120)
        victim.call("connect", name=name, spec=spec, address=address,
                    engine=engine_dict(f"D-{name}", 1, 0), strategy="direct")
        before = rss(victim)
        t0 = time.perf_counter()
        victim.call("precheck", blobs=[b.hex() for _, b in cases], like=name, timeout=300.0,
                    wait=360)
        precheck_s = time.perf_counter() - t0
        outcomes, worst, grew = [], 0.0, 0
        t0 = time.perf_counter()
        for first in range(0, len(cases), 100):
            n = min(100, len(cases) - first)
            fake.fetches = first  # the fake serves blob i at its i-th fetch
            try:
                out = victim.call("reconnect_many", name=name, address=fake.address, n=n,
                                  timeout=10.0, chars=200, wait=300)
            except AssertionError as e:
                kinds = sorted({k for k, _ in cases[first:first + n]})
                raise AssertionError(f"the decode worker died in blobs {first}..{first + n - 1} "
                                     f"({kinds})") from e
            outcomes += out["outcomes"]
            worst = max(worst, out["worst"])
            grew = max(grew, rss(victim) - before)
        connect_s = time.perf_counter() - t0
        bad = [o for o in outcomes if o != "connected" and not o.startswith("FkvError: ")]
        assert not bad, bad[:5]
        assert "UCX worker address" in outcomes[0] and "has version 15" in outcomes[0]
        for (kind, _), o in zip(fixed[1:], outcomes[1:len(fixed)], strict=True):
            assert "UCX remote key" in o and "memory type" in o, (kind, o)
        assert worst < 10.0, worst
        refused = sum(o.startswith("FkvError: ") for o in outcomes)
        assert refused > 500 and grew < RSS_LIMIT, (refused, grew)
        why = collections.Counter(
            "connected (harmless)" if o == "connected" else
            "probe: the child died" if "kills the process" in o else
            "probe: NIXL refused it" if "NIXL refused it" in o else
            "add_remote: NIXL refused it" if "NIXL refused the peer's agent metadata" in o else
            "region not registered" if "does not register" in o else
            "agent name not UTF-8 / printable" if "'agent name' must be" in o else
            "prep: NIXL refused the descriptors" if "could not prepare" in o else
            "structure: UCX worker address" if "UCX worker address" in o else
            "structure: UCX remote key" if "UCX remote key" in o else
            "structure" if "agent metadata refused (nothing was added)" in o else
            "other FkvError: " + o[11:70] for o in outcomes)
        TALLY["mutations"].update(why)
        TALLY["mutation_s"] = (round(precheck_s, 1), round(connect_s, 1))
        # the attacked decode worker still serves: connect to the real prefill, read, verify
        victim.call("reconnect", name=name, address=address)
        local, remote = request_blocks(spec, spec, 9)
        P.call("hold", name=name, request_id="after", blocks=remote)
        assert victim.call("read", name=name, request_id="after", local=local,
                           remote=remote)["result_ok"]
        assert victim.call("verify", name=name, local=local, remote=remote, seed=SEED,
                           remote_spec=spec, num_tokens=None, also_written=[],
                           layers=None)["mismatch"] is None
        victim.call("stop", name=name)
    finally:
        if victim is not None:
            victim.close()
        if fake is not None:
            fake.close()
        P.call("stop", name=name)


GEOMETRY = {
    # name: (prefill spec overrides, what the FkvError must name)
    "num_blocks 2**26": ({"num_blocks": 1 << 26}, "MAX_PREPARED_DESCRIPTORS"),
    "num_blocks 2**40-1": ({"num_blocks": (1 << 40) - 1}, "MAX_PREPARED_DESCRIPTORS"),
    "block_size 65535": ({"block_size": 65535}, "over the staging cap staging_bytes="),
    "block_size 2**20-1": ({"block_size": (1 << 20) - 1}, "over the staging cap staging_bytes="),
}


def test_huge_and_coprime_geometry_is_refused_naming_the_limit(procs: Any) -> None:
    """A fake rank 0 announces a cache of 2**26 or 2**40-1 blocks (its NIXL metadata widened to
    "register" it) or a block size coprime with the decode's: connect raises FkvError naming
    the limit, within its timeout, and the decode worker's RSS grows < 64 MiB."""
    P, D = procs["P"][0], procs["D"][1]
    spec = spec_dict(tp=1)
    name, address = serve(P, spec)
    fake = None
    try:
        D.call("connect", name=name, spec=spec, engine=engine_dict(f"D-{name}", 1, 0),
               address=address)
        real = fetch_ranks(address)[0]
        peer = decode_untrusted(real.peer)
        current: list[Any] = []
        fake = FakePrefill(lambda i: _side.Ranks(ranks=current))
        for case, (over, limit) in GEOMETRY.items():
            big = peer.spec.evolve(**over)
            meta = widen(peer.agent_metadata, peer.regions[0][0],
                         big.region_bytes * big.num_regions)
            current[:] = [crafted(real, fake.address, spec=big, metadata=meta)]
            before = rss(D)
            out = D.call("reconnect_many", name=name, address=fake.address, n=1, timeout=10.0)
            grew = rss(D) - before
            (outcome,) = out["outcomes"]
            assert outcome.startswith("FkvError: ") and limit in outcome, (case, outcome)
            assert "nothing was allocated" in outcome, outcome
            assert out["worst"] < 10.0 and grew < RSS_LIMIT, (case, out["worst"], grew)
            TALLY["refused"][f"geometry: {case}"] += 1
            TALLY.setdefault("geometry", {})[case] = (round(out["worst"], 2), grew // MiB)
        D.call("reconnect", name=name, address=address)
        assert D.call("ping")["pid"]
    finally:
        if fake is not None:
            fake.close()
        D.call("stop", name=name)
        P.call("stop", name=name)


def test_bad_or_missing_pack_replies_fail_the_read_in_time(procs: Any) -> None:
    """Packed reads through a fake rank whose pack replies lie outside the pack buffer, carry
    another token, ask to retry forever or never come: ``read`` gives ok=False within its
    timeout, nothing lands, the real prefill frees nothing and was never told done."""
    P, D = procs["P"][1], procs["D"][1]
    spec = spec_dict(tp=1)
    name, address = serve(P, spec)
    real = fetch_ranks(address)[0]
    cap = real.pack_bytes
    assert cap > 0
    mode: list[str] = [""]

    def pack(msg: _side.Pack) -> Any:
        return {
            "offset past the buffer": _side.Packed(token=msg.token, slot=1, offset=cap, nbytes=1),
            "size past the buffer": _side.Packed(token=msg.token, slot=1, offset=0,
                                                 nbytes=cap + 1),
            "huge offset and size": _side.Packed(token=msg.token, slot=1, offset=(1 << 63) - 1,
                                                 nbytes=(1 << 63) - 1),
            "another token": _side.Packed(token=msg.token + 1, slot=1, offset=0, nbytes=64),
            "retry forever": _side.Error(message="busy", retry=True, token=msg.token),
            "never answered": None,
        }[mode[0]]

    fake = FakePrefill(lambda i: _side.Ranks(
        ranks=[msgspec.structs.replace(real, address=fake.address)]), pack)
    try:
        D.call("connect", name=name, spec=spec, engine=engine_dict(f"D-{name}", 1, 0),
               address=fake.address, strategy="packed")
        local, remote = request_blocks(spec, spec, 9)
        P.call("hold", name=name, request_id="r1", blocks=remote)
        before = rss(D)
        for m in ("offset past the buffer", "size past the buffer", "huge offset and size",
                  "another token", "retry forever", "never answered"):
            mode[0] = m
            packs = fake.packs
            r = D.call("read", name=name, request_id="r1", local=local, remote=remote,
                       timeout=1.0)
            assert not r["result_ok"] and r["read_seconds"] < 2.0, (m, r)
            assert fake.packs > packs
            if "past" in m or "huge" in m:
                assert "-byte buffer; expected" in r["error"] and "bytes inside it" in r["error"]
            else:
                assert "pack" in r["error"], (m, r["error"])
            TALLY["refused"][f"pack reply: {m}"] += 1
        assert rss(D) - before < RSS_LIMIT
        assert D.call("untouched", name=name)["untouched"]
        state = P.call("pending", name=name)
        assert state["pending"] == ["r1"] and state["released"] == {}
        counts = P.call("diagnostics", name=name)["counts"]
        assert counts["accepted"] == 0 and counts["released_notified"] == 0
        # the decode worker still serves: the real prefill, packed, bit for bit
        D.call("reconnect", name=name, address=address)
        assert D.call("read", name=name, request_id="r1", local=local, remote=remote)["result_ok"]
        assert D.call("verify", name=name, local=local, remote=remote, seed=SEED,
                      remote_spec=spec, num_tokens=None, also_written=[],
                      layers=None)["mismatch"] is None
        poll(lambda: P.call("pending", name=name)["released"].get("r1") == "notified")
    finally:
        fake.close()
        D.call("stop", name=name)
        P.call("stop", name=name)


def test_a_packed_read_stops_waiting_when_its_slot_reservation_ends(tmp_path: Path) -> None:
    """A pack reply says how long its slot stays reserved (``expires_in``); a READ still running
    after that could find the slot given to another pack, so the read gives up then, well before
    its own longer timeout, naming why. A fake rank 0 forwards the pack to the real prefill rank,
    stops that process (SIGSTOP) and answers with the real slot and a 1 s reservation: the READ
    (UCX over TCP, which needs the stopped peer) cannot finish."""
    import signal

    P, D = Proc("slotP", tmp_path, env=TCP_LO), Proc("slotD", tmp_path, env=TCP_LO)
    fake = None
    try:
        for proc in (P, D):
            proc.call("ping", wait=120)
        spec = spec_dict(tp=1)
        name, address = serve(P, spec)
        real = fetch_ranks(address)[0]

        def pack(msg: _side.Pack) -> Any:
            got = ask(real.address, msg)
            assert isinstance(got, _side.Packed), got
            os.kill(P.proc.pid, signal.SIGSTOP)
            return msgspec.structs.replace(got, expires_in=1.0)

        fake = FakePrefill(lambda i: _side.Ranks(
            ranks=[msgspec.structs.replace(real, address=fake.address)]), pack)
        D.call("connect", name=name, spec=spec, engine=engine_dict(f"D-{name}", 1, 0),
               address=fake.address, strategy="packed")
        local, remote = request_blocks(spec, spec, 9)
        r = D.call("read", name=name, request_id="r1", local=local, remote=remote, timeout=20.0)
        assert not r["result_ok"] and r["read_seconds"] < 6.0, r
        assert "stopped at the end of the pack slots' reservation, before the read's timeout" \
            in r["error"], r["error"]
        TALLY["refused"]["packed READ past its slot's reservation"] += 1
    finally:
        os.kill(P.proc.pid, signal.SIGCONT)
        if fake is not None:
            fake.close()
        D.close()
        P.close()


# -- fake decode client vs a real prefill worker ---------------------------------------------------

def test_hostile_notifications_never_free_a_block_early(procs: Any) -> None:
    """P TP=1 -> D TP=2: decode rank 0 reads, then its agent notifies again (duplicate), as rank 1
    (impersonation), for an unknown request, in the old format, with status failed; a fresh NIXL
    agent notifies as rank 1 (foreign) and floods 2000 malformed notifications. The request stays
    held until rank 1 really read; every refusal is counted by kind, exactly."""
    pspec, dspec = spec_dict(tp=1), spec_dict(tp=2)
    pair = Pair(procs, 1, 2, pspec, dspec, connect_kw={"strategy": "direct"})
    P, (D0, D1) = pair.P[0], pair.D
    eng = f"D-{pair.name}"
    try:
        before = rss(P)
        local, remote = request_blocks(pspec, dspec, 8)
        P.call("hold", name=pair.name, request_id="r1", blocks=remote)
        assert D0.call("read", name=pair.name, request_id="r1", local=local,
                       remote=remote)["result_ok"]
        expected = collections.Counter(held=1, accepted=1)

        def counts() -> dict[str, int]:  # the counters (not the gauges pending, bindings)
            c = P.call("diagnostics", name=pair.name)["counts"]
            return {k: v for k, v in c.items() if k not in ("pending", "bindings")}

        def settle() -> None:
            want = {k: expected.get(k, 0) for k in counts()}
            poll(lambda: counts() == want, what=f"counts {want}")
            assert P.call("pending", name=pair.name)["pending"] == ["r1"]  # never freed early

        settle()
        attacks = [  # (kind, sender, messages)
            ("duplicate", {}, [notification("r1", eng, 0)]),
            ("impersonation", {}, [notification("r1", eng, 1)]),
            ("unknown_request", {}, [notification("nope", eng, 0)]),
            ("malformed", {}, [b"victim:1"]),
            ("failed", {}, [notification("r1", eng, 0, "failed")]),
            ("foreign", {"fresh": True}, [notification("r1", eng, 1)]),
            ("malformed", {"fresh": True}, [b"victim:%d" % i for i in range(2000)]),
        ]
        for kind, how, messages in attacks:
            D0.call("notify_raw", name=pair.name, messages=[m.hex() for m in messages], **how)
            expected[kind] += len(messages)
            settle()
            TALLY["refused"][f"notification: {kind}" + (" (fresh agent)" if how else "")] += \
                len(messages)
        # rank 1 reads: now, and only now, the blocks are freed
        assert D1.call("read", name=pair.name, request_id="r1", local=local,
                       remote=remote)["result_ok"]
        assert pair.wait_released("r1") == ["notified"]
        D1.call("notify_raw", name=pair.name, messages=[notification("r1", eng, 1).hex()])
        expected.update(accepted=1, released_notified=1, late=1)
        poll(lambda: counts() == {k: expected.get(k, 0) for k in counts()}, what="late")
        TALLY["refused"]["notification: late"] += 1
        # telemetry counts the same refusals
        refused = P.call("side_stats", name=pair.name)["refused"]
        for kind in ("duplicate", "impersonation", "unknown_request", "malformed", "failed",
                     "foreign", "late"):
            assert refused.get(kind) == expected[kind], (kind, refused)
        # still serving: a normal request, read by both ranks, released once both notified
        results = pair.read_all("r2", local, remote)
        assert [r["result_ok"] for r in results] == [True, True]
        assert pair.verify_all(local, remote) == [None, None]
        assert pair.wait_released("r2") == ["notified"]
        assert rss(P) - before < RSS_LIMIT
    finally:
        pair.stop()


def test_oversized_and_flooding_side_channel_messages(procs: Any) -> None:
    """A 100 MiB frame header, 30 x 100 MiB announced, 30 x 30 MiB frames announced at once (past
    the buffering budget), 2000 pipelined frames on one connection, 100 connections at once:
    each is dropped or answered in turn, the prefill's RSS grows < 64 MiB, it still serves."""
    pspec = spec_dict(tp=1)
    pair = Pair(procs, 1, 1, pspec, pspec, connect_kw={"strategy": "direct"})
    P, D = pair.P[0], pair.D[0]
    host, port = pair.address.removeprefix("tcp://").rsplit(":", 1)
    try:
        before = rss(P)
        side0 = P.call("side_stats", name=pair.name)["side"]

        def side() -> dict[str, int]:
            return P.call("side_stats", name=pair.name)["side"]

        def dropped(sock: socket.socket) -> bool:
            sock.settimeout(10.0)
            try:
                return sock.recv(1) == b""
            except ConnectionResetError:
                return True

        with socket.create_connection((host, int(port))) as s:   # one 100 MiB header
            s.sendall((100 * MiB).to_bytes(4, "big") + b"x" * 1024)
            assert dropped(s)
        socks = [socket.create_connection((host, int(port))) for _ in range(30)]
        for s in socks:   # 30 x 100 MiB announced
            s.sendall((100 * MiB).to_bytes(4, "big") + b"x" * 1024)
        assert all(dropped(s) for s in socks)
        for s in socks:
            s.close()
        poll(lambda: side()["closed_oversize"] - side0["closed_oversize"] == 31, what="oversize")
        socks = [socket.create_connection((host, int(port))) for _ in range(30)]
        for s in socks:   # 30 x 30 MiB announced at once: the budget holds two
            s.sendall((30 * MiB).to_bytes(4, "big") + b"x" * 1024)
        poll(lambda: side()["closed_budget"] - side0["closed_budget"] == 28, what="budget")
        assert side()["reserved"] == 60 * MiB
        for s in socks:
            s.close()
        poll(lambda: side()["reserved"] == 0, what="budget freed")
        with socket.create_connection((host, int(port))) as s:   # 2000 frames pipelined
            s.sendall(encode_frame(_side.encode_message(_side.Ping())) * 2000)
            dec, replies = FrameDecoder(max_frame=_side.MAX_SIDE_MESSAGE_BYTES), []
            s.settimeout(30.0)
            while len(replies) < 2000:
                replies += dec.feed(s.recv(1 << 16))
        assert {type(_side.decode_reply(r)).__name__ for r in replies} == {"Ok"}
        socks = []
        for _ in range(100):   # connections past max_connections=64 are closed at once
            socks.append(socket.create_connection((host, int(port))))
        poll(lambda: side()["refused_connections"] - side0["refused_connections"] >= 36,
             what="connections refused")
        for s in socks:
            s.close()
        poll(lambda: isinstance(ask(pair.address, _side.Ping()), _side.Ok), what="ping")
        grew = rss(P) - before
        assert grew < RSS_LIMIT, grew
        s1 = side()
        TALLY["refused"]["side channel: frame header over 33 MiB"] += \
            s1["closed_oversize"] - side0["closed_oversize"]
        TALLY["refused"]["side channel: frame past the 66 MiB buffering budget"] += \
            s1["closed_budget"] - side0["closed_budget"]
        TALLY["refused"]["side channel: connection past max_connections"] += \
            s1["refused_connections"] - side0["refused_connections"]
        TALLY["side_rss_growth_mib"] = round(grew / MiB, 1)
        counts = P.call("diagnostics", name=pair.name)["counts"]
        assert counts["held"] == 0 and counts["malformed"] == 0
        # still serving: a normal read
        local, remote = request_blocks(pspec, pspec, 10)
        assert [r["result_ok"] for r in pair.read_all("r1", local, remote)] == [True]
        assert pair.verify_all(local, remote) == [None]
        assert pair.wait_released("r1") == ["notified"]
        assert D.call("ping")["pid"]
    finally:
        pair.stop()


def test_republish_of_another_rank_is_refused(procs: Any) -> None:
    """Rank 1 of a 2-rank prefill engine published with its secret: a Publish for rank 1 with
    another secret (or none) is refused naming why, counted as refused("publish"), and rank 1's
    entry is unchanged; rank 1's own identical re-Publish (a retry) is accepted; its secret never
    appears in what rank 0 hands out."""
    pspec = spec_dict(tp=2)
    pair = Pair(procs, 2, 1, pspec, spec_dict(tp=1), connect_kw={"strategy": "direct"})
    P0, P1 = pair.P
    try:
        ranks = fetch_ranks(pair.address)
        one = ranks[1]
        evil = dict(rank=1, peer=one.peer, mem_type=one.mem_type, address="tcp://127.0.0.1:9",
                    pack_base=one.pack_base, pack_bytes=one.pack_bytes)
        reply = ask(pair.address, _side.Publish(**evil, secret=os.urandom(32)))
        assert isinstance(reply, _side.Error) and not reply.retry
        assert reply.message == (
            "publish refused: rank 1 already published with another secret (a rank's entry can "
            "be replaced only by that rank; restart the whole prefill engine to replace a rank's "
            "process)")
        reply = ask(pair.address, _side.Publish(**evil))   # no secret at all
        assert isinstance(reply, _side.Error) and "rank 1 already published with another " \
            "secret" in reply.message
        assert P1.call("republish", name=pair.name) == {"ok": True, "secret_handed_out": False,
                                                         "seconds": pytest.approx(0, abs=30)}
        assert fetch_ranks(pair.address) == ranks
        stats = P0.call("side_stats", name=pair.name)
        assert stats["refused"] == {"publish": 2}
        TALLY["refused"]["re-Publish of another rank"] += 2
        local, remote = request_blocks(pspec, pspec, 8)
        assert [r["result_ok"] for r in pair.read_all("r1", local, remote)] == [True]
        assert pair.verify_all(local, remote) == [None]
        assert pair.wait_released("r1") == ["notified", "notified"]
    finally:
        pair.stop()


def test_a_later_hello_cannot_take_over_a_bound_reader(procs: Any) -> None:
    """Decode rank 0 said Hello (with its process's secret) and a held request names it (the
    engine fixed it by reading first). A Hello from anyone else for the same reader, with another
    secret or none, or moving the decode rank's agent to another reader, is refused naming why
    and counted; the decode rank's own done still releases the request."""
    pspec = spec_dict(tp=1)
    pair = Pair(procs, 1, 1, pspec, spec_dict(tp=1), connect_kw={"strategy": "direct"})
    P, D = pair.P[0], pair.D[0]
    eng = f"D-{pair.name}"
    try:
        agent = D.call("notify_raw", name=pair.name, messages=[])["agent"]
        local, remote = request_blocks(pspec, pspec, 8)
        assert [r["result_ok"] for r in pair.read_all("r0", local, remote)] == [True]
        assert pair.wait_released("r0") == ["notified"]  # (and the agent's endpoint is wired)
        # a streaming request the decode rank finished early (its done is kept until the last
        # layer is published): the request names the reader while it waits
        P.call("hold", name=pair.name, request_id="r2", blocks=remote, layers_ready=0)
        D.call("notify_raw", name=pair.name, messages=[notification("r2", eng, 0).hex()])
        poll(lambda: P.call("diagnostics", name=pair.name)["counts"]["premature"] == 1,
             what="the early done of r2")
        refused = ("bind refused: reader ('%s', 0) is named by 1 held request(s) and was bound "
                   "by a process holding its secret; only that process can rebind it or its "
                   "agent until they are released (a new decode process can take a new engine "
                   "id)" % eng)
        attacks = [_side.Hello(engine_id=eng, rank=0, tp_size=1, agent="evil",
                               secret=os.urandom(32)),
                   _side.Hello(engine_id="evil", rank=0, tp_size=1, agent=agent,
                               secret=os.urandom(32))]
        for hello in attacks:
            reply = ask(pair.address, hello)
            assert reply == _side.Error(message=refused), reply
        reply = ask(pair.address, _side.Hello(engine_id=eng, rank=0, tp_size=1, agent="evil"))
        assert reply == _side.Error(message="hello refused: the secret is 0 bytes; at least 16 "
                                    "random bytes are needed (every decode process draws one at "
                                    "start: upgrade that rank's fkv)"), reply
        counts = P.call("diagnostics", name=pair.name)["counts"]
        assert counts["rebind_refused"] == 2 and counts["bindings"] == 1
        assert P.call("side_stats", name=pair.name)["refused"] == {"hello": 3}
        TALLY["refused"]["Hello taking over a bound reader"] += 3
        P.call("publish", name=pair.name, request_id="r2", layers_ready=pspec["num_layers"])
        assert pair.wait_released("r2") == ["notified"]   # the reader's own done counted
        assert [r["result_ok"] for r in pair.read_all("r1", local, remote)] == [True]
        assert pair.verify_all(local, remote) == [None]
        assert pair.wait_released("r1") == ["notified"]
    finally:
        pair.stop()


def test_pack_slot_free_needs_the_slot_id_it_was_given(procs: Any) -> None:
    """A pack slot is freed only by a notification naming the id its requester was given: a fresh
    NIXL agent (no Hello, no pack) that sends frees for the ids a counter would have handed out
    (0-256) frees nothing (each counted as refused ``unknown_slot``),
    so the next pack cannot be gathered into bytes the first reader is about to READ; the real
    id frees it."""
    from fkv.connector.transport._packer import FREE_PREFIX

    pspec = spec_dict(tp=1)
    pair = Pair(procs, 1, 1, pspec, spec_dict(tp=1), connect_kw={"strategy": "direct"})
    P, D = pair.P[0], pair.D[0]
    try:
        a = ask(pair.address, _side.Pack(token=1, request_id="A", block_ids=[1, 2],
                                         heads=(0, HEADS), num_tokens=8, timeout=30.0))
        assert isinstance(a, _side.Packed), a
        assert P.call("pack_state", name=pair.name)["held"] == 1
        guesses = list(range(257))  # what a counter hands out first; random ids: not these
        assert a.slot not in guesses, a.slot
        D.call("notify_raw", name=pair.name, fresh=True,
               messages=[(FREE_PREFIX + str(g).encode()).hex() for g in guesses])
        poll(lambda: P.call("side_stats", name=pair.name)["refused"].get("unknown_slot")
             == len(guesses), what=f"{len(guesses)} refused frees")
        assert P.call("pack_state", name=pair.name)["held"] == 1
        b = ask(pair.address, _side.Pack(token=2, request_id="B", block_ids=[5, 6],
                                         heads=(0, HEADS), num_tokens=8, timeout=30.0))
        assert isinstance(b, _side.Packed), b
        assert b.offset >= a.offset + a.nbytes or a.offset >= b.offset + b.nbytes  # apart
        TALLY["refused"]["pack-slot free with a guessed id"] += len(guesses)
        D.call("notify_raw", name=pair.name, fresh=True,
               messages=[(FREE_PREFIX + str(s).encode()).hex() for s in (a.slot, b.slot)])
        poll(lambda: P.call("pack_state", name=pair.name)["held"] == 0, what="both slots free")
    finally:
        pair.stop()


def test_zz_summary() -> None:
    """Prints what the suite tried (pytest -s); asserts nothing."""
    m = TALLY["mutations"]
    if m:
        tried = sum(m.values())
        print(f"\nmetadata blobs tried: {tried}; refused with FkvError: "
              f"{tried - m['connected (harmless)']}; accepted and harmless: "
              f"{m['connected (harmless)']}; decode workers that died: 0 (a death fails the "
              f"test); by reason: {dict(sorted(m.items()))}; precheck / connects (s): "
              f"{TALLY.get('mutation_s')}")
    if "geometry" in TALLY:
        print(f"geometry (connect seconds, RSS growth MiB): {TALLY['geometry']}")
    print("attacks refused by kind: " + "; ".join(f"{k}: {n}" for k, n in
                                                  sorted(TALLY["refused"].items())))
    if "side_rss_growth_mib" in TALLY:
        print(f"prefill RSS growth under side-channel floods: {TALLY['side_rss_growth_mib']} MiB")
