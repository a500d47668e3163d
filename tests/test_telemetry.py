"""fkv.telemetry: exact stats for known events, the same in Prometheus samples, thread safety."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from fkv import FkvError
from fkv.telemetry import BYTES_BUCKETS, SECONDS_BUCKETS, Telemetry

MIB = 1 << 20


def _client() -> Telemetry:
    t = Telemetry("client", engine_id="decode")
    t.record(path="packed", seconds=0.002, nbytes=16 * MIB, descriptors=1,
             waits={"pack": 0.0012, "transfer": 0.0004})
    t.record(path="packed", seconds=0.004, nbytes=48 * MIB, descriptors=3,
             waits={"pack": 0.003, "transfer": 0.0006})
    t.record(path="direct", seconds=0.5, nbytes=4096, descriptors=256)
    t.failure("timeout")
    t.failure("timeout")
    t.failure("peer_lost")
    t.notification(2)
    t.refused("undecodable")
    return t


def test_stats_are_exact_per_path_and_in_total() -> None:
    s = _client().stats()
    assert (s["role"], s["engine_id"]) == ("client", "decode")
    packed = s["paths"]["packed"]
    assert packed["count"] == 2
    assert packed["bytes"] == {"count": 2, "sum": 64 * MIB, "min": 16 * MIB, "max": 48 * MIB,
                               "mean": 32 * MIB,
                               "histogram": {"le": list(BYTES_BUCKETS),
                                             "counts": [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]}}
    assert packed["descriptors"] == {"count": 2, "sum": 4, "min": 1, "max": 3, "mean": 2.0}
    assert packed["seconds"]["sum"] == pytest.approx(0.006)
    assert packed["seconds"]["histogram"]["counts"] == [0, 0, 0, 0, 1, 1] + [0] * 11
    assert packed["gbps"]["min"] == pytest.approx(16 * MIB / 0.002 / 1e9)
    assert packed["gbps"]["max"] == pytest.approx(48 * MIB / 0.004 / 1e9)
    assert packed["gbps"]["overall"] == pytest.approx(64 * MIB / 0.006 / 1e9)
    assert packed["waits"]["pack"]["sum"] == pytest.approx(0.0042)
    assert packed["waits"]["transfer"]["max"] == pytest.approx(0.0006)
    total = s["total"]
    assert total["count"] == 3
    assert total["bytes"]["sum"] == 64 * MIB + 4096 and total["bytes"]["min"] == 4096
    assert total["descriptors"]["sum"] == 260
    assert total["seconds"]["histogram"]["counts"][11] == 1          # 0.5 s: in (0.25, 0.5]
    assert s["failures"] == {"peer_lost": 1, "timeout": 2}
    assert s["refused_messages"] == {"undecodable": 1}
    assert (s["notifications"], s["lease_expiries"]) == (2, 0)


def test_empty_stats_have_no_min_max_mean() -> None:
    s = Telemetry("server").stats()
    assert s["total"]["count"] == 0 and s["paths"] == {}
    assert s["total"]["bytes"]["min"] is None and s["total"]["gbps"]["overall"] is None


def test_prometheus_samples_match_the_events() -> None:
    client = _client()
    registry = client.prometheus()
    assert isinstance(registry, CollectorRegistry)
    server = Telemetry("server", engine_id="prefill")
    assert server.prometheus(registry) is registry
    server.record(path="packed", seconds=0.001, nbytes=16 * MIB, descriptors=1,
                  waits={"gather": 0.0003})
    server.lease_expired()
    server.notification()
    server.refused("unknown_request")
    server.refused("unknown_request")

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    c = {"role": "client", "engine_id": "decode", "path": "packed"}
    assert value("fkv_transfer_duration_seconds_count", **c) == 2
    assert value("fkv_transfer_duration_seconds_sum", **c) == pytest.approx(0.006)
    assert value("fkv_transfer_duration_seconds_bucket", **c, le="0.0025") == 1
    assert value("fkv_transfer_duration_seconds_bucket", **c, le="0.005") == 2
    assert value("fkv_transfer_duration_seconds_bucket", **c, le="+Inf") == 2
    assert value("fkv_transfer_size_bytes_sum", **c) == 64 * MIB
    assert value("fkv_transfer_size_bytes_bucket", **c, le="1.6777216e+07") == 1
    assert value("fkv_transfer_descriptors_total", **c) == 4
    assert value("fkv_transfer_descriptors_total", role="client", engine_id="decode",
                 path="direct") == 256
    assert value("fkv_transfer_wait_seconds_sum", **c, stage="pack") == pytest.approx(0.0042)
    assert value("fkv_transfer_failures_total", role="client", engine_id="decode",
                 reason="timeout") == 2
    assert value("fkv_transfer_failures_total", role="client", engine_id="decode",
                 reason="peer_lost") == 1
    assert value("fkv_notifications_total", role="client", engine_id="decode") == 2
    s = {"role": "server", "engine_id": "prefill"}
    assert value("fkv_transfer_duration_seconds_count", **s, path="packed") == 1
    assert value("fkv_transfer_wait_seconds_count", **s, path="packed", stage="gather") == 1
    assert value("fkv_lease_expiries_total", **s) == 1
    assert value("fkv_notifications_total", **s) == 1
    assert value("fkv_refused_messages_total", **s, reason="unknown_request") == 2
    assert value("fkv_refused_messages_total", role="client", engine_id="decode",
                 reason="undecodable") == 1
    client.record(path="packed", seconds=0.001, nbytes=MIB, descriptors=1)   # read at scrape
    assert value("fkv_transfer_duration_seconds_count", **c) == 3
    text = generate_latest(registry).decode()
    assert "# TYPE fkv_transfer_duration_seconds histogram" in text
    assert "# TYPE fkv_transfer_failures_total counter" in text


def test_registering_twice_counts_once_and_describing_registries_accept_it() -> None:
    t = _client()
    registry = CollectorRegistry(auto_describe=True)      # like prometheus_client.REGISTRY
    t.prometheus(registry)
    t.prometheus(registry)
    assert registry.get_sample_value("fkv_transfer_failures_total", {
        "role": "client", "engine_id": "decode", "reason": "timeout"}) == 2


def test_concurrent_recording_loses_nothing() -> None:
    t = Telemetry("client")

    def work() -> None:
        for _ in range(500):
            t.record(path="direct", seconds=0.001, nbytes=10, descriptors=2)
            t.failure("timeout")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = t.stats()
    assert s["total"]["count"] == 4000 and s["total"]["bytes"]["sum"] == 40000
    assert s["total"]["descriptors"]["sum"] == 8000 and s["failures"] == {"timeout": 4000}
    assert sum(s["total"]["seconds"]["histogram"]["counts"]) == 4000
    assert len(SECONDS_BUCKETS) + 1 == len(s["total"]["seconds"]["histogram"]["counts"])


@pytest.mark.parametrize(("call", "message"), [
    (lambda t: Telemetry("decoder"), r"'role' must be one of \('client', 'server'\) \(got 'decoder'\)"),
    (lambda t: t.record(path="", seconds=1, nbytes=1, descriptors=1), r"'path' must be a non-empty string"),
    (lambda t: t.record(path="direct", seconds=-1, nbytes=1, descriptors=1),
     r"'seconds' must be a non-negative number \(got -1\)"),
    (lambda t: t.record(path="direct", seconds=1, nbytes=1.5, descriptors=1),
     r"'nbytes' must be a non-negative integer \(got 1.5\)"),
    (lambda t: t.record(path="direct", seconds=1, nbytes=1, descriptors=1, waits={"pack": float("nan")}),
     r"'waits.pack' must be a non-negative number \(got nan\)"),
    (lambda t: t.failure(""), r"'reason' must be a non-empty string"),
    (lambda t: t.notification(-2), r"'n' must be a non-negative integer \(got -2\)"),
])
def test_bad_events_are_refused_with_the_field(call, message) -> None:
    with pytest.raises(FkvError, match=message):
        call(Telemetry("client"))


def test_import_stays_pure_and_fkv_does_not_load_it() -> None:
    code = ("import sys, fkv; assert 'fkv.telemetry' not in sys.modules; import fkv.telemetry; "
            "bad = [m for m in ('torch', 'triton', 'nixl', 'zmq', 'prometheus_client', 'numpy') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@given(st.lists(st.floats(min_value=0, allow_nan=False) | st.sampled_from(SECONDS_BUCKETS),
                max_size=50))
def test_each_value_counts_in_the_first_bucket_whose_bound_holds_it(values: list[float]) -> None:
    """A value lands in bucket ``i`` for the first bound ``>= value`` (the last bucket past
    every bound), as Prometheus' cumulative ``le`` buckets read them."""
    t = Telemetry("client")
    for v in values:
        t.record(path="direct", seconds=v, nbytes=0, descriptors=0)
    expected = [0] * (len(SECONDS_BUCKETS) + 1)
    for v in values:
        expected[next((i for i, b in enumerate(SECONDS_BUCKETS) if v <= b),
                      len(SECONDS_BUCKETS))] += 1
    got = t.stats()["paths"]["direct"]["seconds"]["histogram"]["counts"] if values else expected
    assert got == expected


def test_records_kept_as_they_came_add_up_the_same_whenever_they_are_read() -> None:
    """``record`` keeps each record as it came and adds them up when read or every 64: reading
    after each record, after 150 or never in between gives the same stats."""
    import fkv.telemetry as tm

    assert tm._FOLD == 64
    each, once = Telemetry("client"), Telemetry("client")
    for i in range(150):
        for t in (each, once):
            t.record(path=("direct", "staging")[i % 2], seconds=0.001 * (1 + i % 7),
                     nbytes=4096 * (1 + i), descriptors=i, waits={"transfer": 0.0001 * i})
        if i % 10 == 0:
            assert each.stats()["total"]["count"] == i + 1
        if i == 63:  # the 64th record added the 64 up; none are left pending
            assert once._pending == []
    assert len(once._pending) == 150 - 128
    assert once.stats() == each.stats() and once._pending == []
    direct = once.stats()["paths"]["direct"]
    assert direct["count"] == 75 and direct["bytes"]["sum"] == sum(4096 * (1 + i)
                                                                 for i in range(0, 150, 2))


def test_record_read_is_record_without_its_checks() -> None:
    """A client's read records through ``record_read`` (its values are fkv's own): the same
    stats as ``record`` with the waits as a mapping."""
    checked, trusted = Telemetry("client"), Telemetry("client")
    for i in range(70):
        checked.record(path="direct", seconds=0.001 * (1 + i % 5), nbytes=4096 * i,
                       descriptors=i, waits={"transfer": 0.0001 * i, "pack": 0.0})
        trusted.record_read("direct", 0.001 * (1 + i % 5), 4096 * i, i,
                            (("transfer", 0.0001 * i), ("pack", 0.0)))
    assert trusted.stats() == checked.stats()
    assert trusted.stats()["paths"]["direct"]["waits"]["transfer"]["count"] == 70


# -- holes found by mutation (2026-12-04) ----------------------------------------------------------

def test_integer_fields_stay_ints_and_a_read_of_nothing_has_no_rate() -> None:
    t = Telemetry("client")
    t.record(path="direct", seconds=0.001, nbytes=0, descriptors=0)     # a full prefix hit
    t.record(path="direct", seconds=0.002, nbytes=4096, descriptors=2)
    d = t.stats()["paths"]["direct"]
    assert [type(d["bytes"][k]) for k in ("sum", "min", "max")] == [int, int, int]
    assert [type(d["descriptors"][k]) for k in ("sum", "min", "max")] == [int, int, int]
    assert (d["bytes"]["min"], d["bytes"]["max"], d["descriptors"]["max"]) == (0, 4096, 2)
    assert d["gbps"]["count"] == 1 and d["gbps"]["min"] == d["gbps"]["max"] == 4096 / 0.002 / 1e9


def test_a_value_past_the_last_bound_counts_in_plus_inf_only() -> None:
    t = Telemetry("client", engine_id="decode")
    t.record(path="direct", seconds=20.0, nbytes=8 << 30, descriptors=1)
    t.record(path="direct", seconds=1.0, nbytes=4096, descriptors=1)
    assert t.stats()["paths"]["direct"]["seconds"]["histogram"]["counts"] == [0] * 12 + [1, 0, 0, 0, 1]
    registry = t.prometheus()
    labels = {"role": "client", "engine_id": "decode", "path": "direct"}
    get = registry.get_sample_value
    assert get("fkv_transfer_duration_seconds_bucket", {**labels, "le": "10.0"}) == 1
    assert get("fkv_transfer_duration_seconds_bucket", {**labels, "le": "+Inf"}) == 2
    assert get("fkv_transfer_size_bytes_bucket", {**labels, "le": "4.294967296e+09"}) == 1
    assert get("fkv_transfer_size_bytes_bucket", {**labels, "le": "+Inf"}) == 2


def test_bools_are_not_counts() -> None:
    t = Telemetry("client")
    for call, message in (
            (lambda: t.record(path="direct", seconds=True, nbytes=1, descriptors=1),
             "'seconds' must be a non-negative number (got True)"),
            (lambda: t.record(path="direct", seconds=1, nbytes=True, descriptors=1),
             "'nbytes' must be a non-negative integer (got True)"),
            (lambda: t.lease_expired(False), "'n' must be a non-negative integer (got False)")):
        with pytest.raises(FkvError) as e:
            call()
        assert str(e.value) == message
    assert t.stats()["total"]["count"] == 0 and t.stats()["lease_expiries"] == 0


def test_counters_add_n_and_sources_with_one_label_set_add_up() -> None:
    """Two endpoints with the same role and engine_id on one registry: their counters are
    summed into one series, not the last one's."""
    a, b = Telemetry("server", engine_id="prefill"), Telemetry("server", engine_id="prefill")
    a.lease_expired(3)
    b.lease_expired(4)
    a.notification(5)
    b.notification()
    a.failure("timeout")
    b.failure("timeout")
    b.refused("undecodable")
    assert (a.stats()["lease_expiries"], a.stats()["notifications"]) == (3, 5)
    registry = a.prometheus()
    b.prometheus(registry)
    who = {"role": "server", "engine_id": "prefill"}
    get = registry.get_sample_value
    assert get("fkv_lease_expiries_total", who) == 7
    assert get("fkv_notifications_total", who) == 6
    assert get("fkv_transfer_failures_total", {**who, "reason": "timeout"}) == 2
    assert get("fkv_refused_messages_total", {**who, "reason": "undecodable"}) == 1


def test_prometheus_never_registers_on_the_global_registry_unless_passed() -> None:
    import prometheus_client

    t = _client()
    first, second = t.prometheus(), t.prometheus()
    assert first is not prometheus_client.REGISTRY and second is not first
    assert prometheus_client.REGISTRY.get_sample_value("fkv_transfer_failures_total", {
        "role": "client", "engine_id": "decode", "reason": "timeout"}) is None
    assert first.get_sample_value("fkv_transfer_failures_total", {
        "role": "client", "engine_id": "decode", "reason": "timeout"}) == 2


def test_stats_list_paths_stages_and_reasons_in_sorted_order() -> None:
    """Stats are dumped as JSON (bench results, the demo summary): key order is sorted, not the
    order the events came in."""
    t = Telemetry("client")
    t.record(path="staging", seconds=0.001, nbytes=1, descriptors=1,
             waits={"transfer": 0.0001, "pack": 0.0002})
    t.record(path="direct", seconds=0.001, nbytes=1, descriptors=1)
    t.failure("timeout")
    t.failure("peer_lost")
    t.refused("wrong_engine")
    t.refused("undecodable")
    s = t.stats()
    assert list(s["paths"]) == ["direct", "staging"]
    assert list(s["paths"]["staging"]["waits"]) == ["pack", "transfer"]
    assert list(s["total"]["waits"]) == ["pack", "transfer"]
    assert list(s["failures"]) == ["peer_lost", "timeout"]
    assert list(s["refused_messages"]) == ["undecodable", "wrong_engine"]
