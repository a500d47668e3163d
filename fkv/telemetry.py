"""Transfer telemetry: what each read (decode side, ``role="client"``) and each served request
(prefill side, ``role="server"``) cost, as plain dicts and, optionally, Prometheus metrics.

Pure Python (no torch, NIXL or ZMQ); thread-safe: the transport records from its own threads
while a notebook or a Prometheus scrape reads. Per request: duration, bytes, descriptors, the
path it took (``direct``, ``staging``, ``packed``, ``ipc``...), GB/s, and named waits (e.g.
``pack``: waiting for the prefill rank's gather, ``transfer``: waiting for the READ). Counters:
failures by reason, lease expiries, notifications, refused peer messages by reason.

>>> t = Telemetry("client", engine_id="decode")
>>> t.record(path="packed", seconds=0.002, nbytes=16 << 20, descriptors=1,
...          waits={"pack": 0.0012, "transfer": 0.0004})
>>> t.failure("timeout")
>>> s = t.stats()
>>> s["total"]["count"], s["total"]["bytes"]["sum"], round(s["total"]["gbps"]["overall"], 2)
(1, 16777216, 8.39)
>>> s["failures"]
{'timeout': 1}

With ``prometheus_client`` installed (``pip install 'fkv[prometheus]'``), :meth:`Telemetry.
prometheus` registers the metrics (docs/telemetry.md lists them) on a registry: the one passed, or
a new ``CollectorRegistry`` (never the process-global one unless it is passed).
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from fkv.errors import field_error

__all__ = ["BYTES_BUCKETS", "SECONDS_BUCKETS", "Telemetry"]

# Upper bounds of the histogram buckets (a last, unbounded bucket follows).
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = tuple(float(4096 * 4**k) for k in range(11))   # 4 KiB .. 4 GiB, x4
ROLES = ("client", "server")
#: Records a Telemetry keeps before adding them up (reading it adds them up at once).
_FOLD = 64


class _Dist:
    """Count, sum, min, max and fixed-bucket counts of observed values."""

    __slots__ = ("bounds", "buckets", "count", "max", "min", "sum")

    def __init__(self, bounds: tuple[float, ...] | None) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1) if bounds else []
        self.count, self.sum, self.min, self.max = 0, 0.0, math.inf, -math.inf

    def add(self, v: float) -> None:
        self.count += 1
        self.sum += v
        self.min, self.max = min(self.min, v), max(self.max, v)
        if self.bounds:
            self.buckets[bisect.bisect_left(self.bounds, v)] += 1  # the first bound >= v

    def merge(self, other: _Dist) -> None:
        self.count += other.count
        self.sum += other.sum
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]

    def as_dict(self, integer: bool = False) -> dict[str, Any]:
        cast = int if integer else float
        out: dict[str, Any] = {"count": self.count, "sum": cast(self.sum),
                               "min": cast(self.min) if self.count else None,
                               "max": cast(self.max) if self.count else None,
                               "mean": self.sum / self.count if self.count else None}
        if self.bounds:
            out["histogram"] = {"le": list(self.bounds), "counts": list(self.buckets)}
        return out


class _Path:
    """Everything recorded for requests that took one path."""

    def __init__(self) -> None:
        self.seconds = _Dist(SECONDS_BUCKETS)
        self.bytes = _Dist(BYTES_BUCKETS)
        self.descriptors = _Dist(None)
        self.gbps = _Dist(None)
        self.waits: dict[str, _Dist] = defaultdict(lambda: _Dist(SECONDS_BUCKETS))

    def merge(self, other: _Path) -> None:
        for name in ("seconds", "bytes", "descriptors", "gbps"):
            getattr(self, name).merge(getattr(other, name))
        for stage, d in other.waits.items():
            self.waits[stage].merge(d)

    def as_dict(self) -> dict[str, Any]:
        gbps = self.gbps.as_dict()
        gbps["overall"] = (self.bytes.sum / self.seconds.sum / 1e9 if self.seconds.sum > 0
                           else None)
        return {"count": self.seconds.count, "seconds": self.seconds.as_dict(),
                "bytes": self.bytes.as_dict(integer=True),
                "descriptors": self.descriptors.as_dict(integer=True), "gbps": gbps,
                "waits": {k: v.as_dict() for k, v in sorted(self.waits.items())}}


class Telemetry:
    """The recorder of one transport endpoint: a client (reads) or a server (served requests).

    ``engine_id`` labels the Prometheus series (the engine this endpoint belongs to).
    """

    def __init__(self, role: str, engine_id: str = "") -> None:
        if role not in ROLES:
            raise field_error("role", role, f"one of {ROLES}",
                              "'client' records reads, 'server' served requests")
        self.role, self.engine_id = role, str(engine_id)
        self._lock = threading.Lock()
        self._paths: dict[str, _Path] = defaultdict(_Path)
        self._pending: list[tuple[str, float, int, int, Mapping[str, float] | None]] = []
        self._failures: dict[str, int] = defaultdict(int)
        self._refused: dict[str, int] = defaultdict(int)
        self._leases = 0
        self._notifications = 0

    # -- recording ---------------------------------------------------------------------------

    def record(self, *, path: str, seconds: float, nbytes: int, descriptors: int,
               waits: Mapping[str, float] | None = None) -> None:
        """One completed request: ``seconds`` from call to done, ``nbytes`` landed (client) or
        served (server), ``descriptors`` posted, ``waits`` named parts of ``seconds``."""
        if not isinstance(path, str) or not path:
            raise field_error("path", path, "a non-empty string (the strategy the request took)")
        _non_negative("seconds", seconds)
        _non_negative("nbytes", nbytes, integer=True)
        _non_negative("descriptors", descriptors, integer=True)
        for stage, s in (waits or {}).items():
            _non_negative(f"waits.{stage}", s)
        self.record_read(path, float(seconds), nbytes, descriptors,
                         tuple(waits.items()) if waits else ())

    def record_read(self, path: str, seconds: float, nbytes: int, descriptors: int,
                    waits: tuple[tuple[str, float], ...] = ()) -> None:
        """:meth:`record` without its checks, for values fkv computed itself (a client's read):
        kept as they are and added up when read (or every ``_FOLD`` records). A read's return
        is on the critical path of the request it landed, and right after its copy the caches
        are cold."""
        with self._lock:
            self._pending.append((path, seconds, nbytes, descriptors, waits))
            if len(self._pending) >= _FOLD:
                self._fold()

    def _fold(self) -> None:
        """Add the pending records into the distributions (under the lock)."""
        pending, self._pending = self._pending, []
        for path, seconds, nbytes, descriptors, waits in pending:
            p = self._paths[path]
            p.seconds.add(seconds)
            p.bytes.add(float(nbytes))
            p.descriptors.add(float(descriptors))
            if seconds > 0 and nbytes:  # a read of nothing (a full prefix hit) has no rate
                p.gbps.add(nbytes / seconds / 1e9)
            for stage, s in waits:
                p.waits[stage].add(float(s))

    def failure(self, reason: str) -> None:
        """A request that failed (``reason``: e.g. ``"timeout"``, ``"peer_lost"``); count each
        failed request once."""
        with self._lock:
            self._failures[_reason(reason)] += 1

    def lease_expired(self, n: int = 1) -> None:
        """``n`` held requests released because their lease ran out (server)."""
        _non_negative("n", n, integer=True)
        with self._lock:
            self._leases += n

    def notification(self, n: int = 1) -> None:
        """``n`` request notifications sent (client) or received (server)."""
        _non_negative("n", n, integer=True)
        with self._lock:
            self._notifications += n

    def refused(self, reason: str) -> None:
        """A peer message refused (undecodable, unknown request, wrong engine...)."""
        with self._lock:
            self._refused[_reason(reason)] += 1

    # -- reading -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Plain dicts: per path and in total, ``count``, ``seconds``/``bytes``/``descriptors``/
        ``gbps`` (count, sum, min, max, mean; seconds and bytes with a ``histogram``: bucket upper
        bounds ``le`` and per-bucket ``counts``, one more count for values above the last
        bound), ``waits`` by stage; ``gbps.overall`` = bytes sum / seconds sum; counters."""
        with self._lock:
            self._fold()
            total = _Path()
            for p in self._paths.values():
                total.merge(p)
            return {"role": self.role, "engine_id": self.engine_id,
                    "paths": {k: v.as_dict() for k, v in sorted(self._paths.items())},
                    "total": total.as_dict(),
                    "failures": dict(sorted(self._failures.items())),
                    "lease_expiries": self._leases, "notifications": self._notifications,
                    "refused_messages": dict(sorted(self._refused.items()))}

    def prometheus(self, registry: Any = None) -> Any:
        """Export on ``registry`` (default: a new ``prometheus_client.CollectorRegistry``) and
        return it. Values are read at scrape time; several endpoints may share one registry."""
        try:
            import prometheus_client
        except ModuleNotFoundError:
            raise ModuleNotFoundError("Telemetry.prometheus needs prometheus_client, which is not "
                                      "installed: pip install 'fkv[prometheus]'",
                                      name="prometheus_client") from None
        if registry is None:
            registry = prometheus_client.CollectorRegistry()
        with _COLLECTORS_LOCK:
            collector = _COLLECTORS.get(registry)
            if collector is None:
                collector = _COLLECTORS[registry] = _Collector()
                registry.register(collector)
            if self not in collector.sources:
                collector.sources.append(self)
        return registry

    def _snapshot(self) -> tuple[dict[str, _Path], dict[str, int], dict[str, int], int, int]:
        with self._lock:
            self._fold()
            paths = {}
            for k, v in self._paths.items():
                paths[k] = _Path()
                paths[k].merge(v)
            return paths, dict(self._failures), dict(self._refused), self._leases, \
                self._notifications


# -- Prometheus export ------------------------------------------------------------------------------

_COLLECTORS: weakref.WeakKeyDictionary[Any, _Collector] = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()
_LABELS = ["role", "engine_id", "path"]


class _Collector:
    """One per registry: the metrics of every :class:`Telemetry` exported there, merged by
    label set, read at scrape time."""

    def __init__(self) -> None:
        self.sources: list[Telemetry] = []

    def describe(self) -> list[Any]:
        return list(self.collect(empty=True))

    def collect(self, empty: bool = False) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        duration = HistogramMetricFamily(
            "fkv_transfer_duration_seconds", "Time of one transfer request, call to done.",
            labels=_LABELS)
        size = HistogramMetricFamily(
            "fkv_transfer_size_bytes", "Bytes of one transfer request.", labels=_LABELS)
        waits = HistogramMetricFamily(
            "fkv_transfer_wait_seconds", "Time a transfer request waited, by stage.",
            labels=[*_LABELS, "stage"])
        descs = CounterMetricFamily(
            "fkv_transfer_descriptors", "Transfer descriptors posted.", labels=_LABELS)
        failures = CounterMetricFamily(
            "fkv_transfer_failures", "Failed transfer requests, by reason.",
            labels=["role", "engine_id", "reason"])
        leases = CounterMetricFamily(
            "fkv_lease_expiries", "Held requests released by their lease running out.",
            labels=["role", "engine_id"])
        notes = CounterMetricFamily(
            "fkv_notifications", "Request notifications sent (client) or received (server).",
            labels=["role", "engine_id"])
        refused = CounterMetricFamily(
            "fkv_refused_messages", "Peer messages refused, by reason.",
            labels=["role", "engine_id", "reason"])
        families = (duration, size, waits, descs, failures, leases, notes, refused)
        if empty:
            yield from families
            return
        paths: dict[tuple[str, str, str], _Path] = defaultdict(_Path)
        counts: dict[str, dict[tuple[str, ...], int]] = defaultdict(lambda: defaultdict(int))
        for t in list(self.sources):
            snap, fails, refs, lease, note = t._snapshot()
            who = (t.role, t.engine_id)
            for name, p in snap.items():
                paths[(*who, name)].merge(p)
            for reason, n in fails.items():
                counts["failures"][(*who, reason)] += n
            for reason, n in refs.items():
                counts["refused"][(*who, reason)] += n
            counts["leases"][who] += lease
            counts["notes"][who] += note
        for labels, p in sorted(paths.items()):
            _histogram(duration, list(labels), p.seconds)
            _histogram(size, list(labels), p.bytes)
            descs.add_metric(list(labels), p.descriptors.sum)
            for stage, d in sorted(p.waits.items()):
                _histogram(waits, [*labels, stage], d)
        named = {"failures": failures, "refused": refused, "leases": leases, "notes": notes}
        for key, values in counts.items():
            for labels, n in sorted(values.items()):
                named[key].add_metric(list(labels), n)
        yield from families


def _histogram(family: Any, labels: list[str], d: _Dist) -> None:
    from prometheus_client.utils import floatToGoString

    cumulative, buckets = 0, []
    for le, n in zip(d.bounds or (), d.buckets, strict=False):
        cumulative += n
        buckets.append((floatToGoString(le), cumulative))
    buckets.append(("+Inf", d.count))
    family.add_metric(labels, buckets, sum_value=d.sum)


def _non_negative(name: str, value: Any, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value >= 0:
        raise field_error(name, value, "a non-negative " + ("integer" if integer else "number"))


def _reason(reason: Any) -> str:
    if not isinstance(reason, str) or not reason:
        raise field_error("reason", reason, "a non-empty string (a short snake_case kind)")
    return reason
