"""Peer NIXL agent metadata never reaches an agent unchecked (fkv.connector.transport._metadata), real NIXL
on CPU: a fake prefill rank (its own process, a real fkv agent) publishes its metadata; the test
corrupts it (the 0xff UCX-address case and >= 1000 seeded mutations) and checks each blob; a
victim process then adds every blob the check accepted to its own agent and READs through it.
Nothing may kill the test process or the victim."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import random
import re
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fkv.connector.transport import _metadata as M
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

ROOT = str(pathlib.Path(M.__file__).resolve().parents[2])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
       "NIXL_LOG_LEVEL": "ERROR"}

# A fake prefill rank: a real fkv agent with 64 KiB registered (bytes 0..255 repeated), its
# metadata in hex on stdout; it serves until its stdin closes.
PEER = r"""
import sys
import numpy as np
from fkv.connector.transport._agent import Agent
buf = (np.arange(1 << 16) % 256).astype(np.uint8)
agent = Agent("prefill")
agent.register([(buf.ctypes.data, buf.nbytes)], "DRAM", 0)
print(agent.metadata().hex(), flush=True)
sys.stdin.read()
agent.close()
"""

# A victim decode rank: blobs framed on stdin (u64 length, bytes), the first argv[1] of them to be
# read through. It checks them all (one probe batch), then for each one: add_remote_checked to
# its own agent; if added (and among the first argv[1]), READ 64 bytes of the peer's first
# descriptor (2 s deadline); then remove it. Prints a JSON summary.
VICTIM = r"""
import json, sys, time
import numpy as np
from fkv.connector.transport import _metadata as M
from fkv.connector.transport._agent import load_nixl
nixl = load_nixl()
inp = sys.stdin.buffer
blobs = []
while (head := inp.read(8)):
    blobs.append(inp.read(int.from_bytes(head, "little")))
t0 = time.perf_counter()
M.check_each(blobs, timeout=120)
check_s = time.perf_counter() - t0
agent = nixl.nixl_agent("fkv-victim", nixl.nixl_agent_config(backends=["UCX"]))
buf = np.zeros(64, dtype=np.uint8)
agent.register_memory([(buf.ctypes.data, 64, 0, "")], "DRAM")
local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[buf.ctypes.data, 64, 0]], np.uint64),
                              "DRAM")
out = {"refused": 0, "added": 0, "left_added": 0, "read_tries": 0, "check_s": round(check_s, 2)}
for k, blob in enumerate(blobs):
    buf[:] = 0
    try:
        name = M.add_remote_checked(agent, blob, timeout=60)
    except M.FkvError as e:
        out["refused"] += 1
        out.setdefault("why", []).append(str(e)[:120])
        try:
            meta = M.parse_agent_metadata(blob)
        except M.FkvError:
            continue
        out["left_added"] += bool(agent.check_remote_metadata(meta.name))
        continue
    out["added"] += 1
    if k >= int(sys.argv[1]):
        agent.remove_remote_agent(name)
        continue
    out["read_tries"] += 1
    addr, n, dev = M.parse_agent_metadata(blob).sections[0].descs[0]
    try:
        remote = agent.prep_xfer_dlist(name, np.array([[addr, 64, dev]], np.uint64), "DRAM")
        handle = agent.make_prepped_xfer("READ", local, [0], remote, [0], b"")
        state, t = agent.transfer(handle), time.monotonic()
        while state == "PROC" and time.monotonic() - t < 2:
            state = agent.check_xfer_state(handle)
        intact = state == "DONE" and buf.tolist() == list(range(64))
        key = "read intact" if intact else f"read {state}"
        try:
            agent.release_xfer_handle(handle)
        except Exception:
            pass
        agent.release_dlist_handle(remote)
    except Exception as e:
        key = f"read refused by NIXL ({type(e).__name__})"
    out[key] = out.get(key, 0) + 1
    agent.remove_remote_agent(name)
print("SUMMARY", json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def peer():
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=ENV, text=True)
    try:
        blob = bytes.fromhex(proc.stdout.readline().strip())
        assert blob.startswith(b"nixlSerDes|")
        yield blob
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.fixture(autouse=True)
def fresh_cache():
    M._clear_cache()
    yield
    M._clear_cache()


def mutations(blob: bytes, seed: int = 1212) -> list[tuple[str, bytes]]:
    """Seeded corruptions: bit flips anywhere, truncations, insertions, and byte overwrites
    inside the opaque UCX connection info (the worker address) and the descriptors."""
    rng = random.Random(seed)
    meta = M.parse_agent_metadata(blob)
    c0, cn = meta.conn_spans[0]
    out = []
    for _ in range(400):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            bit = rng.randrange(len(b) * 8)
            b[bit // 8] ^= 1 << (bit % 8)
        out.append(("flip", bytes(b)))
    for _ in range(250):
        out.append(("truncate", blob[:rng.randrange(len(blob))]))
    for _ in range(250):
        i = rng.randrange(len(blob) + 1)
        out.append(("insert", blob[:i] + rng.randbytes(rng.randint(1, 32)) + blob[i:]))
    for _ in range(100):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(c0, c0 + cn) if rng.random() < 0.7
              else rng.randrange(c0 + cn, len(b))] = rng.randrange(256)
        out.append(("overwrite", bytes(b)))
    return out


def _no_probe(*args, **kwargs):
    raise AssertionError("a probe child was started")


def test_valid_blob_passes_and_is_cached(peer, monkeypatch):
    t0 = time.perf_counter()
    meta = M.check_agent_metadata(peer, timeout=60)
    probe_s = time.perf_counter() - t0
    assert meta.name.startswith("fkv-prefill-") and meta.backends[0][0] == "UCX"
    assert meta.sections[0].mem_type == "DRAM" and meta.sections[0].descs[0][1] == 1 << 16
    assert meta.covers(meta.sections[0].descs[0][0], 4096, "DRAM")
    assert not meta.covers(meta.sections[0].descs[0][0], (1 << 16) + 1, "DRAM")
    monkeypatch.setattr(M, "probe_agent_metadata", _no_probe)  # the verdict is cached
    t0 = time.perf_counter()
    assert M.check_agent_metadata(peer, timeout=60) == meta
    cached_s = time.perf_counter() - t0
    print(f"probe of a valid blob: {probe_s:.2f} s (child start, NIXL agent, add); cached "
          f"{cached_s * 1e6:.0f} us")


def test_ucx_address_version_0xff_is_refused(peer, monkeypatch):
    """The first byte of the UCX worker address carries its version: 0xff makes UCX assert and
    abort the process that adds it. The walk of the address refuses it (FkvError, no child);
    handed to the probe past that walk, it kills the probe's child, not us."""
    start, _ = M.parse_agent_metadata(peer).conn_spans[0]
    bad = bytearray(peer)
    bad[start] = 0xFF
    with monkeypatch.context() as m:
        m.setattr(M, "probe_agent_metadata", _no_probe)  # refused by the walk, no child
        with pytest.raises(FkvError, match=r"refused \(nothing was added\): the peer's UCX "
                                           r"worker address \(\d+ bytes\) has version 15"):
            M.check_agent_metadata(bytes(bad), timeout=60)
    monkeypatch.setattr(M, "check_ucx_address", lambda raw: None)
    (why,) = M.probe_agent_metadata([bytes(bad)], timeout=60)
    assert re.match(r"it kills the process that adds it \(killed by signal 6.*addr_version", why)


def ucx_rkeys(blob):
    """Offsets of the UCX remote keys of the blob's descriptors (after address, length, device)."""
    return [blob.index(a.to_bytes(8, "little") + n.to_bytes(8, "little")) + 24
            for a, n, _ in M.parse_agent_metadata(blob).sections[0].descs]


def with_byte(blob, at, value):
    b = bytearray(blob)
    b[at] = value
    return bytes(b)


def test_ucx_fields_are_walked_to_their_last_byte(peer, monkeypatch):
    """UCX parses the worker address and the remote keys by their own length bytes and flags,
    never checking the end: a blob that sends it past the end (or that carries an index UCX uses
    unchecked) is refused by the structural parse, naming the field, before any child. Among
    them the remote keys with memory type 0x9f, 109 and 115, which passed the parse and the probe
    before and then killed the decode process (SIGSEGV in add_remote_agent)."""
    start, n = M.parse_agent_metadata(peer).conn_spans[0]
    assert peer[start + n - 1] == 0x80  # UCX's default address v1 ends with an empty last device
    rkey = ucx_rkeys(peer)[0]
    assert peer[rkey:rkey + 11] == bytes.fromhex("0100000000000000" "00" "00" "ff")  # DRAM here
    cases = {
        "memory type 0x9f": (with_byte(peer, rkey + 8, 0x9F), r"remote key .* memory type 159"),
        "memory type 109": (with_byte(peer, rkey + 8, 109), r"remote key .* memory type 109"),
        "memory type 115": (with_byte(peer, rkey + 8, 115), r"remote key .* memory type 115"),
        "MD map past the key": (with_byte(peer, rkey + 7, 0x80),
                                r"remote key .* ends inside its remote key of MD 63"),
        "MD key longer than the key": (with_byte(peer, rkey + 9, 5),
                                       r"remote key .* ends inside its remote key of MD 0"),
        "system device without distances": (with_byte(peer, rkey + 10, 0),
                                            r"remote key .* ends inside its distance list"),
        "last device not last": (with_byte(peer, start + n - 1, 0x00),
                                 r"UCX worker address .* ends inside its MD index"),
        # the flag makes UCX read a worker name after the uuid: its length byte is set to run one
        # byte past the end (the flag alone left the walk to the address's own bytes, which a
        # CI run's peer happened to make end exactly on its last byte)
        "debug-info flag on": (with_byte(with_byte(peer, start, peer[start] | 0x10), start + 9,
                                         n - 9),
                               r"UCX worker address \(\d+ bytes\) .*worker name"),
    }
    assert peer[start] & 0x0F == 0 and n - 9 <= 255  # address v1: header, uuid, then the name

    monkeypatch.setattr(M, "probe_agent_metadata", _no_probe)  # the parse refuses: no child
    for what, (blob, match) in cases.items():
        with pytest.raises(FkvError, match=match):
            M.check_agent_metadata(blob, timeout=60)
    # UCX's unified mode packs addresses without lengths: not walked (the probe judges them)
    monkeypatch.setenv("UCX_UNIFIED_MODE", "y")
    M.check_ucx_address(bytes([0xFF]))


def test_non_utf8_agent_name_is_refused_before_nixl_sees_it(peer):
    meta = M.parse_agent_metadata(peer)
    raw = meta.name.encode()
    bad = peer.replace(len(raw).to_bytes(8, "little") + raw,
                       (len(raw) + 1).to_bytes(8, "little") + b"\xff" + raw, 1)
    with pytest.raises(FkvError, match=r"'agent name' must be UTF-8 text from the peer \(got "
                                       r"b'\\xff.*nothing was added"):
        M.check_agent_metadata(bad, timeout=60)
    with pytest.raises(FkvError, match="must be non-empty printable text"):
        M.decode_peer_str("agent name", "a\x00b")
    assert M.decode_peer_str("engine id", b"d\xc3\xa9code") == "d\u00e9code"


def test_dead_peer_accepted_blob_gives_fkverror_and_leaves_nothing_added():
    """A blob checked while its peer lived (cached as accepted) is added after the peer died:
    NIXL cannot connect; FkvError, and NIXL keeps nothing of it."""
    from fkv.connector.transport._agent import load_nixl

    proc = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=ENV, text=True)
    blob = bytes.fromhex(proc.stdout.readline().strip())
    meta = M.check_agent_metadata(blob, timeout=60)
    proc.stdin.close()
    proc.wait(timeout=10)
    proc.stdout.close()
    nixl = load_nixl()
    agent = nixl.nixl_agent("fkv-test-dead-peer", nixl.nixl_agent_config(backends=["UCX"]))
    with pytest.raises(FkvError, match=r"NIXL refused the peer's agent metadata .*nothing was "
                                       r"added: is the peer 'fkv-prefill-.*' still running\?"):
        M.add_remote_checked(agent, blob, timeout=60)
    assert not agent.check_remote_metadata(meta.name)


def test_probe_timeout_refuses_and_is_not_cached(peer):
    verdicts = M.check_each([peer], timeout=0.05)
    assert isinstance(verdicts[0], M.MetadataProbeTimeout)
    assert "did not finish within the timeout" in str(verdicts[0])
    assert isinstance(M.check_each([peer], timeout=60)[0], M.AgentMetadata)


def test_a_child_that_accepted_a_blob_leaves_by_itself_a_busy_one_is_killed(peer, monkeypatch):
    """The peer's UCX worker answers a load by connecting back to the probe child's agent; a child
    killed before that connection was accepted made the PEER print "UCX ERROR connect(...) failed:
    Connection refused" (7 connects of 16). A child that accepted its blob is left to go by itself
    (status 0, not a kill) after _LINGER seconds; one still busy when closed is killed at once."""
    monkeypatch.setattr(M, "_LINGER", 2.0)
    M._reap()
    held = list(M._LINGERING)
    assert M.probe_agent_metadata([peer], timeout=60) == [None]
    (proc, until), = [e for e in M._LINGERING if e not in held]
    assert proc.poll() is None and until - time.monotonic() > 1.0
    assert proc.wait(timeout=60) == 0
    M._reap()
    assert (proc, until) not in M._LINGERING
    assert isinstance(M.check_each([peer], timeout=0.05)[0], M.MetadataProbeTimeout)
    assert [e for e in M._LINGERING if e not in held] == []


def test_a_lingering_child_past_its_grace_is_killed_by_the_next_probe():
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    young = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    M._LINGERING.extend([(late, time.monotonic() - M._GRACE - 1.0), (young, time.monotonic())])
    try:
        M._reap()
        assert late.returncode == -9 and young.poll() is None
        assert [p for p, _ in M._LINGERING if p in (late, young)] == [young]
    finally:
        young.kill()
        young.wait()
        M._reap()
    assert [p for p, _ in M._LINGERING if p in (late, young)] == []


def test_structural_refusals_name_what_is_wrong(peer):
    with pytest.raises(FkvError, match=r"byte 11 starts b'Agenz.*expected field 'Agent'"):
        M.parse_agent_metadata(peer.replace(b"Agent", b"Agenz", 1))
    with pytest.raises(FkvError, match="1 unexpected bytes follow the metadata"):
        M.parse_agent_metadata(peer + b"x")
    with pytest.raises(FkvError, match=r"field 'Conns' counts 4096; at most 16"):
        M.parse_agent_metadata(peer.replace(b"Conns\x08" + bytes(7) + b"\x01\x00",
                                            b"Conns\x08" + bytes(7) + b"\x00\x10", 1))


def test_1000_mutations_never_kill_and_accepted_ones_work(peer):
    """>= 1000 seeded corruptions: each is refused with FkvError (by the parse or the probe) or
    accepted; a victim process then adds every accepted blob and 40 refused ones with
    add_remote_checked, READing through the first 40: it must survive all, every accepted blob
    must add, and nothing refused stays added."""
    cases = mutations(peer)
    start, _ = M.parse_agent_metadata(peer).conn_spans[0]
    ff = bytearray(peer)
    ff[start] = 0xFF
    cases.append(("0xff version", bytes(ff)))
    assert len(cases) >= 1000
    t0 = time.perf_counter()
    verdicts = M.check_each([b for _, b in cases], timeout=300)
    took = time.perf_counter() - t0
    outcomes: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    for (kind, _), v in zip(cases, verdicts, strict=True):
        if isinstance(v, M.AgentMetadata):
            outcome = "accepted"
        elif "kills the process" in str(v):
            outcome = "refused, probe child died"
        elif "NIXL refused it" in str(v):
            outcome = "refused, NIXL error in the probe"
        else:
            assert isinstance(v, FkvError) and "nothing was added" in str(v)
            outcome = "refused, structure"
        outcomes[outcome] += 1
        by_kind[kind, outcome] += 1
    assert "has version 15" in str(verdicts[-1])              # the 0xff case: the address walk
    assert sum(outcomes.values()) == len(cases)
    assert outcomes["accepted"] > 0 and outcomes["refused, structure"] > 500

    # the victim: a real agent adds every blob through add_remote_checked and reads
    accepted = [b for (_, b), v in zip(cases, verdicts, strict=True)
                if isinstance(v, M.AgentMetadata)]
    refused = [b for (_, b), v in zip(cases, verdicts, strict=True)
               if not isinstance(v, M.AgentMetadata)]
    assert not any(isinstance(v, M.MetadataProbeTimeout) for v in verdicts)
    rng = random.Random(7)
    sample = [peer, *accepted, *rng.sample(refused, 40)]
    reads = 40
    t1 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", VICTIM, str(reads)], env=ENV, capture_output=True,
                          input=b"".join(len(b).to_bytes(8, "little") + b for b in sample),
                          timeout=240)
    victim_s = time.perf_counter() - t1
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    lines = proc.stdout.decode(errors="replace").splitlines()
    summary = json.loads([x for x in lines if x.startswith("SUMMARY ")][-1][len("SUMMARY "):])
    # the verdict of a blob whose UCX address was corrupted can change with what listens where
    # at that moment (its probe connects): a few accepted here may be refused there; never death
    assert summary["added"] + summary["refused"] == len(sample), json.dumps(summary)
    assert summary["added"] >= 0.9 * (len(accepted) + 1), json.dumps(summary)
    assert summary["left_added"] == 0
    assert summary.get("read intact", 0) >= 1       # the unmodified blob reads the peer's bytes
    assert summary["read_tries"] >= reads - 4
    assert sum(v for k, v in summary.items() if k.startswith("read ")) == summary["read_tries"]
    print(f"\n{len(cases)} blobs tried in {took:.1f} s: {dict(outcomes)}")
    print("by mutation: " + "; ".join(f"{k} -> {o}: {n}" for (k, o), n in sorted(by_kind.items())))
    why = collections.Counter("probe: NIXL error" if "NIXL refused it" in w else
                              "probe: child died" if "kills the process" in w else
                              "add: NIXL error" if "NIXL refused the peer's" in w else "structure"
                              for w in summary.pop("why", []))
    print(f"victim ({len(sample)} blobs, {victim_s:.1f} s, its own probe {summary['check_s']} s): "
          f"{summary}; refusals: {dict(why)}")


# -- holes found by mutation (2026-12-04)
# Synthetic blobs in NIXL's format (module docstring of _metadata): every field
# ``<tag><u64 length><value>|``; no NIXL needed, so the exact offsets are known.

def _fld(tag, value):
    return tag + len(value).to_bytes(8, "little") + value + b"|"


def _u64(n):
    return n.to_bytes(8, "little")


_ADDR = bytes([0x20]) + bytes(8) + bytes([0xFF])            # UCX address v1, uuid, no transport
_RKEY = bytes.fromhex("0100000000000000" "00" "00" "ff")  # MD 0, host memory, no system device


def _desc(addr=0x1000, n=4096, dev=0, key=_RKEY):
    return _u64(addr) + _u64(n) + _u64(dev) + key


def _blob(name=b"p0", backends=((b"UCX", _ADDR),), sections=((b"UCX", 0, (_desc(),)),),
          marker=b"MemSection", dlist=b"nixlSDList"):
    out = b"nixlSerDes|" + _fld(b"Agent", name) + _fld(b"Conns", _u64(len(backends)))
    for backend, conn in backends:
        out += _fld(b"t", backend) + _fld(b"c", conn)
    out += _fld(b"", marker) + _fld(b"nixlSecElms", _u64(len(sections)))
    for backend, mem, descs in sections:
        out += (_fld(b"bknd", backend) + _fld(b"nixlDList", dlist)
                + _fld(b"t", mem.to_bytes(4, "little")) + _fld(b"n", _u64(len(descs))))
        out += b"".join(_fld(b"", d) for d in descs)
    return out


def _refused(what):
    return f"peer NIXL agent metadata refused (nothing was added): {what}; {M._FIX}"


def test_synthetic_blob_parses_to_exact_fields():
    blob = _blob(backends=((b"UCX", _ADDR), (b"POSIX", b"xyz")),
                 sections=((b"UCX", 0, (_desc(), _desc(1 << 40, 7, 3))),
                           (b"POSIX", 4, (_u64((1 << 64) - 8) + _u64(8) + _u64(0),))))
    meta = M.parse_agent_metadata(blob)
    assert meta == M.AgentMetadata(
        "p0", (("UCX", 10), ("POSIX", 3)),
        (M.Section("UCX", "DRAM", ((0x1000, 4096, 0), (1 << 40, 7, 3))),
         M.Section("POSIX", "FILE", (((1 << 64) - 8, 8, 0),))),
        ((71, 10), (106, 3)))
    assert [blob[a:a + n] for a, n in meta.conn_spans] == [_ADDR, b"xyz"]


_B = _blob()
_CONNS = _B.index(b"Conns")    # 27
_MARK = _B.index(b"MemSection") - 9
_DESC = len(_B) - 1 - len(_desc()) - 8


@pytest.mark.parametrize("blob, what", [
    (_B[:_CONNS + 5 + 7], f"the blob ends at byte {_CONNS + 12} inside the length of 'Conns'"),
    (_blob(name=b"a" * 1025), "field 'Agent' at byte 11 says 1025 bytes; it must be 1..1024"),
    (_blob(name=b""), "field 'Agent' at byte 11 says 0 bytes; it must be 1..1024"),
    (_B[:-1], f"field '' at byte {_DESC} says {len(_desc())} bytes but only "
              f"{len(_desc()) - 1} follow"),
    (_B[:26] + b"X" + _B[27:], "field 'Agent' at byte 11 is not closed by '|' (found b'X')"),
    (_blob(backends=((b"UCX", _ADDR),) * 17), "field 'Conns' counts 17; at most 16 are accepted"),
    (_blob(backends=((b"UCX-1", _ADDR),)),
     "backend name b'UCX-1' is not a name of ASCII letters, digits and '_'"),
    (_blob(marker=b"MemSectioX"), f"no 'MemSection' marker at byte {_MARK + 20}"),
    (_blob(sections=((b"GDS", 0, ()),)),
     "a memory section names backend 'GDS', which has no connection info (backends: ['UCX'])"),
    (_blob(dlist=b"nixlXDList"), "a memory section of 'UCX' is not a nixlSDList"),
    (_blob(sections=((b"UCX", 5, ()),)), "field 't' counts 5; at most 4 are accepted"),
    (_blob(sections=((b"UCX", 0, (_desc()[:23],)),)),
     f"field '' at byte {_DESC} says 23 bytes; it must be 24..{24 + (1 << 16)}"),
    (_blob(sections=((b"UCX", 0, (_desc(n=0),)),)),
     "a descriptor of 'UCX' is [0x1000, +0), not a non-empty range of the address space"),
    (_blob(sections=((b"UCX", 0, (_desc(addr=(1 << 64) - 8, n=9),)),)),
     "a descriptor of 'UCX' is [0xfffffffffffffff8, +9), not a non-empty range of the address "
     "space"),
])
def test_structural_refusals_exact(blob, what):
    with pytest.raises(FkvError) as e:
        M.parse_agent_metadata(blob)
    assert str(e.value) == _refused(what)


def test_structural_bounds_accept_their_limits():
    meta = M.parse_agent_metadata(_blob(name=b"a" * 1024, backends=((b"UCX", _ADDR),) * 16,
                                        sections=((b"UCX", 4, (_desc(addr=(1 << 64) - 8, n=8,
                                                                     key=_RKEY[:8] + b"\x01"
                                                                     + _RKEY[9:]),)),)))
    assert (len(meta.name), len(meta.backends), meta.sections[0].mem_type,
            meta.sections[0].descs) == (1024, 16, "FILE", (((1 << 64) - 8, 8, 0),))


def _v1_iface(bw=1.0, iface=0x80, tail=b""):
    """One v1 transport address: checksum, 3 float32 attributes, flags, iface byte, ..."""
    return b"\x00\x00" + struct.pack("<3f", 1.0, bw, 1.0) + bytes(4) + bytes([iface]) + tail


_V2_IFACE = b"\x00\x00" + bytes(8)  # checksum, packed attributes (then the iface byte)
_V1 = bytes([0x00]) + bytes(8)       # address v1 header, uuid
_V2 = bytes([0x01, 0x00])            # address v2 header, flags (no uuid)


@pytest.mark.parametrize("raw", [
    bytes([0x01, 0x02]) + bytes(8) + b"\xff",                       # v2 with uuid
    bytes([0x01, 0x00, 0xFF]),                                       # v2 without uuid
    bytes([0x40]) + bytes(16) + b"\xff",                             # v1: uuid, client id
    _V1 + b"\x80\x00" * 127 + b"\x80\x80",                           # 128 empty devices
    _V2 + b"\x00\x80" + (_V2_IFACE + b"\x00") * 127 + _V2_IFACE + b"\x80",  # 128 transports
    _V1 + b"\x3f\x80" + _v1_iface(),                                 # MD 63
    _V2 + b"\x7f\x05\x80" + _V2_IFACE + b"\x80",                     # v2: MD index in next byte
    _V1 + b"\x00\xa0\x07" + _v1_iface(),                             # system device byte
    _V1 + b"\x00\xc0\x02" + _v1_iface(),                             # 2 paths
    _V2 + b"\x00\x9f\x20" + bytes(32) + _V2_IFACE + b"\x80",         # v2: 32-byte device addr
    _V1 + b"\x00\x80" + _v1_iface(iface=0xC0, tail=b"\x01a\x00\x00\x80"),  # 2 endpoints
    _V1 + b"\x00\x80" + _v1_iface(iface=0xC0, tail=b"\x00\x00" * 63 + b"\x00\x80"),  # 64 eps
])
def test_ucx_walk_accepts(raw):
    assert M.check_ucx_address(raw) is None


@pytest.mark.parametrize("raw, why", [
    (bytes([0x01, 0x10, 0xFF]), "has unknown header flags 0x10"),
    (_V1 + b"\x80\x00" * 128 + b"\x80\x80", "lists more than 128 devices"),
    (_V2 + b"\x00\x80" + (_V2_IFACE + b"\x00") * 128 + _V2_IFACE + b"\x80",
     "lists more than 128 transport addresses"),
    (_V1 + b"\x40\x80" + _v1_iface(), "names MD 64 (UCX has at most 64)"),
    (_V2 + b"\x7f\x40\x80" + _V2_IFACE + b"\x80", "names MD 64 (UCX has at most 64)"),
    (_V1 + b"\x00\xc0\x00" + _v1_iface(), "gives a device 0 paths"),
    (_V1 + b"\x00\x80" + _v1_iface(bw=0.0),
     "announces interface attributes (1.0, 0.0, 1.0) (finite numbers and a bandwidth other "
     "than 0 expected)"),
    (_V1 + b"\x00\x80" + _v1_iface(iface=0xC0, tail=b"\x00\x00" * 64 + b"\x00\x80"),
     "lists more than 64 endpoint addresses"),
])
def test_ucx_walk_refuses_address(raw, why):
    with pytest.raises(FkvError) as e:
        M.check_ucx_address(raw)
    assert str(e.value) == _refused(f"the peer's UCX worker address ({len(raw)} bytes) {why}")


@pytest.mark.parametrize("raw, mem, why", [
    (_u64(1) + b"\x0a\x00\xff", "VRAM", "says UCX memory type 10 (a VRAM descriptor: 1..9)"),
    (_u64(1) + b"\x01\x00\xff", "DRAM", "says UCX memory type 1 (a DRAM descriptor: 0, host)"),
    (_u64(1) + b"\x00\x00\xff", "VRAM", "says UCX memory type 0 (a VRAM descriptor: 1..9)"),
    (_u64(1 << 63) + b"\x00\x01", "DRAM", "ends inside its remote key of MD 63 (byte 10, 1 bytes "
                                          "needed)"),
])
def test_ucx_walk_refuses_rkey(raw, mem, why):
    with pytest.raises(FkvError) as e:
        M.check_ucx_rkey(raw, mem)
    assert str(e.value) == _refused(f"the peer's UCX remote key of a {mem} descriptor "
                                    f"({len(raw)} bytes) {why}")


@pytest.mark.parametrize("raw, mem", [
    (_u64(0) + b"\x00", "DRAM"),                           # no MD: no system device either
    (_u64(1) + b"\x09\x00\xff", "VRAM"),                   # the last memory type UCX knows
    (_u64(1 << 63) + b"\x00\x01k\xff", "DRAM"),            # MD 63
    (_u64(1) + b"\x00\x00\x03\x01ab\xff", "DRAM"),         # a system device, one distance
])
def test_ucx_walk_accepts_rkey(raw, mem):
    assert M.check_ucx_rkey(raw, mem) is None


# -- remote keys and the rest of the parser: holes found by the second mutation pass
# (2026-12-05: the remote-key mutations, never run before, and the functions around the parse)

_BAD_KEY = _u64(1) + b"\x01\x00\xff\x00"  # a VRAM key, MD 0, no system device, 1 byte too many


@pytest.mark.parametrize("sections, what", [
    (((b"UCX", 1, (_desc(key=_BAD_KEY),)),), "VRAM"),
    (((b"UCX", 0, (_desc(), _desc(key=_RKEY + b"\x00"))),), "DRAM"),   # the second descriptor
    (((b"UCX", 4, (_desc(key=_RKEY[:8] + b"\x01\x00\xff\x00"),)),), "FILE"),
    (((b"UCX", 0, (_desc(),)), (b"UCX", 1, (_desc(key=_BAD_KEY),))), "VRAM"),  # second section
])
def test_parse_walks_the_remote_key_of_every_ucx_descriptor(sections, what):
    with pytest.raises(FkvError) as e:
        M.parse_agent_metadata(_blob(sections=sections))
    assert str(e.value) == _refused(f"the peer's UCX remote key of a {what} descriptor (12 bytes) "
                                    f"ends at byte 11 by its own lengths; 1 bytes are left over")


def test_remote_keys_of_other_backends_are_not_walked():
    blob = _blob(backends=((b"UCX", _ADDR), (b"POSIX", b"c")),
                 sections=((b"POSIX", 1, (_desc(key=_BAD_KEY), _desc(2 << 20, 5, 1, b"\xff"))),))
    assert M.parse_agent_metadata(blob).sections == (
        M.Section("POSIX", "VRAM", ((0x1000, 4096, 0), (2 << 20, 5, 1))),)


@pytest.mark.parametrize("raw, mem, left", [
    (_RKEY + b"\x00", "DRAM", 1),                        # bytes after the system device
    (_u64(0) + b"\x00\xff", "DRAM", 1),                  # no MD: no system device byte at all
    (_u64(1) + b"\x01\x00\x03\x01ab\xff\x01\x02", "VRAM", 2),  # bytes after the distance list
])
def test_ucx_walk_refuses_rkey_left_over_bytes(raw, mem, left):
    with pytest.raises(FkvError) as e:
        M.check_ucx_rkey(raw, mem)
    assert str(e.value) == _refused(
        f"the peer's UCX remote key of a {mem} descriptor ({len(raw)} bytes) ends at byte "
        f"{len(raw) - left} by its own lengths; {left} bytes are left over")


@pytest.mark.parametrize("raw, mem", [
    (_u64(0b100001) + b"\x00\x01k\x02kk\xff", "DRAM"),          # MDs 0 and 5: both keys taken
    (_u64(0b110) + b"\x02\x00\x00\xff", "VRAM"),                 # MDs 1 and 2, empty keys
    (_u64(1) + b"\x00\x00\xfe\x01ab\x02cd\xff", "DRAM"),         # system device 0xfe: 2 distances
])
def test_ucx_walk_accepts_rkey_of_several_mds_and_distances(raw, mem):
    assert M.check_ucx_rkey(raw, mem) is None


@pytest.mark.parametrize("raw, why", [
    (_u64(0b100001) + b"\x00\x01k\x02k", "ends inside its remote key of MD 5 (byte 12, 2 bytes "
                                         "needed)"),
    (_u64(0b110) + b"\x00\x00", "ends inside its key size of MD 2 (byte 10, 1 bytes needed)"),
    (_u64(1) + b"\x00\x00\xfe\x01ab\x02c", "ends inside its distance (byte 15, 2 bytes needed)"),
    (_u64(1) + b"\x00\x00\xfe\x01ab", "ends inside its distance list (no 0xff terminator) "
                                      "(byte 14, 1 bytes needed)"),
])
def test_ucx_walk_refuses_rkey_cut_short(raw, why):
    with pytest.raises(FkvError) as e:
        M.check_ucx_rkey(raw, "DRAM")
    assert str(e.value) == _refused(f"the peer's UCX remote key of a DRAM descriptor "
                                    f"({len(raw)} bytes) {why}")


def test_ucx_walk_refuses_address_left_over_bytes():
    raw = _V1 + b"\xff\x00\x00"
    with pytest.raises(FkvError) as e:
        M.check_ucx_address(raw)
    assert str(e.value) == _refused("the peer's UCX worker address (12 bytes) ends at byte 10 by "
                                    "its own lengths; 2 bytes are left over")


@pytest.mark.parametrize("raw", [
    _V1 + b"\x00\x9f" + bytes(31) + _v1_iface(),                      # v1: 31-byte device address
    _V1 + b"\x00\x80" + _v1_iface(iface=0xBF, tail=bytes(63)),        # v1: 63-byte iface address
    _V1 + b"\x80\x00" + b"\xff\x80",                                    # v1: empty device, MD 127
])
def test_ucx_walk_v1_lengths_equal_to_their_mask_are_lengths(raw):
    """Only address v2 reads a value equal to its mask from the next byte; v1 takes it as is."""
    assert M.check_ucx_address(raw) is None


@pytest.mark.parametrize("value, walked", [
    ("y", False), ("yes", False), ("on", False), ("1", False), ("true", False), ("TRUE", False),
    ("n", True), ("0", True), ("off", True), ("", True),
])
def test_ucx_unified_mode_switches_the_address_walk_off(monkeypatch, value, walked):
    monkeypatch.setenv("UCX_UNIFIED_MODE", value)
    if not walked:
        assert M.check_ucx_address(bytes([0xFF])) is None
        return
    with pytest.raises(FkvError, match=r"worker address \(1 bytes\) has version 15"):
        M.check_ucx_address(bytes([0xFF]))


_TAIL = "the peer sent it; nothing was added"
_FF64 = bytes([0xFF]) * 64


@pytest.mark.parametrize("raw, kw, text", [
    (b"a" * 1024, {}, "a" * 1024),
    (bytearray(b"ab"), {}, "ab"),
    (memoryview(b"ab"), {}, "ab"),
    ("\u00e9" * 512, {}, "\u00e9" * 512),                 # 1024 UTF-8 bytes
    (b"abcd", {"max_bytes": 4}, "abcd"),
    (" ~", {}, " ~"),                                      # 32 and 126: printable
])
def test_decode_peer_str_accepts(raw, kw, text):
    assert M.decode_peer_str("f", raw, **kw) == text


@pytest.mark.parametrize("raw, kw, msg", [
    (b"a" * 1025, {}, f"'f' must be at most 1024 bytes (got 1025): {_TAIL}"),
    (b"abcde", {"max_bytes": 4}, f"'f' must be at most 4 bytes (got 5): {_TAIL}"),
    ("\u00e9" * 513, {}, f"'f' must be at most 1024 bytes (got 513 characters): {_TAIL}"),
    ("abcde", {"max_bytes": 4}, f"'f' must be at most 4 bytes (got 5 characters): {_TAIL}"),
    (b"\xff" * 100, {}, f"'f' must be UTF-8 text from the peer (got {_FF64!r}): {_TAIL}"),
    (b"", {}, f"'f' must be non-empty printable text (got ''): {_TAIL}"),
    ("", {}, f"'f' must be non-empty printable text (got ''): {_TAIL}"),
    (b"a\x1fb", {}, f"'f' must be non-empty printable text (got 'a\\x1fb'): {_TAIL}"),
    ("a\x7f", {}, f"'f' must be non-empty printable text (got 'a\\x7f'): {_TAIL}"),
    ("a\ud800", {}, f"'f' must be non-empty printable text (got 'a\\ud800'): {_TAIL}"),
    ("x" * 70 + "\n", {}, f"'f' must be non-empty printable text (got {'x' * 64!r}): {_TAIL}"),
    (5, {}, "'f' must be text from the peer (got int); nothing was added"),
    (None, {}, "'f' must be text from the peer (got NoneType); nothing was added"),
])
def test_decode_peer_str_refuses_exactly(raw, kw, msg):
    with pytest.raises(FkvError) as e:
        M.decode_peer_str("f", raw, **kw)
    assert type(e.value) is FkvError and str(e.value) == msg


def test_covers_needs_one_descriptor_of_the_memory_type_holding_the_whole_range():
    meta = M.AgentMetadata("p", (("UCX", 10),), (
        M.Section("UCX", "DRAM", ((0x1000, 0x100, 0),)),
        M.Section("UCX", "VRAM", ((0x5000, 0x100, 0), (0x5100, 0x100, 0)))))
    assert meta.covers(0x1000, 0x100, "DRAM") and meta.covers(0x10FF, 1, "DRAM")
    assert not meta.covers(0x1000, 0x101, "DRAM") and not meta.covers(0xFFF, 2, "DRAM")
    assert not meta.covers(0x5000, 0x10, "DRAM") and not meta.covers(0x1000, 0x10, "VRAM")
    assert meta.covers(0x5000, 0x100, "VRAM") and meta.covers(0x5100, 0x100, "VRAM")
    assert not meta.covers(0x50FF, 2, "VRAM")  # across two adjacent descriptors: refused


@pytest.mark.parametrize("blob, what", [
    (_B[:_CONNS], f"the blob ends at byte {_CONNS}, where field 'Conns' was expected"),
    (_B[:_CONNS + 3], f"the blob ends at byte {_CONNS + 3}, where field 'Conns' was expected"),
    (_B[:_CONNS] + b"Connx", f"byte {_CONNS} starts b'Connx', expected field 'Conns'"),
    (_B[:_CONNS + 13], f"field 'Conns' at byte {_CONNS} says 8 bytes but only 0 follow"),
    (_B + b"x", f"1 unexpected bytes follow the metadata at byte {len(_B)}"),
    (b"nixlSerDes#" + _B[11:], "it starts b'nixlSerDes#Agent', not b'nixlSerDes|'"),
])
def test_structural_refusals_exact_at_the_ends(blob, what):
    with pytest.raises(FkvError) as e:
        M.parse_agent_metadata(blob)
    assert str(e.value) == _refused(what)


@pytest.mark.parametrize("blob, kind", [(_B.decode("latin-1"), "str"), (5, "int"),
                                        (None, "NoneType")])
def test_parse_refuses_what_is_not_bytes(blob, kind):
    with pytest.raises(FkvError) as e:
        M.parse_agent_metadata(blob)
    assert str(e.value) == ("peer NIXL agent metadata refused (nothing was added): it is a "
                            f"{kind}, not bytes; this is a bug in the caller")


def test_parse_takes_bytearray_and_memoryview():
    meta = M.parse_agent_metadata(_B)
    assert M.parse_agent_metadata(bytearray(_B)) == meta == M.parse_agent_metadata(memoryview(_B))


def test_probe_sections_encode_dram_and_vram_only_little_endian_cut_at_4096():
    meta = M.AgentMetadata("p", (("UCX", 10), ("POSIX", 1)), (
        M.Section("UCX", "DRAM", ((0x1000, 0x100, 2), (1 << 40, 7, 0))),
        M.Section("POSIX", "FILE", ((0, 8, 0),)),
        M.Section("UCX", "VRAM", tuple((k, 1, 3) for k in range(4097)))))
    out = M._encode_sections(meta)
    assert out[:53] == (b"\x00" + (2).to_bytes(4, "little") + _u64(0x1000) + _u64(0x100) + _u64(2)
                        + _u64(1 << 40) + _u64(7) + _u64(0))
    assert out[53:58] == b"\x01" + (4096).to_bytes(4, "little")
    assert out[58:] == b"".join(_u64(k) + _u64(1) + _u64(3) for k in range(4096))


def test_probe_prep_encodes_one_section_in_the_same_format():
    import numpy as np

    rows = np.array([[0x1000, 0x100, 2], [1 << 40, 7, 0]], dtype=np.uint64)
    assert M._encode_prep("DRAM", rows) == (b"\x00" + (2).to_bytes(4, "little") + _u64(0x1000)
                                            + _u64(0x100) + _u64(2) + _u64(1 << 40) + _u64(7)
                                            + _u64(0))
    assert M._encode_prep("VRAM", np.arange(3 * 5000).reshape(-1, 3))[:5] == (
        b"\x01" + (4096).to_bytes(4, "little"))
    assert len(M._encode_prep("VRAM", np.arange(3 * 5000).reshape(-1, 3))) == 5 + 4096 * 24
    assert M._encode_prep("FILE", rows) == b"" and M._encode_prep("BLK", rows) == b""


# -- holes found by the third mutation pass (2026-12-05: 92 mutations, 37 of them of the remote
# key and its call site; 68 caught, 1 equivalent, 23 closed here): the distance list's terminator,
# the remote keys of every section, and the bounds pinned only through a message or not at all

@pytest.mark.parametrize("raw, mem", [
    (_u64(1) + b"\x00\x00\x03\x00ab\xff", "DRAM"),      # a distance to system device 0
    (_u64(1) + b"\x01\x00\x00\x00ab\x00cd\xff", "VRAM"),  # system device 0, distances to 0
])
def test_ucx_walk_reads_distances_up_to_their_terminator_only(raw, mem):
    assert M.check_ucx_rkey(raw, mem) is None


def _ucx_sections(*codes):
    """One UCX section per NIXL memory type code: one descriptor, a host key for DRAM only."""
    return tuple((b"UCX", code, (_desc(0x1000 * (code + 1), 16, code,
                                       _RKEY[:8] + bytes([code != 0]) + _RKEY[9:]),))
                 for code in codes)


def test_every_nixl_memory_type_parses_to_its_name():
    meta = M.parse_agent_metadata(_blob(sections=_ucx_sections(0, 1, 2, 3, 4)))
    assert [(s.backend, s.mem_type, s.descs) for s in meta.sections] == [
        ("UCX", "DRAM", ((0x1000, 16, 0),)), ("UCX", "VRAM", ((0x2000, 16, 1),)),
        ("UCX", "BLK", ((0x3000, 16, 2),)), ("UCX", "OBJ", ((0x4000, 16, 3),)),
        ("UCX", "FILE", ((0x5000, 16, 4),))]


def test_structural_limits_accept_their_bounds():
    """64 sections, 64-byte backend names of letters, digits and '_', 64 KiB of connection info."""
    assert len(M.parse_agent_metadata(_blob(sections=((b"UCX", 0, ()),) * 64)).sections) == 64
    meta = M.parse_agent_metadata(_blob(
        backends=((b"UCX", _ADDR), (b"GDS_MT", b"c" * (1 << 16)), (b"B" * 63 + b"9", b"x")),
        sections=((b"GDS_MT", 2, ()), (b"B" * 63 + b"9", 3, ()))))
    assert meta.backends == (("UCX", 10), ("GDS_MT", 1 << 16), ("B" * 63 + "9", 1))
    assert [(s.backend, s.mem_type) for s in meta.sections] == [("GDS_MT", "BLK"),
                                                                 ("B" * 63 + "9", "OBJ")]


def _with_count(blob, count):
    """``blob``, whose last field is a u64 count, saying ``count``."""
    return blob[:-9] + _u64(count) + b"|"


# where the second backend's 't' and 'c' fields start, and the first section's 'bknd' field
_AT_C = _blob(backends=((b"UCX", _ADDR), (b"P", b"x"))).index(b"c" + _u64(1) + b"x|")
_AT_T = _AT_C - len(_fld(b"t", b"P"))
_AT_BKND = len(_blob(sections=()))


@pytest.mark.parametrize("blob, what", [
    (_blob(sections=((b"UCX", 0, ()),) * 65), "field 'nixlSecElms' counts 65; at most 64 are "
                                              "accepted"),
    (_with_count(_blob(sections=((b"UCX", 0, ()),)), (1 << 20) + 1),
     "field 'n' counts 1048577; at most 1048576 are accepted"),
    (_with_count(_blob(sections=((b"UCX", 0, ()),)), 1 << 20),   # the count passes: the blob ends
     f"the blob ends at byte {len(_blob(sections=((b'UCX', 0, ()),)))} inside the length of ''"),
    (_blob(backends=((b"UCX", _ADDR), (b"P", b"x" * ((1 << 16) + 1)))),
     f"field 'c' at byte {_AT_C} says 65537 bytes; it must be 1..65536"),
    (_blob(backends=((b"UCX", _ADDR), (b"P", b""))),
     f"field 'c' at byte {_AT_C} says 0 bytes; it must be 1..65536"),
    (_blob(backends=((b"UCX", _ADDR), (b"B" * 65, b"x"))),
     f"field 't' at byte {_AT_T} says 65 bytes; it must be 1..64"),
    (_blob(sections=((b"B" * 65, 0, ()),)),
     f"field 'bknd' at byte {_AT_BKND} says 65 bytes; it must be 1..64"),
    (_blob(backends=((b"UCX", _ADDR), (b"a" * 39 + b"-", b"x"))),
     f"backend name {b'a' * 32!r} is not a name of ASCII letters, digits and '_'"),
    (_blob(backends=((b"UCX", _ADDR), (b"UCX 2", b"x"))),
     "backend name b'UCX 2' is not a name of ASCII letters, digits and '_'"),
    (_B.replace(b"Conns", b"Connx", 1),
     f"byte {_CONNS} starts {b'Connx' + bytes([8]) + bytes(6)!r}, expected field 'Conns'"),
    (_blob(marker=b"MemSect"), f"field '' at byte {_MARK + 1} says 7 bytes; it must be 10..10"),
    (_blob(marker=b"MemSectionX"),
     f"field '' at byte {_MARK + 1} says 11 bytes; it must be 10..10"),
    (_blob(dlist=b"nixlSD"), f"field 'nixlDList' at byte {_AT_BKND + len(_fld(b'bknd', b'UCX'))} "
                             f"says 6 bytes; it must be 10..10"),
])
def test_structural_limits_refuse_one_past_exactly(blob, what):
    with pytest.raises(FkvError) as e:
        M.parse_agent_metadata(blob)
    assert str(e.value) == _refused(what)


@pytest.mark.parametrize("raw", [
    bytes([0x01, 0x08, 0xFF]),                  # v2: flag 0x08 (AM only) carries no bytes
    bytes([0x80]) + bytes(8) + b"\xff",          # v1: the same flag in the header's high nibble
    bytes([0x01, 0x0F, 0x00]) + bytes(16) + b"\xff",  # v2: every flag, an empty worker name
])
def test_ucx_walk_accepts_every_known_header_flag(raw):
    assert M.check_ucx_address(raw) is None


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("raw, why", [
    (bytes([0x02]) + bytes(8) + b"\xff", "has version 2 in its first byte (UCX knows 0 and 1)"),
    (bytes([0x0E, 0x00, 0xFF]), "has version 14 in its first byte (UCX knows 0 and 1)"),
    (_V1 + b"\x00\x80\x00\x00" + struct.pack("<3f", _NAN, 1, 1) + bytes(4) + b"\x80",
     "announces interface attributes (nan, 1.0, 1.0) (finite numbers and a bandwidth other than "
     "0 expected)"),
    (_V1 + b"\x00\x80\x00\x00" + struct.pack("<3f", 1, _INF, 1) + bytes(4) + b"\x80",
     "announces interface attributes (1.0, inf, 1.0) (finite numbers and a bandwidth other than "
     "0 expected)"),
    (_V1 + b"\x00\x80\x00\x00" + struct.pack("<3f", 1, 1, -_INF) + bytes(4) + b"\x80",
     "announces interface attributes (1.0, 1.0, -inf) (finite numbers and a bandwidth other than "
     "0 expected)"),
])
def test_ucx_walk_refuses_address_version_and_attributes_exactly(raw, why):
    with pytest.raises(FkvError) as e:
        M.check_ucx_address(raw)
    assert str(e.value) == _refused(f"the peer's UCX worker address ({len(raw)} bytes) {why}")


# Totality: whatever a peer's bytes become, the parse answers AgentMetadata or FkvError, never
# another exception (an IndexError, a struct.error, a KeyError of a memory type...).

_RICH_ADDR = _V1 + b"\x00\xa0\x07" + _v1_iface(iface=0xC0, tail=b"\x01a\x00\x00\x80")
_RICH = _blob(backends=((b"UCX", _RICH_ADDR), (b"POSIX", b"xyz")),
              sections=((b"UCX", 0, (_desc(key=_u64(0b100001) + b"\x00\x01k\x02kk\xff"),
                                     _desc(1 << 40, 7, 3))),
                        (b"UCX", 1, (_desc(key=_u64(1) + b"\x01\x00\xfe\x01ab\x02cd\xff"),)),
                        (b"POSIX", 4, (_u64(0) + _u64(8) + _u64(0),))))
_EDITS = st.lists(st.tuples(st.sampled_from(("set", "flip", "insert", "delete", "cut")),
                            st.integers(0, 1 << 16), st.binary(min_size=1, max_size=9)),
                  min_size=1, max_size=4)


def _edit(blob, edits):
    b = bytearray(blob)
    for op, at, data in edits:
        at %= len(b) + 1
        if op == "set":
            b[at:at + len(data)] = data
        elif op == "flip" and at < len(b):
            b[at] ^= data[0] or 1
        elif op == "insert":
            b[at:at] = data
        elif op == "delete":
            del b[at:at + len(data)]
        elif op == "cut":
            del b[at:]
        if not b:
            break
    return bytes(b)


def _parse_or_refuse(blob):
    try:
        meta = M.parse_agent_metadata(blob)
    except FkvError as e:
        assert type(e) is FkvError and "nothing was added" in str(e), repr(e)
        return
    assert [n for _, n in meta.backends] == [n for _, n in meta.conn_spans]
    assert all(a + n <= len(blob) for a, n in meta.conn_spans)


def test_the_rich_synthetic_blob_parses():
    meta = M.parse_agent_metadata(_RICH)
    assert [(s.backend, s.mem_type, len(s.descs)) for s in meta.sections] == [
        ("UCX", "DRAM", 2), ("UCX", "VRAM", 1), ("POSIX", "FILE", 1)]


@settings(max_examples=1000)
@given(_EDITS)
def test_corrupted_synthetic_blobs_parse_or_raise_fkverror_only(edits):
    _parse_or_refuse(_edit(_RICH, edits))


@settings(max_examples=300)
@given(edits=_EDITS)
def test_corrupted_real_blobs_parse_or_raise_fkverror_only(peer, edits):
    _parse_or_refuse(_edit(peer, edits))


@settings(max_examples=1000)
@given(st.binary(max_size=40), st.sampled_from(sorted(M._MEM_TYPES.values())),
       st.sampled_from((b"", _u64(1), _u64(1) + b"\x00", _u64(0b11) + b"\x01\x02k")))
def test_ucx_walks_take_any_bytes(tail, mem, head):
    for walk in (M.check_ucx_address, lambda raw: M.check_ucx_rkey(raw, mem)):
        try:
            assert walk(head + tail) is None
        except FkvError as e:
            assert type(e) is FkvError and "nothing was added" in str(e), repr(e)
