"""The pure request lifecycle of a prefill rank (fkv.connector.transport._lifecycle): release by identity.

Model-based state machine (hypothesis.stateful) against an independent model; the three attacks
of issue #12; bounded diagnostics under 100k bogus events; exact counters for a scripted run; the
expected-reader helper against the plan's own reads.
"""

from __future__ import annotations

import itertools
import re
import time

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fkv.connector import plan as plan_mod
from fkv.connector.transport._lifecycle import (
    KINDS,
    MAX_NOTIFICATION_BYTES,
    Notification,
    Release,
    Requests,
    expected_readers,
    notification,
    parse_notification,
)
from fkv.errors import FkvError

D = "decode-e"


def table(**kw):
    return Requests(num_layers=kw.pop("num_layers", 4), **kw)


# -- the notification format ----------------------------------------------------------------------

@given(st.binary(max_size=MAX_NOTIFICATION_BYTES + 16))
def test_parse_never_raises(data):
    out = parse_notification(data)
    assert isinstance(out, Notification | str)


@given(st.text(min_size=1, max_size=50),
       st.text(alphabet=st.characters(blacklist_characters="|", blacklist_categories=("Cs",)),
               min_size=1, max_size=20),
       st.integers(0, 65535), st.sampled_from(["done", "failed"]))
def test_notification_round_trip(request_id, engine_id, rank, status):
    try:
        message = notification(request_id, engine_id, rank, status)
    except FkvError:  # a request id with a lone surrogate cannot be sent
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in request_id)
        return
    assert parse_notification(message) == Notification(request_id, (engine_id, rank), status)


@pytest.mark.parametrize("message,why", [
    (b"victim:1", "does not start"),
    (b"fkv1|r|d|0", "fewer than 4 fields"),
    (b"fkv1|r|d|01|done", "rank is not"),
    (b"fkv1|r|d|-1|done", "rank is not"),
    (b"fkv1|r|d|65536|done", "rank is not"),
    (b"fkv1|r|d|\xd9\xa1|done", "rank is not"),   # an Arabic-Indic digit is not a rank
    (b"fkv1|r|\xff|0|done", "not UTF-8"),
    (b"fkv1||d|0|done", "request id is empty"),
    (b"fkv1|r|d|0|ok", "status"),
    (b"fkv1|" + b"r" * 5000 + b"|d|0|done", "more than"),
    ("fkv1|r|d|0|done", "not bytes"),
])
def test_parse_refuses(message, why):
    assert why in parse_notification(message)


def test_notification_refuses_bad_fields():
    with pytest.raises(FkvError, match=r"'reader\[0\]' must be a non-empty UTF-8 str without '\|'"):
        notification("r", "a|b", 0)
    with pytest.raises(FkvError, match=r"'request_id' must be at most 4096 UTF-8 bytes \(got 4097\)"):
        notification("x" * 4097, "d", 0)
    with pytest.raises(FkvError, match="'status' must be one of"):
        notification("r", "d", 0, "maybe")


# -- expected readers -----------------------------------------------------------------------------

def test_expected_readers_match_the_plan():
    """Each decode rank notifies the ranks it reads and the ones it only notifies (replicated KV,
    MLA); a prefill rank's expected readers are exactly the decode ranks whose group names it."""
    checked = 0
    for total, dtp, ptp in itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8, 16], [1, 2, 4, 8, 16]):
        groups = {}
        try:
            for t in range(dtp):
                reads, notify = plan_mod._reads(dtp, t, ptp, total)
                groups[t] = {r.remote_rank for r in reads} | set(notify)
        except AssertionError:  # a pair the handshake refuses
            continue
        for p in range(ptp):
            want = frozenset((D, t) for t in range(dtp) if p in groups[t])
            got = expected_readers(D, dtp, ptp, p)
            assert got == want, (total, dtp, ptp, p)
            assert len(got) == plan_mod.expected_notifications(ptp, dtp)
            checked += 1
    assert checked > 300


def test_expected_readers_refuses():
    with pytest.raises(FkvError, match=r"'decode_tp' must be a multiple or divisor of prefill_tp 2"):
        expected_readers(D, 3, 2, 0)
    with pytest.raises(FkvError, match=r"'prefill_rank' must be an int in \[0, 2\) \(got 2\)"):
        expected_readers(D, 4, 2, 2)


# -- the three attacks ----------------------------------------------------------------------

def test_attack_one_rank_reading_twice_does_not_free():
    """P TP=1 -> D TP=2: decode rank 1 notifies twice; rank 0 never read: still held."""
    t = table()
    t.bind("agent-d1", (D, 1))
    t.bind("agent-d0", (D, 0))
    t.hold("req", [1, 2], expected_readers(D, 2, 1, 0), now=0, lease=30)
    assert t.notified("agent-d1", notification("req", D, 1), now=1) is None
    assert t.notified("agent-d1", notification("req", D, 1), now=2) is None
    assert t.pending() == {"req"}
    assert t.waiting_for("req") == {(D, 0)}
    assert t.stats()["duplicate"] == 1
    assert t.notified("agent-d0", notification("req", D, 0), now=3) == Release("req", [1, 2],
                                                                                "notified")


def test_attack_retry_after_failed_read_does_not_double_count():
    """P TP=1 -> D TP=2: rank 0's read fails (it says so, or says nothing), then it retries and
    notifies done twice (one per attempt that reached this rank): counts once; rank 1 still
    needed."""
    t = table()
    t.bind("agent-d0", (D, 0))
    t.bind("agent-d1", (D, 1))
    t.hold("req", [5], expected_readers(D, 2, 1, 0), now=0, lease=30)
    assert t.notified("agent-d0", notification("req", D, 0, "failed"), now=1) is None
    assert t.notified("agent-d0", notification("req", D, 0), now=2) is None
    assert t.notified("agent-d0", notification("req", D, 0), now=3) is None
    assert t.pending() == {"req"} and t.waiting_for("req") == {(D, 1)}
    s = t.stats()
    assert (s["failed"], s["accepted"], s["duplicate"]) == (1, 1, 1)


def test_attack_foreign_agent_cannot_free():
    """Any NIXL agent can send a notification: the legacy b'victim:1', and the new format
    claiming a real reader, from an agent nobody bound, free nothing."""
    t = table()
    t.bind("agent-d0", (D, 0))
    t.hold("victim", [9], expected_readers(D, 1, 1, 0), now=0, lease=30)
    for message in (b"victim:1", notification("victim", D, 0), notification("victim", D, 1)):
        assert t.notified("evil-agent", message, now=1) is None
    # a bound agent speaking for another reader is an impersonation
    t.bind("agent-other", (D, 5))
    assert t.notified("agent-other", notification("victim", D, 0), now=1) is None
    # with bindings optional, an unbound agent still cannot speak for a bound reader
    t.require_binding = False
    assert t.notified("evil-agent", notification("victim", D, 0), now=1) is None
    assert t.pending() == {"victim"}
    s = t.stats()
    assert (s["malformed"], s["foreign"], s["impersonation"], s["accepted"]) == (1, 2, 2, 0)
    assert t.notified("agent-d0", notification("victim", D, 0), now=2).reason == "notified"


def test_non_utf8_sender_is_foreign():
    t = table()
    t.hold("r", None, expected_readers(D, 1, 1, 0), now=0, lease=1)
    assert t.notified(b"\xff\xfe", notification("r", D, 0), now=0) is None
    assert t.notified(None, notification("r", D, 0), now=0) is None
    assert t.stats()["foreign"] == 2


def test_readers_fixed_by_the_first_engine_when_not_named():
    """The prefill side usually does not know which decode engine will read: hold with
    expected_readers=None; the first counted ``done`` fixes them to that engine's readers of
    this rank (P TP=2 rank 1, D TP=4: decode ranks 2 and 3)."""
    t = Requests(num_layers=1, prefill_tp=2, prefill_rank=1)
    for rank in range(4):
        t.bind(f"d{rank}", (D, rank), decode_tp=4)
    t.bind("x0", ("other", 0), decode_tp=1)
    t.bind("nt", ("old", 0))                             # bound without decode_tp
    t.hold("r", [7], None, now=0, lease=30)
    assert t.waiting_for("r") is None
    assert t.notified("nt", notification("r", "old", 0), now=1) is None      # cannot resolve
    assert t.notified("d0", notification("r", D, 0), now=1) is None          # reads rank 0
    assert t.notified("d3", notification("r", D, 3, "failed"), now=1) is None
    assert t.waiting_for("r") is None                                        # nothing counted
    assert t.notified("d3", notification("r", D, 3), now=2) is None
    assert t.waiting_for("r") == {(D, 2)}
    assert t.notified("x0", notification("r", "other", 0), now=2) is None    # engine is fixed
    assert t.notified("d2", notification("r", D, 2), now=3) == Release("r", [7], "notified")
    s = t.stats()
    assert (s["unexpected_reader"], s["failed"], s["accepted"]) == (3, 1, 2)
    with pytest.raises(FkvError, match=r"'decode_tp' must be None or an int in \(3, 65536\]"):
        t.bind("d3", (D, 3), decode_tp=2)


# -- streaming ------------------------------------------------------------------------------------

def test_streaming_publish_and_premature_done():
    """A ``done`` before the last layer is published (a decode rank that only notifies this
    rank: it read replicated heads from another) is counted as premature and kept; the publish
    of the last layer releases the request, never earlier."""
    t = table(num_layers=3)
    t.bind("a", (D, 0))
    t.hold("s", [1], expected_readers(D, 1, 1, 0), now=0, lease=30, layers_ready=0)
    assert t.layers_ready("s") == 0
    assert t.publish("s", 2, now=1) is None
    assert t.notified("a", notification("s", D, 0), now=1) is None   # before layer 3
    assert (t.stats()["premature"], t.stats()["accepted"]) == (1, 1)
    assert t.pending() == {"s"} and t.waiting_for("s") == frozenset()
    assert t.events()[-1][1:3] == ("premature", "'a'")
    assert t.notified("a", notification("s", D, 0), now=1) is None   # the same reader again
    assert t.stats()["duplicate"] == 1 and t.pending() == {"s"}
    with pytest.raises(FkvError, match=r"'layers_ready' must be an int in \[2, 3\].*\(got 1\)"):
        t.publish("s", 1, now=2)
    with pytest.raises(FkvError, match=r"'layers_ready' must be an int in \[2, 3\].*\(got 4\)"):
        t.publish("s", 4, now=2)
    with pytest.raises(FkvError, match="'request_id' must be a request this rank holds"):
        t.publish("nope", 1, now=2)
    assert t.publish("s", 2, now=2) is None   # monotonic, not strictly increasing
    assert t.publish("s", 3, now=2) == Release("s", [1], "notified")
    assert t.pending() == frozenset() and t.released() == {"s": "notified"}
    assert t.stats()["released_notified"] == 1
    # a request every layer of which is published before its reader is done: released by it
    t.hold("u", [2], expected_readers(D, 1, 1, 0), now=3, lease=30, layers_ready=0)
    assert t.publish("u", 3, now=3) is None
    assert t.notified("a", notification("u", D, 0), now=4).reason == "notified"
    with pytest.raises(FkvError, match="'layers_ready' must be an int in \\[0, 3\\]"):
        t.hold("x", None, expected_readers(D, 1, 1, 0), now=0, lease=1, layers_ready=4)


# -- exact counters -------------------------------------------------------------------------------

def test_scripted_counters():
    t = table(num_layers=1, diagnostics=4, history=2)
    readers = expected_readers(D, 4, 2, 0)          # (D,0), (D,1)
    for rank in range(4):
        t.bind(f"a{rank}", (D, rank))
    t.hold("r1", "blocks-1", readers, now=0, lease=10)
    t.hold("r2", "blocks-2", readers, now=0, lease=5)
    t.hold("r2", None, readers, now=1, lease=5)        # renew: deadline 6, blocks kept
    events = [
        ("a0", notification("r1", D, 0)),              # accepted
        ("a0", notification("r1", D, 0)),              # duplicate
        ("a2", notification("r1", D, 2)),              # unexpected_reader (reads prefill rank 1)
        ("a1", notification("r1", D, 0)),              # impersonation
        ("zz", notification("r1", D, 1)),              # foreign
        ("a1", notification("nobody", D, 1)),          # unknown_request
        ("a1", b"\xff" * 10),                          # malformed
        ("a1", notification("r1", D, 1, "failed")),    # failed
        ("a1", notification("r1", D, 1)),              # accepted -> release r1
        ("a1", notification("r1", D, 1)),              # late
    ]
    out = [t.notified(agent, message, now=2) for agent, message in events]
    assert out[8] == Release("r1", "blocks-1", "notified")
    assert all(o is None for i, o in enumerate(out) if i != 8)
    assert t.expire(now=5.9) == []
    assert t.expire(now=6) == [Release("r2", "blocks-2", "lease expired")]
    t.hold("r3", None, readers, now=7, lease=1)
    t.expire(now=8)
    assert t.released() == {"r2": "lease expired", "r3": "lease expired"}   # history=2
    assert [e[1] for e in t.events()] == ["unknown_request", "malformed", "failed", "late"]
    assert t.stats() == {
        "held": 3, "accepted": 2, "released_notified": 1, "released_expired": 2,
        "duplicate": 1, "unexpected_reader": 1, "unknown_request": 1, "late": 1, "failed": 1,
        "premature": 0, "malformed": 1, "foreign": 1, "impersonation": 1, "bindings_evicted": 0,
        "rebind_refused": 0,
        "pending": 0, "bindings": 4,
    }
    assert set(KINDS) <= set(t.stats())


def test_hold_refuses_bad_input():
    t = table()
    r = expected_readers(D, 1, 1, 0)
    with pytest.raises(FkvError, match="'expected_readers' must be None or a non-empty frozenset"):
        t.hold("r", None, frozenset(), now=0, lease=1)
    with pytest.raises(FkvError, match="'lease' must be a positive number"):
        t.hold("r", None, r, now=0, lease=0)
    with pytest.raises(FkvError, match="'now' must be a finite number"):
        t.hold("r", None, r, now=float("nan"), lease=1)
    t.hold("r", None, r, now=0, lease=1)
    with pytest.raises(FkvError, match="'expected_readers' must be the readers 'r' is already"):
        t.hold("r", None, expected_readers(D, 2, 1, 0), now=0, lease=1)
    with pytest.raises(FkvError, match=r"'reader\[1\]' must be an int"):
        t.bind("a", (D, -1))


def test_bindings_bounded_and_rebinding():
    t = table(max_bindings=3)
    for i in range(5):
        t.bind(f"a{i}", (D, i))
    assert t.stats()["bindings"] == 3 and t.stats()["bindings_evicted"] == 2
    assert t.bound("a0") is None and t.bound("a4") == (D, 4)
    t.bind("a4-new", (D, 4))          # the reader reconnected with a new agent
    assert t.bound("a4") is None and t.bound("a4-new") == (D, 4)


def test_a_binding_made_with_a_secret_is_moved_only_with_it():
    """While a held request names a reader bound with a secret, the process that bound it can
    rebind it (reconnecting with a new agent); any other bind that would move that reader, or
    move its agent to another reader, is refused with the same message and counted (so is
    binding it again without the secret, which would drop the secret), and the binding keeps
    counting. Once no held request names it, a new process may bind it (a restart under the
    same engine id)."""
    t = table()
    t.bind("victim", (D, 0), decode_tp=1, secret=b"s" * 32)
    t.hold("r", [1], expected_readers(D, 1, 1, 0), now=0, lease=30)
    attempts = [("evil", (D, 0), None), ("evil", (D, 0), b"x" * 32),
                ("victim", ("evil-engine", 0), b"x" * 32), ("victim", (D, 0), None)]
    for agent, reader, secret in attempts:
        with pytest.raises(FkvError) as e:
            t.bind(agent, reader, decode_tp=1, secret=secret)
        assert str(e.value) == ("bind refused: reader ('decode-e', 0) is named by 1 held "
                                "request(s) and was bound by a process holding its secret; only "
                                "that process can rebind it or its agent until they are "
                                "released (a new decode process can take a new engine id)")
    assert t.stats()["rebind_refused"] == len(attempts)
    assert t.bound("victim") == (D, 0) and t.bound("evil") is None
    t.bind("victim-2", (D, 0), decode_tp=1, secret=b"s" * 32)   # the same process, a new agent
    assert t.bound("victim") is None and t.bound("victim-2") == (D, 0)
    assert t.notified("victim-2", notification("r", D, 0), now=1) == Release("r", [1], "notified")
    t.bind("restarted", (D, 0), decode_tp=1, secret=b"n" * 32)   # nothing held names it now
    assert t.bound("victim-2") is None and t.bound("restarted") == (D, 0)
    t.bind("open", ("o", 0))                 # bound without a secret: anyone may move it
    t.bind("taker", ("o", 0), secret=b"t" * 16)
    assert t.bound("open") is None and t.bound("taker") == ("o", 0)


def test_a_flood_of_bindings_never_unbinds_a_reader_a_held_request_names():
    """Past ``max_bindings`` the least recently used binding goes (an accepted notification
    counts as use), never one whose reader a held request names; when the oldest EVICTION_SCAN
    bindings are all named, the new bind is refused instead."""
    from fkv.connector.transport._lifecycle import EVICTION_SCAN

    t = table(max_bindings=3)
    t.bind("a0", (D, 0), secret=b"0" * 16)
    t.bind("a1", (D, 1))
    t.hold("r", [1], frozenset({(D, 0)}), now=0, lease=30)   # names (D, 0): kept
    for i in range(2, 10):
        t.bind(f"a{i}", (D, i))
    assert t.bound("a0") == (D, 0) and [t.bound(f"a{i}") for i in (1, 7, 8, 9)] == \
        [None, None, (D, 8), (D, 9)]
    assert t.stats()["bindings_evicted"] == 7
    assert t.notified("a0", notification("r", D, 0), now=1) == Release("r", [1], "notified")
    t.bind("a10", (D, 10))                    # a0 was used last: a8 goes first
    assert t.bound("a8") is None and t.bound("a0") == (D, 0)
    t.bind("a11", (D, 11))
    t.bind("a12", (D, 12))                    # (D, 0) is named by nothing now: it goes too
    assert t.bound("a0") is None and t.stats()["bindings_evicted"] == 10
    full = table(max_bindings=EVICTION_SCAN)
    readers = frozenset((D, i) for i in range(EVICTION_SCAN))
    for i in range(EVICTION_SCAN):
        full.bind(f"b{i}", (D, i))
    full.hold("all", [1], readers, now=0, lease=30)
    with pytest.raises(FkvError) as e:
        full.bind("flood", ("x", 0))
    assert str(e.value) == (f"bind refused: this prefill rank keeps at most {EVICTION_SCAN} "
                            f"reader bindings and the {EVICTION_SCAN} least recently used are "
                            f"readers of held requests")
    assert full.stats()["bindings"] == EVICTION_SCAN and full.bound("flood") is None


# -- bounded under a flood ------------------------------------------------------------------------

def test_diagnostics_bounded_under_100k_bogus_events():
    t = table(diagnostics=128, history=64)
    t.bind("good", (D, 0))
    readers = expected_readers(D, 2, 1, 0)
    t.hold("keep", [0], readers, now=0, lease=1e9)
    bogus = [
        ("evil", notification("keep", D, 0)),
        ("good", notification("keep", D, 0)),           # 1 accepted, then duplicates
        ("good", b"\x00" * 9000),
        ("good", notification("x" * 4000, D, 0)),
        ("good", b"fkv1|" + b"\xff" * 500 + b"|d|0|done"),
        ("\u00e9" * 1024, b"victim:1"),
    ]
    t0 = time.perf_counter()
    for i in range(100_000):
        agent, message = bogus[i % len(bogus)]
        assert t.notified(agent, message, now=float(i)) is None
        if i % 1000 == 0:
            t.hold(f"tmp{i}", None, readers, now=float(i), lease=0.5)
            t.expire(now=float(i) + 1)
    took = time.perf_counter() - t0
    assert len(t.events()) == 128
    assert len(t.released()) == 64
    assert max(len(e[2]) + len(e[3]) for e in t.events()) < 600
    assert t.pending() == {"keep"} and t.waiting_for("keep") == {(D, 1)}
    s = t.stats()
    assert sum(s[k] for k in ("duplicate", "unknown_request", "malformed", "foreign",
                              "impersonation")) == 100_000 - 1
    print(f"100k bogus notifications in {took:.2f} s; stats {s}")


def test_exhaustive_event_orders():
    """P TP=1 -> D TP=2, every sequence of up to 5 events out of 7 kinds (19607 sequences): the
    request is released exactly at the event where both honest ``done`` have arrived."""
    events = [
        ("a0", notification("r", D, 0)),             # honest reader 0
        ("a1", notification("r", D, 1)),             # honest reader 1
        ("a1", notification("r", D, 0)),             # reader 1 impersonating reader 0
        ("a0", notification("r", D, 0, "failed")),   # reader 0's read failed
        ("evil", notification("r", D, 1)),           # a foreign agent
        ("a0", notification("other", D, 0)),         # another request
        ("a1", b"r:2"),                              # the legacy format
    ]
    sequences = 0
    for n in range(1, 6):
        for seq in itertools.product(range(len(events)), repeat=n):
            t = table()
            t.bind("a0", (D, 0))
            t.bind("a1", (D, 1))
            t.hold("r", None, expected_readers(D, 2, 1, 0), now=0, lease=10)
            done, released = set(), False
            for i in seq:
                out = t.notified(*events[i], now=1)
                if not released and i in (0, 1):
                    done.add(i)
                    if done == {0, 1}:
                        assert out == Release("r", None, "notified")
                        released = True
                        continue
                assert out is None
            assert ("r" in t.pending()) == (not released)
            sequences += 1
    assert sequences == sum(7 ** n for n in range(1, 6))


# -- the state machine against a model --------------------------------------------------------------

AGENTS = ["a0", "a1", "a2", "evil"]
READERS = [(D, 0), (D, 1), (D, 2), ("other", 0)]
REQUESTS = ["r0", "r1", "r2"]
LAYERS = 2


class LifecycleMachine(RuleBasedStateMachine):
    """An independent model: a request is released exactly when every expected reader sent an
    accepted ``done`` (through the agent bound to it) and all its layers are published (by the
    last of the two events), or at its lease."""

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.binding: dict[str, tuple] = {}
        self.tps: dict[str, int] = {}    # the decode TP each agent was bound with
        self.held: dict[str, dict] = {}
        self.t = Requests(num_layers=LAYERS, diagnostics=16, history=8)
        for agent, reader in zip(AGENTS[:3], READERS[:3], strict=True):
            self.t.bind(agent, reader, decode_tp=3)
            self.binding[agent] = reader
            self.tps[agent] = 3

    @initialize(require=st.booleans())
    def setup(self, require):
        self.t.require_binding = require

    @rule(agent=st.sampled_from(AGENTS[:3]), reader=st.sampled_from(READERS))
    def rebind(self, agent, reader):
        self.t.bind(agent, reader, decode_tp=3 if reader[0] == D else 1)
        self.tps[agent] = 3 if reader[0] == D else 1
        self.binding = {a: r for a, r in self.binding.items() if a != agent and r != reader}
        self.binding[agent] = reader

    @rule(rid=st.sampled_from(REQUESTS),
          readers=st.sets(st.sampled_from(READERS[:3] * 3 + READERS[3:]), min_size=1, max_size=2),
          lease=st.floats(0.5, 50), streaming=st.sampled_from([False, False, True]),
          named=st.sampled_from([True, True, False]))
    def hold(self, rid, readers, lease, streaming, named):
        """``named`` False: the readers are left to the first engine that reads."""
        readers = frozenset(readers) if named else None
        if rid in self.held:
            h = self.held[rid]
            if readers is not None and h["expected"] is not None and h["expected"] != readers:
                with pytest.raises(FkvError):
                    self.t.hold(rid, rid, readers, now=self.now, lease=lease)
                return
            self.t.hold(rid, rid, readers, now=self.now, lease=lease)
            h["expected"] = h["expected"] or readers
            h["deadline"] = max(h["deadline"], self.now + lease)
            return
        self.t.hold(rid, rid, readers, now=self.now, lease=lease,
                    layers_ready=0 if streaming else None)
        self.held[rid] = {"expected": readers, "deadline": self.now + lease, "done": set(),
                          "layers": 0 if streaming else LAYERS}

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def publish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        n = data.draw(st.integers(0, LAYERS + 1))
        if self.held[rid]["layers"] <= n <= LAYERS:
            out = self.t.publish(rid, n, now=self.now)
            h = self.held[rid]
            h["layers"] = n
            if n == LAYERS and h["expected"] is not None and h["done"] == h["expected"]:
                assert out == Release(rid, rid, "notified")
                event("released by the last publish")
                del self.held[rid]
            else:
                assert out is None
        else:
            with pytest.raises(FkvError, match="'layers_ready' must be an int in"):
                self.t.publish(rid, n, now=self.now)

    @rule(agent=st.sampled_from(AGENTS), rid=st.sampled_from(REQUESTS + ["zz"]),
          claim=st.one_of(st.none(), st.sampled_from(READERS)),
          status=st.sampled_from(["done", "done", "failed"]))
    def notify(self, agent, rid, claim, status):
        """``claim`` None: the agent speaks for the reader it is bound to (the honest case)."""
        reader = claim or self.binding.get(agent, READERS[0])
        out = self.t.notified(agent, notification(rid, *reader, status), now=self.now)
        bound = self.binding.get(agent)
        speaks = bound == reader if bound is not None else (
            not self.t.require_binding and reader not in self.binding.values())
        h = self.held.get(rid)
        expected = None if h is None else h["expected"]
        if h is not None and expected is None and bound is not None:
            expected = frozenset((reader[0], t) for t in range(self.tps[agent]))
        counts = (speaks and expected is not None and reader in expected and status == "done"
                  and reader not in h["done"])
        if counts:
            if h["expected"] is None:
                event("readers fixed by the first engine")
            h["expected"] = expected
            h["done"].add(reader)
            event("a notification counted" if h["layers"] == LAYERS
                  else "a notification counted before the last layer")
        if counts and h["done"] == h["expected"] and h["layers"] == LAYERS:
            assert out == Release(rid, rid, "notified")
            event("released by notifications")
            del self.held[rid]
        else:
            assert out is None

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def honest_reader(self, data):
        """A bound reader that a held request waits for finishes its reads (the common path)."""
        rid = data.draw(st.sampled_from(sorted(self.held)))
        expected = self.held[rid]["expected"]
        agents = sorted(a for a, r in self.binding.items() if expected is None or r in expected)
        if agents:
            self.notify(data.draw(st.sampled_from(agents)), rid, None, "done")

    @rule(junk=st.binary(max_size=64), agent=st.sampled_from(AGENTS))
    def junk(self, junk, agent):
        assert self.t.notified(agent, b"x" + junk, now=self.now) is None

    @rule(dt=st.floats(0, 10))
    def advance_and_expire(self, dt):
        self.now += dt
        out = self.t.expire(now=self.now)
        want = {r for r, h in self.held.items() if h["deadline"] <= self.now}
        assert {x.request_id for x in out} == want
        assert all(x.reason == "lease expired" for x in out)
        for r in want:
            event("released by lease")
            del self.held[r]

    @invariant()
    def same_pending(self):
        """Never released early, never kept late: the table and the model agree at every step."""
        assert self.t.pending() == set(self.held)
        for rid, h in self.held.items():
            want = None if h["expected"] is None else h["expected"] - h["done"]
            assert self.t.waiting_for(rid) == want
        assert len(self.t.events()) <= 16 and len(self.t.released()) <= 8


TestLifecycleMachine = LifecycleMachine.TestCase
TestLifecycleMachine.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)


def test_holding_a_held_id_again_keeps_its_blocks_and_layers() -> None:
    """A second hold of a held id renews its lease (with the arguments of the first one too);
    one with other blocks (which would lose the first ones: never released) or a layer count
    above the published one is refused, naming both."""
    import numpy as np

    t = Requests(num_layers=4)
    t.hold("r", [1, 2], None, now=0, lease=5, layers_ready=0)
    t.publish("r", 2, now=0)
    t.hold("r", np.array([1, 2]), None, now=1, lease=5)   # the same ids, another container
    t.hold("r", [1, 2], None, now=2, lease=5, layers_ready=0)  # the first hold's arguments
    assert t.layers_ready("r") == 2
    with pytest.raises(FkvError) as e:
        t.hold("r", [8, 9], None, now=3, lease=5)
    assert str(e.value) == (
        "'block_ids' must be the blocks 'r' is already held with ([1, 2]) or None (got "
        "'[8, 9]'); release it (or let its lease run out) before holding the id with other "
        "blocks")
    with pytest.raises(FkvError) as e:
        t.hold("r", None, None, now=3, lease=5, layers_ready=3)
    assert str(e.value) == ("'layers_ready' must be None or at most the 2 layers 'r' is held "
                            "with now (a renewal never claims layers written) (got 3); publish() "
                            "moves a held request's layers forward")
    assert t.expire(now=7) == [Release("r", [1, 2], "lease expired")]


def test_expire_after_renewals_reuse_and_many_releases():
    """Leases kept in a deadline heap: a renewal moves a lease later without a new entry, a
    released id held anew keeps only its new lease, and the entries of thousands of released
    holds neither release anything nor pile up."""
    t = Requests(num_layers=2, require_binding=False)
    t.hold("a", [1], None, now=0.0, lease=5.0)
    t.hold("b", [2], None, now=0.0, lease=5.0)
    t.hold("a", None, None, now=3.0, lease=5.0)          # renewed: due at 8
    assert t.expire(now=5.0) == [Release("b", [2], "lease expired")]
    assert t.expire(now=7.9) == [] and t.holds("a")
    assert t.expire(now=8.0) == [Release("a", [1], "lease expired")]
    t.hold("c", [3], None, now=10.0, lease=1.0)
    assert t.expire(now=11.0) == [Release("c", [3], "lease expired")]
    t.hold("c", [4], None, now=11.0, lease=9.0)          # the id again: its first entry is gone
    assert t.expire(now=19.9) == [] and t.holds("c")
    assert t.expire(now=20.0) == [Release("c", [4], "lease expired")]
    for i in range(5000):                                # held and released at once
        t.hold(f"r{i}", [i], frozenset({("d", 0)}), now=30.0, lease=100.0)
        t.bind("agent", ("d", 0))
        assert t.notified("agent", notification(f"r{i}", "d", 0), now=30.0) is not None
    t.hold("z", [9], None, now=30.0, lease=1.0)
    assert len(t._deadlines) <= 2 * len(t.pending()) + 1025
    assert t.expire(now=200.0) == [Release("z", [9], "lease expired")]
    assert t.pending() == frozenset() and not t.holds("z")


# -- bounds and refusals pinned by a mutation audit ------------------------------------------------

def test_longest_notification_round_trips_and_one_byte_more_is_refused():
    """Every field at its limit (a 4096-byte request id, a 256-byte engine id, rank 65535,
    ``failed``) is sent and parsed; one byte more in either id is refused on both sides."""
    from fkv.connector.transport._lifecycle import MAX_ENGINE_ID_BYTES, MAX_REQUEST_ID_BYTES

    rid, eid = "r" * MAX_REQUEST_ID_BYTES, "\u00e9" * (MAX_ENGINE_ID_BYTES // 2)   # 2 bytes each
    message = notification(rid, eid, 65535, "failed")
    assert len(message) == 5 + 4096 + 1 + 256 + 1 + 5 + 1 + 6
    assert parse_notification(message) == Notification(rid, (eid, 65535), "failed")
    assert parse_notification(b"fkv1|" + b"r" * 4097 + b"|d|0|done") == \
        "request id is empty or longer than 4096 bytes"
    assert parse_notification(b"fkv1|r|" + b"e" * 257 + b"|0|done") == \
        "engine id is empty or longer than 256 bytes"
    with pytest.raises(FkvError) as e:
        notification("r", "e" * 257, 0)
    assert str(e.value).startswith("'reader[0]' must be a non-empty UTF-8 str without '|' of at "
                                   "most 256 bytes (got ")
    with pytest.raises(FkvError) as e:
        notification("r", D, 65536)
    assert str(e.value) == "'reader[1]' must be an int in [0, 65536) (got 65536)"


def test_constructor_and_helpers_refuse_zero_and_bool():
    for name in ("num_layers", "history", "diagnostics", "max_bindings", "prefill_tp"):
        kw = {"num_layers": 1, name: 0}
        with pytest.raises(FkvError) as e:
            Requests(**kw)
        assert str(e.value) == f"'{name}' must be a positive int (got 0)"
    with pytest.raises(FkvError) as e:
        expected_readers(D, 0, 1, 0)
    assert str(e.value) == "'decode_tp' must be an int in [1, 65536] (got 0)"
    with pytest.raises(FkvError) as e:
        expected_readers(D, 1, 0, 0)
    assert str(e.value) == "'prefill_tp' must be an int in [1, 65536] (got 0)"
    t = table()
    for call in (lambda: t.hold("r", None, None, now=True, lease=1),
                 lambda: t.expire(now=float("nan")),
                 lambda: t.notified("a", b"x", now=float("inf"))):
        with pytest.raises(FkvError) as e:
            call()
        assert str(e.value).startswith("'now' must be a finite number of seconds (got ")
    t.hold("r", [1], None, now=0, lease=1, layers_ready=0)
    with pytest.raises(FkvError) as e:
        t.publish("r", 4, now=float("nan"))
    assert str(e.value) == "'now' must be a finite number of seconds (got nan)"
    assert t.layers_ready("r") == 0
    with pytest.raises(FkvError) as e:
        t.bind("a", (D, 3), decode_tp=3)
    assert str(e.value) == ("'decode_tp' must be None or an int in (3, 65536] (the reader's rank "
                            "is 3) (got 3)")


def test_require_binding_false_in_the_constructor():
    """``require_binding=False`` given to the constructor: an unbound agent speaks for a reader
    nobody bound (never for a bound one)."""
    t = Requests(num_layers=1, require_binding=False)
    t.bind("a1", (D, 1))
    t.hold("r", [4], frozenset({(D, 0), (D, 1)}), now=0, lease=10)
    assert t.notified("anyone", notification("r", D, 1), now=1) is None    # (D, 1) is bound
    assert t.notified("anyone", notification("r", D, 0), now=1) is None    # counts
    assert t.waiting_for("r") == {(D, 1)}
    assert (t.stats()["impersonation"], t.stats()["accepted"]) == (1, 1)
    assert t.notified("a1", notification("r", D, 1), now=2) == Release("r", [4], "notified")


def test_sender_names_as_bytes_and_at_the_length_limit():
    """NIXL may hand the sender as bytes: a UTF-8 name counts as the str; a name of exactly
    1024 characters is a name, 1025 is foreign."""
    t = table(num_layers=1)
    long_name = "n" * 1024
    t.bind("a0", (D, 0))
    t.bind(long_name, (D, 1))
    t.hold("r", [1], expected_readers(D, 2, 1, 0), now=0, lease=10)
    assert t.notified(b"a0", notification("r", D, 0), now=1) is None
    assert t.notified("n" * 1025, notification("r", D, 1), now=1) is None
    assert t.stats()["foreign"] == 1 and t.waiting_for("r") == {(D, 1)}
    assert t.notified(bytearray(long_name.encode()), notification("r", D, 1), now=1) == \
        Release("r", [1], "notified")
    assert t.stats()["accepted"] == 2


def test_an_engine_bound_with_a_tp_no_plan_allows_is_refused_not_raised():
    """Readers left to the first engine: one bound with a decode TP that does not pair with this
    rank's (3 with prefill TP 2) costs it an ``unexpected_reader``, never an exception."""
    t = Requests(num_layers=1, prefill_tp=2, prefill_rank=0)
    t.bind("odd", (D, 0), decode_tp=3)
    t.hold("r", [1], None, now=0, lease=10)
    assert t.notified("odd", notification("r", D, 0), now=1) is None
    assert t.stats()["unexpected_reader"] == 1 and t.waiting_for("r") is None
    assert "'decode_tp' must be a multiple or divisor of prefill_tp 2" in t.events()[-1][3]


def test_readers_named_late_are_protected_from_rebinding():
    """A reader fixed after the first hold (by a renewal naming it, or by the first engine that
    reads) is named by a held request from then on: its secret binding cannot be taken over,
    nor evicted by a flood of binds, until the request is released."""
    refused = ("bind refused: reader ('decode-e', 1) is named by 1 held request(s) and was bound "
               "by a process holding its secret")
    # named by a renewal
    t = table(num_layers=1)
    t.bind("d1", (D, 1), secret=b"s" * 16)
    t.hold("r", [1], None, now=0, lease=10)
    t.hold("r", None, frozenset({(D, 1)}), now=1, lease=10)
    with pytest.raises(FkvError, match=re.escape(refused)):
        t.bind("evil", (D, 1))
    # fixed by the first engine that reads (P TP=1 -> D TP=2: ranks 0 and 1)
    t = table(num_layers=1, max_bindings=2)
    t.bind("d1", (D, 1), decode_tp=2, secret=b"s" * 16)
    t.bind("d0", (D, 0), decode_tp=2)
    t.hold("r", [1], None, now=0, lease=10)
    assert t.notified("d0", notification("r", D, 0), now=1) is None
    with pytest.raises(FkvError, match=re.escape(refused)):
        t.bind("evil", (D, 1))
    with pytest.raises(FkvError, match="bind refused: this prefill rank keeps at most 2"):
        t.bind("flood", ("x", 0))                 # both bindings are readers of "r"
    assert t.bound("d1") == (D, 1) and t.bound("d0") == (D, 0)
    assert t.notified("d1", notification("r", D, 1), now=2) == Release("r", [1], "notified")


def test_a_binding_made_without_a_secret_drops_the_old_one():
    """A reader bound with a secret, then (named by nothing) bound anew without one: the new
    binding has no secret, so once a request names it anyone may move it (as documented for a
    binding without a secret). Bindings evicted by a flood forget their secrets."""
    t = table()
    t.bind("first", (D, 0), secret=b"s" * 16)
    t.bind("second", (D, 0))
    t.hold("r", [1], frozenset({(D, 0)}), now=0, lease=10)
    t.bind("third", (D, 0))
    assert t.bound("third") == (D, 0) and t.bound("second") is None
    flood = table(max_bindings=4)
    for i in range(100):
        flood.bind(f"a{i}", (D, i), secret=b"k" * 16)
    assert flood.stats()["bindings"] == 4 and len(flood._secrets) == 4


def test_a_reader_rebinding_at_a_full_table_takes_its_own_place():
    """A bound reader reconnecting with a new agent does not grow the table: it evicts nothing,
    and is not refused when every other binding is a reader of a held request. A refused bind
    names how many bindings were looked at (here fewer than EVICTION_SCAN)."""
    t = table(max_bindings=3)
    for i in range(3):
        t.bind(f"a{i}", (D, i))
    t.hold("r", [1], frozenset({(D, 0), (D, 1)}), now=0, lease=30)
    t.bind("a2-new", (D, 2))
    assert [t.bound(a) for a in ("a0", "a1", "a2", "a2-new")] == [(D, 0), (D, 1), None, (D, 2)]
    assert t.stats()["bindings"] == 3 and t.stats()["bindings_evicted"] == 0
    t.bind("a1-new", (D, 1))                   # a named reader without a secret: it moves
    assert t.bound("a1") is None and t.bound("a1-new") == (D, 1)
    t.bind("a0", ("other", 0))                 # a bound agent moving to another reader
    assert t.bound("a0") == ("other", 0) and t.stats()["bindings"] == 3
    assert t.stats()["bindings_evicted"] == 0
    t.hold("q", [2], frozenset({("other", 0), (D, 2)}), now=0, lease=30)
    with pytest.raises(FkvError) as e:
        t.bind("flood", ("x", 0))
    assert str(e.value) == ("bind refused: this prefill rank keeps at most 3 reader bindings "
                            "and the 3 least recently used are readers of held requests")


def test_the_eviction_scan_window_is_exactly_eviction_scan_bindings():
    """An unnamed binding that is the EVICTION_SCAN-th least recently used is evicted; one just
    past the window is not looked at (the bind is refused)."""
    from fkv.connector.transport._lifecycle import EVICTION_SCAN

    for size, evicts in ((EVICTION_SCAN, True), (EVICTION_SCAN + 1, False)):
        t = table(max_bindings=size)
        for i in range(size):
            t.bind(f"b{i}", (D, i))
        t.hold("named", [1], frozenset((D, i) for i in range(size - 1)), now=0, lease=30)
        if evicts:
            t.bind("new", ("x", 0))
            assert t.bound(f"b{size - 1}") is None and t.bound("new") == ("x", 0)
        else:
            with pytest.raises(FkvError, match="bind refused: this prefill rank keeps at most"):
                t.bind("new", ("x", 0))
            assert t.bound(f"b{size - 1}") == (D, size - 1) and t.bound("new") is None


def test_renewal_checks_its_layer_count_and_compares_blocks_in_order():
    t = table()
    t.hold("r", list(range(8)), None, now=0, lease=5, layers_ready=0)
    t.publish("r", 2, now=0)
    t.hold("r", None, None, now=1, lease=5, layers_ready=2)     # as many as held: a renewal
    for bad in (-1, True):
        with pytest.raises(FkvError) as e:
            t.hold("r", None, None, now=1, lease=5, layers_ready=bad)
        assert str(e.value) == (f"'layers_ready' must be an int in [0, 4] (layers already "
                                f"published never go back; num_layers is 4) (got {bad})")
    tail = "; release it (or let its lease run out) before holding the id with other blocks"
    with pytest.raises(FkvError) as e:
        t.hold("r", [1, 0, 2, 3, 4, 5, 6, 7], None, now=1, lease=5)
    assert str(e.value) == ("'block_ids' must be the blocks 'r' is already held with ([0, 1, 2, "
                            "3, 4, 5, 6, 7]) or None (got '[1, 0, 2, 3, 4, 5, 6, 7]')" + tail)
    t.hold("q", list(range(9)), None, now=0, lease=5)
    with pytest.raises(FkvError) as e:
        t.hold("q", list(range(1, 10)), None, now=1, lease=5)
    assert str(e.value) == ("'block_ids' must be the blocks 'q' is already held with ([0, 1, 2, "
                            "3, 4, 5, 6, 7, ...]) or None (got '[1, 2, 3, 4, 5, 6, 7, 8, ...]')"
                            + tail)
    blocks = "".join(["blocks-", "s"])                      # equal to, not the same object as
    t.hold("s", blocks, None, now=0, lease=5)
    t.hold("s", "".join(["blocks-", "s"]), None, now=4, lease=5)
    assert t.layers_ready("r") == 2
    assert sorted(t.expire(now=8.9), key=lambda x: x.request_id) == [
        Release("q", list(range(9)), "lease expired"),
        Release("r", list(range(8)), "lease expired")]
    assert t.expire(now=9) == [Release("s", "blocks-s", "lease expired")]


def test_released_history_keeps_the_latest_release_of_a_reused_id():
    """An id held again leaves released() at once; its next release is the most recent one (the
    oldest go first when the history is full)."""
    t = table(history=2, require_binding=False)
    t.hold("a", [1], None, now=0, lease=1)
    t.hold("b", [2], None, now=0, lease=2)
    assert t.expire(now=2) == [Release("a", [1], "lease expired"),
                               Release("b", [2], "lease expired")]
    t.hold("a", [3], None, now=3, lease=1)
    assert t.released() == {"b": "lease expired"}
    assert t.expire(now=4) == [Release("a", [3], "lease expired")]
    assert list(t.released()) == ["b", "a"]
    t.hold("c", [4], None, now=5, lease=1)
    t.expire(now=6)
    assert list(t.released()) == ["a", "c"]


def test_a_lease_held_across_a_compaction_of_the_deadline_heap_still_expires():
    """Thousands of holds released by notification compact the deadline heap while another
    request is held: that request's lease still runs out (and not earlier)."""
    t = table(num_layers=1)
    t.bind("agent", ("d", 0))
    t.hold("keep", [7], None, now=0.0, lease=50.0)
    t.hold("keep", None, None, now=1.0, lease=60.0)                 # renewed: due at 61
    for i in range(3000):
        t.hold(f"r{i}", [i], frozenset({("d", 0)}), now=1.0, lease=100.0)
        assert t.notified("agent", notification(f"r{i}", "d", 0), now=1.0) is not None
    assert len(t._deadlines) < 1100                                 # compacted
    assert t.expire(now=60.9) == []
    assert t.expire(now=61.0) == [Release("keep", [7], "lease expired")]
