"""The request lifecycle of one prefill rank, as a pure state machine (no I/O, no threads, no clock).

A prefill rank *holds* a request's blocks until every **expected reader** (a decode engine id and
rank, from the plan both sides agreed on) said it finished reading, or until the request's lease
runs out. Release is by identity, never by counting: a reader that notifies twice, a reader the
plan does not name, an agent that claims to be a reader it is not, a request nobody holds and a
message that does not parse are all counted in bounded diagnostics and change nothing.

The caller (the server loop) feeds events in and acts on what comes back, h11 style::

    table = Requests(num_layers=32, prefill_tp=2, prefill_rank=0)
    table.bind(agent_name, ("decode-0", 1), decode_tp=4)   # learned when it connected
    table.hold("req-7", block_ids, None, now=time.monotonic(), lease=30.0)  # or name readers
    for agent, messages in nixl_notifications.items():  # NIXL says who sent each message
        for message in messages:
            release = table.notified(agent, message, now=time.monotonic())
            if release is not None:
                free(release.block_ids)
    for release in table.expire(now=time.monotonic()):
        free(release.block_ids)

Notifications are ``b"fkv1|<request id>|<decode engine id>|<decode rank>|<status>"``
(:func:`notification` builds one, :func:`parse_notification` reads one and never raises), with
status ``done`` (the reader's READs all finished) or ``failed`` (counted, never a release: the
reader may retry). A streaming request (layer-wise transfer) also carries how many layers are
ready (:meth:`Requests.publish`); a ``done`` before every layer was published is counted
(``premature``) and kept: the release comes with the publish of the last layer (a decode rank
that only notifies this rank, having read replicated heads elsewhere, may finish first).

>>> table = Requests(num_layers=2)
>>> table.bind("agent-a", ("dec", 0))
>>> table.hold("r1", [3, 4], frozenset({("dec", 0)}), now=0.0, lease=10.0)
>>> table.notified("agent-a", notification("r1", "dec", 0), now=1.0)
Release(request_id='r1', block_ids=[3, 4], reason='notified')
>>> table.pending(), table.stats()["accepted"]
(frozenset(), 1)
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import hmac
import itertools
import math
from typing import Any

import attrs

from fkv.errors import FkvError, field_error

__all__ = [
    "KINDS", "MAX_NOTIFICATION_BYTES", "MAX_REQUEST_ID_BYTES", "NOTIFICATION_PREFIX", "Notification",
    "Reader", "Release", "Requests", "expected_readers", "notification", "parse_notification",
]

#: ``(decode engine id, decode tp rank)``: who reads a request.
Reader = tuple[str, int]

#: First bytes of every fkv request notification (the version of the format after it).
NOTIFICATION_PREFIX = b"fkv1|"
#: Longest request id a notification carries (UTF-8 bytes).
MAX_REQUEST_ID_BYTES = 4096
#: Longest engine id a notification carries (UTF-8 bytes).
MAX_ENGINE_ID_BYTES = 256
#: Longest notification parsed; anything longer is malformed without being decoded.
MAX_NOTIFICATION_BYTES = len(NOTIFICATION_PREFIX) + MAX_REQUEST_ID_BYTES + MAX_ENGINE_ID_BYTES + 32
#: Longest sender (NIXL agent) name accepted.
MAX_AGENT_NAME_CHARS = 1024
_MAX_RANK = 1 << 16
_STATUSES = ("done", "failed")
#: Bindings a bind past ``max_bindings`` looks at (least recently used first) for one to drop.
EVICTION_SCAN = 64

#: Counter names of :meth:`Requests.stats` (every one always present).
KINDS = (
    "held", "accepted", "released_notified", "released_expired",
    "duplicate", "unexpected_reader", "unknown_request", "late", "failed", "premature",
    "malformed", "foreign", "impersonation", "bindings_evicted", "rebind_refused",
)


@attrs.frozen
class Notification:
    """A parsed notification: which request, which reader, and whether its reads succeeded."""

    request_id: str
    reader: Reader
    status: str


@attrs.frozen
class Release:
    """A request whose blocks the caller may free now, and why: ``"notified"`` (every expected
    reader finished) or ``"lease expired"``."""

    request_id: str
    block_ids: Any
    reason: str


@attrs.define
class _Held:
    block_ids: Any
    expected: frozenset[Reader] | None  # None: the first decode engine to notify fixes it
    deadline: float
    layers_ready: int
    notified: set[Reader] = attrs.Factory(set)
    generation: int = 0  # which hold of this id a deadline entry belongs to


# -- expected readers -----------------------------------------------------------------------------

def expected_readers(decode_engine_id: str, decode_tp: int, prefill_tp: int, prefill_rank: int
                     ) -> frozenset[Reader]:
    """The decode ranks that notify prefill rank ``prefill_rank`` once per request (docs/handshake.md, "Which bytes move").

    Every decode rank notifies each prefill rank of its group (the ranks it reads *and* the ranks
    it only notifies: replicated KV, MLA), so the set depends on the TP sizes only: with decode
    TP ``>=`` prefill TP (ratio ``r``) decode ranks ``p*r .. p*r + r - 1`` read prefill rank ``p``;
    with prefill TP larger, decode rank ``p // r`` does. Its size is
    :func:`fkv.connector.plan.expected_notifications`.

    >>> sorted(expected_readers("dec", 4, 2, 1))
    [('dec', 2), ('dec', 3)]
    >>> sorted(expected_readers("dec", 2, 4, 3))
    [('dec', 1)]
    """
    _check_engine_id("decode_engine_id", decode_engine_id)
    for name, value in (("decode_tp", decode_tp), ("prefill_tp", prefill_tp)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_RANK:
            raise field_error(name, value, f"an int in [1, {_MAX_RANK}]")
    if isinstance(prefill_rank, bool) or not isinstance(prefill_rank, int) \
            or not 0 <= prefill_rank < prefill_tp:
        raise field_error("prefill_rank", prefill_rank, f"an int in [0, {prefill_tp})")
    big, small = max(decode_tp, prefill_tp), min(decode_tp, prefill_tp)
    if big % small:
        raise field_error("decode_tp", decode_tp, f"a multiple or divisor of prefill_tp "
                          f"{prefill_tp} (the handshake refuses this pair)")
    if decode_tp >= prefill_tp:
        r = decode_tp // prefill_tp
        ranks = range(prefill_rank * r, prefill_rank * r + r)
    else:
        ranks = range(prefill_rank // (prefill_tp // decode_tp),
                      prefill_rank // (prefill_tp // decode_tp) + 1)
    return frozenset((decode_engine_id, t) for t in ranks)


# -- the notification format ----------------------------------------------------------------------

def _utf8_len(value: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates: not sendable
        return -1


def _check_engine_id(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value or "|" in value \
            or not 0 < _utf8_len(value) <= MAX_ENGINE_ID_BYTES:
        raise field_error(name, value, f"a non-empty UTF-8 str without '|' of at most "
                          f"{MAX_ENGINE_ID_BYTES} bytes")


def _check_request_id(value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise field_error("request_id", value, "a non-empty str")
    n = _utf8_len(value)
    if n < 0:
        raise field_error("request_id", value, "a str that encodes as UTF-8 (no lone "
                          "surrogates)")
    if n > MAX_REQUEST_ID_BYTES:
        raise field_error("request_id", value[:40] + "...", f"at most {MAX_REQUEST_ID_BYTES} "
                          f"UTF-8 bytes (got {n})")


def _check_reader(name: str, reader: Any) -> Reader:
    if not isinstance(reader, tuple) or len(reader) != 2:
        raise field_error(name, reader, "a (decode engine id, decode tp rank) tuple")
    engine_id, rank = reader
    _check_engine_id(f"{name}[0]", engine_id)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < _MAX_RANK:
        raise field_error(f"{name}[1]", rank, f"an int in [0, {_MAX_RANK})")
    return engine_id, rank


def notification(request_id: str, engine_id: str, rank: int, status: str = "done") -> bytes:
    """The notification decode rank ``(engine_id, rank)`` sends each prefill rank of its group
    once its READs of ``request_id`` all finished (``status="done"``), or ``"failed"``.

    >>> notification("req-1", "dec", 3)
    b'fkv1|req-1|dec|3|done'
    """
    _check_request_id(request_id)
    _check_reader("reader", (engine_id, rank))
    if status not in _STATUSES:
        raise field_error("status", status, f"one of {_STATUSES}")
    return b"|".join((NOTIFICATION_PREFIX[:-1], request_id.encode(), engine_id.encode(),
                      str(rank).encode(), status.encode()))


def parse_notification(message: Any) -> Notification | str:
    """A :class:`Notification`, or a short reason why ``message`` is malformed; never raises.

    The request id may contain ``|`` (the other fields may not): the last three fields are
    split off the right.

    >>> parse_notification(b"fkv1|a|b|c|dec|0|done")
    Notification(request_id='a|b|c', reader=('dec', 0), status='done')
    >>> parse_notification(b"victim:1")
    "does not start with b'fkv1|'"
    """
    if not isinstance(message, bytes | bytearray | memoryview):
        return f"is a {type(message).__name__}, not bytes"
    message = bytes(message)
    if len(message) > MAX_NOTIFICATION_BYTES:
        return f"is {len(message)} bytes, more than {MAX_NOTIFICATION_BYTES}"
    if not message.startswith(NOTIFICATION_PREFIX):
        return f"does not start with {NOTIFICATION_PREFIX!r}"
    parts = message[len(NOTIFICATION_PREFIX):].rsplit(b"|", 3)
    if len(parts) != 4:
        return "has fewer than 4 fields after the prefix"
    try:
        request_id, engine_id, rank_text, status = (p.decode("utf-8") for p in parts)
    except UnicodeDecodeError:
        return "is not UTF-8"
    if not request_id or len(parts[0]) > MAX_REQUEST_ID_BYTES:
        return f"request id is empty or longer than {MAX_REQUEST_ID_BYTES} bytes"
    if not engine_id or len(parts[1]) > MAX_ENGINE_ID_BYTES:
        return f"engine id is empty or longer than {MAX_ENGINE_ID_BYTES} bytes"
    if not (rank_text.isascii() and rank_text.isdigit()) or len(rank_text) > 5 \
            or int(rank_text) >= _MAX_RANK or (len(rank_text) > 1 and rank_text[0] == "0"):
        return f"rank is not a decimal int in [0, {_MAX_RANK})"
    if status not in _STATUSES:
        return f"status is not one of {_STATUSES}"
    return Notification(request_id, (engine_id, int(rank_text)), status)


def _short(value: Any, n: int = 96) -> str:
    text = repr(value[:n] if isinstance(value, bytes | bytearray | str) else type(value).__name__)
    return text if len(text) <= 2 * n else text[:2 * n] + "..."


# -- the table ------------------------------------------------------------------------------------

class Requests:
    """Requests one prefill rank holds, released by identity. Pure: no I/O, no clock, no threads
    (the caller serializes calls and passes ``now``, e.g. ``time.monotonic()``).

    ``num_layers``: layers of this rank's cache (the range of :meth:`publish`).
    ``prefill_tp``, ``prefill_rank``: this rank, for requests held without naming their
    readers (:meth:`hold` with ``expected_readers=None``).
    ``require_binding``: a notification counts only when its sender (the NIXL agent name) was
    bound to the reader it claims (:meth:`bind`); off, an unbound agent may speak for a reader
    nobody bound, but never for a bound one. ``history``: how many released ids
    :meth:`released` remembers; ``diagnostics``: how many refused events :meth:`events` keeps;
    ``max_bindings``: agent bindings kept. A bind past it drops the least recently used binding
    whose reader no held request names (used: bound, or an accepted notification); when the
    oldest :data:`EVICTION_SCAN` are all named, the new bind is refused instead, so a flood of
    bindings can never unbind a reader a held request waits for.
    """

    def __init__(self, *, num_layers: int, prefill_tp: int = 1, prefill_rank: int = 0,
                 require_binding: bool = True, history: int = 4096, diagnostics: int = 256,
                 max_bindings: int = 65536) -> None:
        for name, value in (("num_layers", num_layers), ("history", history),
                            ("diagnostics", diagnostics), ("max_bindings", max_bindings),
                            ("prefill_tp", prefill_tp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise field_error(name, value, "a positive int")
        if isinstance(prefill_rank, bool) or not isinstance(prefill_rank, int) \
                or not 0 <= prefill_rank < prefill_tp:
            raise field_error("prefill_rank", prefill_rank, f"an int in [0, {prefill_tp})")
        self.num_layers = num_layers
        self.prefill_tp, self.prefill_rank = prefill_tp, prefill_rank
        self.require_binding = bool(require_binding)
        self._held: dict[str, _Held] = {}
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._history = history
        self._events: collections.deque[tuple[float, str, str, str]] = collections.deque(
            maxlen=diagnostics)
        self._agents: collections.OrderedDict[str, Reader] = collections.OrderedDict()
        self._readers: dict[Reader, str] = {}
        self._secrets: dict[Reader, bytes] = {}  # reader -> sha256 of the secret it was bound with
        self._named: collections.Counter[Reader] = collections.Counter()  # held requests naming it
        self._decode_tp: dict[str, int] = {}  # agent name -> its engine's decode TP (bind)
        self._max_bindings = max_bindings
        self._counts = dict.fromkeys(KINDS, 0)
        # (deadline, generation, request id) per hold: a heap, so that expire() looks only at
        # what is due. A renewal moves a deadline later without a new entry (the old one, once
        # due, is put back at the new deadline); entries of released holds are dropped when due.
        self._deadlines: list[tuple[float, int, str]] = []
        self._generations = itertools.count(1)

    # -- identities --------------------------------------------------------------------------------
    def bind(self, agent_name: str, reader: Reader, *, decode_tp: int | None = None,
             secret: bytes | None = None) -> None:
        """Notifications from NIXL agent ``agent_name`` speak for ``reader`` from now on (a reader
        that reconnects with a new agent replaces its previous binding). ``decode_tp``: the TP
        size of the reader's engine, needed for requests held without naming their readers.

        ``secret``: random bytes the binding process keeps. While a held request names a reader
        bound with one, that binding is replaced (the reader moved to another agent, or its agent
        to another reader) only by a bind with the same secret: the process that bound it,
        reconnecting. Anyone else's bind raises FkvError (counted ``rebind_refused``) and changes
        nothing, so no one can take over a reader whose requests are in flight and release them
        early. A reader no held request names may be bound anew by anyone (a decode process
        restarted under the same engine id; the same exposure as a reader's first bind)."""
        if not isinstance(agent_name, str) or not agent_name \
                or len(agent_name) > MAX_AGENT_NAME_CHARS:
            raise field_error("agent_name", agent_name,
                              f"a non-empty str of at most {MAX_AGENT_NAME_CHARS} characters")
        reader = _check_reader("reader", reader)
        if decode_tp is not None and (isinstance(decode_tp, bool) or not isinstance(decode_tp, int)
                                      or not reader[1] < decode_tp <= _MAX_RANK):
            raise field_error("decode_tp", decode_tp, f"None or an int in ({reader[1]}, "
                              f"{_MAX_RANK}] (the reader's rank is {reader[1]})")
        if secret is not None and not isinstance(secret, bytes | bytearray):
            raise field_error("secret", type(secret).__name__, "None or bytes")
        digest = None if secret is None else hashlib.sha256(bytes(secret)).digest()
        # the bindings this one would replace: the reader's own, and the one of this agent
        replaced = {reader} if reader in self._readers else set()
        if agent_name in self._agents:
            replaced.add(self._agents[agent_name])
        for other in replaced:
            known = self._secrets.get(other)
            if known is not None and self._named[other] \
                    and (digest is None or not hmac.compare_digest(known, digest)):
                self._counts["rebind_refused"] += 1
                raise FkvError(f"bind refused: reader {other} is named by {self._named[other]} "
                               f"held request(s) and was bound by a process holding its "
                               f"secret; only that process can rebind it or its agent until "
                               f"they are released (a new decode process can take a new engine "
                               f"id)")
        # a bind grows the table only when neither its agent nor its reader is bound already
        # (a reader reconnecting with a new agent takes its old binding's place)
        if not replaced and len(self._agents) >= self._max_bindings:
            self._evict_one()
        self.unbind(agent_name)
        old = self._readers.pop(reader, None)
        if old is not None:
            self._agents.pop(old, None)
            self._decode_tp.pop(old, None)
        self._agents[agent_name] = reader
        self._readers[reader] = agent_name
        if digest is None:
            self._secrets.pop(reader, None)
        else:
            self._secrets[reader] = digest
        if decode_tp is not None:
            self._decode_tp[agent_name] = decode_tp

    def _evict_one(self) -> None:
        """Drop the least recently used binding whose reader no held request names; FkvError
        when the oldest EVICTION_SCAN (or all, when fewer) are."""
        for agent, who in itertools.islice(self._agents.items(), EVICTION_SCAN):
            if not self._named[who]:
                self.unbind(agent)
                self._counts["bindings_evicted"] += 1
                return
        scanned = min(EVICTION_SCAN, len(self._agents))
        raise FkvError(f"bind refused: this prefill rank keeps at most {self._max_bindings} "
                       f"reader bindings and the {scanned} least recently used are readers "
                       f"of held requests")

    def unbind(self, agent_name: str) -> None:
        """Forget ``agent_name``'s binding (no-op when it has none)."""
        reader = self._agents.pop(agent_name, None)
        self._decode_tp.pop(agent_name, None)
        if reader is not None:
            self._readers.pop(reader, None)
            self._secrets.pop(reader, None)

    def bound(self, agent_name: str) -> Reader | None:
        """The reader ``agent_name`` speaks for, or None."""
        return self._agents.get(agent_name)

    # -- events --------------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: Any, expected_readers: frozenset[Reader] | None,
             *, now: float, lease: float, layers_ready: int | None = None) -> None:
        """Hold ``request_id``'s blocks until each of ``expected_readers`` notified ``done`` once,
        or until ``now + lease``. ``expected_readers=None`` when this rank does not know which
        decode engine will read: the first bound reader whose ``done`` counts fixes them to its
        engine's readers of this rank (from the ``decode_tp`` it was bound with). ``layers_ready``:
        a streaming request's layers already written (None: all of them). Holding a held request
        again renews its lease: same readers, same blocks (``None`` keeps them), and a
        ``layers_ready`` no larger than the layers held now (the count is kept); anything else is
        refused, since a second hold that replaced the blocks would lose the first ones (never
        released) and one that raised the count would announce layers nobody published."""
        _check_request_id(request_id)
        if expected_readers is None:
            readers = None
        elif not isinstance(expected_readers, frozenset | set) or not expected_readers:
            raise field_error("expected_readers", expected_readers,
                              "None or a non-empty frozenset of (decode engine id, rank) readers",
                              "use expected_readers(decode_engine_id, decode_tp, prefill_tp, "
                              "prefill_rank)")
        else:
            readers = frozenset(_check_reader("expected_readers[]", r) for r in expected_readers)
        now, lease = _time("now", now), _time("lease", lease)
        if lease <= 0:
            raise field_error("lease", lease, "a positive number of seconds")
        held = self._held.get(request_id)
        if layers_ready is not None or held is None:
            layers_ready = self.num_layers if layers_ready is None else layers_ready
            self._check_layers(layers_ready, 0)
        if held is not None:
            if readers is not None and held.expected is not None and held.expected != readers:
                raise field_error("expected_readers", sorted(readers),
                                  f"the readers {request_id!r} is already held for "
                                  f"({sorted(held.expected)})", "release it before reusing the id")
            if block_ids is not None and not _same_blocks(block_ids, held.block_ids):
                raise field_error("block_ids", _blocks_text(block_ids),
                                  f"the blocks {request_id!r} is already held with "
                                  f"({_blocks_text(held.block_ids)}) or None", "release it (or "
                                  "let its lease run out) before holding the id with other blocks")
            if layers_ready is not None and layers_ready > held.layers_ready:
                raise field_error("layers_ready", layers_ready,
                                  f"None or at most the {held.layers_ready} layers "
                                  f"{request_id!r} is held with now (a renewal never claims "
                                  f"layers written)", "publish() moves a held request's layers "
                                  "forward")
            if held.expected is None and readers is not None:
                held.expected = readers
                self._named.update(readers)
            held.deadline = max(held.deadline, now + lease)
            return
        self._released.pop(request_id, None)
        generation = next(self._generations)
        self._held[request_id] = _Held(block_ids, readers, now + lease, layers_ready,
                                       generation=generation)
        if len(self._deadlines) > 2 * len(self._held) + 1024:  # mostly released holds' entries
            self._deadlines = [(h.deadline, h.generation, r) for r, h in self._held.items()]
            heapq.heapify(self._deadlines)
        else:
            heapq.heappush(self._deadlines, (now + lease, generation, request_id))
        if readers is not None:
            self._named.update(readers)
        self._counts["held"] += 1

    def publish(self, request_id: str, layers_ready: int, now: float) -> Release | None:
        """A streaming request now has ``layers_ready`` layers written (never fewer than before,
        at most ``num_layers``). Returns its :class:`Release` when this publish of the last layer
        completes a request every expected reader already notified (early: see
        :meth:`notified`), else None."""
        _time("now", now)
        held = self._held.get(request_id)
        if held is None:
            raise field_error("request_id", request_id, "a request this rank holds",
                              "hold() it before publishing its layers")
        self._check_layers(layers_ready, held.layers_ready)
        held.layers_ready = layers_ready
        if (layers_ready == self.num_layers and held.expected is not None
                and held.notified == held.expected):
            return self._release(request_id, "notified")
        return None

    def notified(self, sender: Any, message: Any, now: float) -> Release | None:
        """One NIXL notification ``message`` from agent ``sender``: the :class:`Release` it
        completes, or None. Never raises on what a peer sent (refusals are counted)."""
        _time("now", now)
        agent = _agent_name(sender)
        if agent is None:
            return self._refuse(now, "foreign", sender, message, "sender name unreadable")
        parsed = parse_notification(message)
        if isinstance(parsed, str):
            return self._refuse(now, "malformed", agent, message, parsed)
        bound = self._agents.get(agent)
        if bound is not None and bound != parsed.reader:
            return self._refuse(now, "impersonation", agent, message, f"bound to {bound}")
        if bound is None:
            if self.require_binding:
                return self._refuse(now, "foreign", agent, message, "agent not bound")
            if parsed.reader in self._readers:
                return self._refuse(now, "impersonation", agent, message,
                                    f"{parsed.reader} is bound to another agent")
        held = self._held.get(parsed.request_id)
        if held is None:
            kind = "late" if parsed.request_id in self._released else "unknown_request"
            return self._refuse(now, kind, agent, message)
        expected = held.expected
        if expected is None:  # the first engine to read fixes the readers
            decode_tp = self._decode_tp.get(agent)
            if decode_tp is None:
                return self._refuse(now, "unexpected_reader", agent, message,
                                    "readers not named at hold and the agent was bound without "
                                    "decode_tp")
            try:
                expected = expected_readers(parsed.reader[0], decode_tp, self.prefill_tp,
                                            self.prefill_rank)
            except FkvError as e:  # a TP pair no plan allows
                return self._refuse(now, "unexpected_reader", agent, message, str(e)[:120])
        if parsed.reader not in expected:
            return self._refuse(now, "unexpected_reader", agent, message)
        if parsed.status == "failed":
            return self._refuse(now, "failed", agent, message)
        if parsed.reader in held.notified:
            return self._refuse(now, "duplicate", agent, message)
        if held.expected is None:
            held.expected = expected
            self._named.update(expected)
        held.notified.add(parsed.reader)
        if agent in self._agents:  # recently used: the last to be evicted
            self._agents.move_to_end(agent)
        self._counts["accepted"] += 1
        if held.layers_ready < self.num_layers:
            # Early, for a streaming request: a decode rank that only notifies this rank (it
            # read the replicated heads elsewhere: MLA, replicated KV) can be done before this
            # rank published its last layer. Counted and kept: the blocks stay held until that
            # publish (:meth:`publish` returns the release), never freed under a write.
            self._counts["premature"] += 1
            self._events.append((now, "premature", _short(agent, 64),
                                 f"{_short(message)}: kept until layer {self.num_layers} is "
                                 f"published ({held.layers_ready} now)"))
            return None
        if held.notified == held.expected:
            return self._release(parsed.request_id, "notified")
        return None

    def expire(self, now: float) -> list[Release]:
        """Release every request whose lease ran out by ``now``."""
        now = _time("now", now)
        heap, gone = self._deadlines, []
        while heap and heap[0][0] <= now:
            _, generation, request_id = heapq.heappop(heap)
            held = self._held.get(request_id)
            if held is None or held.generation != generation:
                continue  # released already, or the id is held anew (with its own entry)
            if held.deadline > now:  # renewed since this entry was made
                heapq.heappush(heap, (held.deadline, generation, request_id))
                continue
            gone.append(self._release(request_id, "lease expired"))
        return gone

    # -- views ---------------------------------------------------------------------------------
    def pending(self) -> frozenset[str]:
        """Request ids held now (a new set each call: use :meth:`holds` to ask about one)."""
        return frozenset(self._held)

    def held(self) -> int:
        """How many requests are held now."""
        return len(self._held)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is held now (constant time, whatever else is held)."""
        return request_id in self._held

    def waiting_for(self, request_id: str) -> frozenset[Reader] | None:
        """Expected readers of a held request that have not notified yet (None: no engine has
        fixed them yet)."""
        held = self._held.get(request_id)
        if held is None:
            raise field_error("request_id", request_id, "a request this rank holds")
        return None if held.expected is None else held.expected - held.notified

    def layers_ready(self, request_id: str) -> int:
        """How many layers of a held request are written (``num_layers`` when not streaming)."""
        held = self._held.get(request_id)
        if held is None:
            raise field_error("request_id", request_id, "a request this rank holds")
        return held.layers_ready

    def released(self) -> dict[str, str]:
        """The most recent released ids (at most ``history``) and why, oldest first."""
        return dict(self._released)

    def events(self) -> list[tuple[float, str, str, str]]:
        """The most recent refused (and early, ``premature``) notifications: ``(now, kind, sender,
        detail)``, oldest first."""
        return list(self._events)

    def stats(self) -> dict[str, int]:
        """Counters by kind (see :data:`KINDS`), plus ``pending`` and ``bindings``."""
        return {**self._counts, "pending": len(self._held), "bindings": len(self._agents)}

    # -- inside ----------------------------------------------------------------------------------
    def _check_layers(self, layers_ready: Any, lo: int) -> None:
        if isinstance(layers_ready, bool) or not isinstance(layers_ready, int) \
                or not lo <= layers_ready <= self.num_layers:
            raise field_error("layers_ready", layers_ready,
                              f"an int in [{lo}, {self.num_layers}] (layers already published "
                              f"never go back; num_layers is {self.num_layers})")

    def _refuse(self, now: float, kind: str, sender: Any, message: Any, why: str = "") -> None:
        """Count and remember one refused event (kept short: the diagnostics stay bounded)."""
        self._counts[kind] += 1
        detail = _short(message) + (f": {why}" if why else "")
        self._events.append((now, kind, _short(sender, 64), detail))
        return None

    def _release(self, request_id: str, reason: str) -> Release:
        held = self._held.pop(request_id)
        if held.expected is not None:
            self._named.subtract(held.expected)
            for r in held.expected:
                if self._named[r] <= 0:
                    del self._named[r]
        self._counts["released_notified" if reason == "notified" else "released_expired"] += 1
        self._released[request_id] = reason
        while len(self._released) > self._history:
            self._released.popitem(last=False)
        return Release(request_id, held.block_ids, reason)


def _same_blocks(a: Any, b: Any) -> bool:
    """Whether two block-id collections (lists, tuples, arrays, tensors) hold the same ids in the
    same order."""
    if a is b:
        return True
    try:
        return [int(x) for x in (a.tolist() if hasattr(a, "tolist") else a)] == \
            [int(x) for x in (b.tolist() if hasattr(b, "tolist") else b)]
    except (TypeError, ValueError):
        return a == b if isinstance(a, str | bytes) else False


def _blocks_text(ids: Any, n: int = 8) -> str:
    """A short text of a block-id collection for messages (its first ``n`` ids)."""
    items = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(items, list | tuple):
        return "[" + ", ".join(map(str, items[:n])) + (", ...]" if len(items) > n else "]")
    return _short(items, 40)


def _agent_name(sender: Any) -> str | None:
    """The sender's agent name as str, or None when it is not a readable name."""
    if isinstance(sender, bytes | bytearray):
        try:
            sender = bytes(sender).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(sender, str) or not sender or len(sender) > MAX_AGENT_NAME_CHARS:
        return None
    return sender


def _time(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise field_error(name, value, "a finite number of seconds")
    return float(value)

