"""fkv demo's checking code on hand-built inputs: the verdict, the exit status, the summary's figures.

In process and fast (no child is started): each test pins exact values a mutation audit of
fkv/demo/{verify,summary,config,run}.py found unpinned (a wrong transfer passing, a wrong figure).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from rich.console import Console

import fkv.demo.run as demo_run
from fkv.demo.channel import Collector, Reporter, pack_array
from fkv.demo.config import DemoConfig, ModelConfig, head_ranges
from fkv.demo.run import _verdict, precheck, run_demo
from fkv.demo.summary import print_reject, print_summary, summary_dict
from fkv.demo.verify import compare_kv, compare_run, tolerance
from fkv.errors import FkvError

# -- verify: tolerance and compare_kv ---------------------------------------------------------------


def test_tolerance_is_tight_for_float32_and_loose_for_16_bit_caches():
    assert tolerance("float32") == (1e-4, 1e-4)
    assert tolerance("bfloat16") == tolerance("float16") == (5e-2, 5e-2)


def _ref_kv() -> np.ndarray:
    """``[L=2, T=3, 2, H=4, D=2]`` with distinct, exactly representable values."""
    return (np.arange(2 * 3 * 2 * 4 * 2, dtype=np.float32) / 4).reshape(2, 3, 2, 4, 2)


def test_compare_kv_refuses_received_kv_of_another_shape():
    ref = _ref_kv()
    got = ref[:, :, :, 2:3].copy()  # one head where (2, 4) means two
    assert compare_kv(ref, got, (2, 4), 1e-4, 1e-4) == (
        float("inf"), "received KV has shape (2, 3, 2, 1, 2), expected (2, 3, 2, 2, 2)")


def test_compare_kv_reports_the_worst_difference_and_the_first_mismatch():
    ref = _ref_kv()
    got = ref[:, :, :, 2:4].copy()
    got[0, 1, 1, 1, 0] += 0.5    # first in C order: layer 0, token 1, V, head 3, channel 0
    got[1, 2, 0, 0, 1] -= 2.0    # later, and the larger difference
    want0, want1 = float(ref[0, 1, 1, 3, 0]), float(ref[1, 2, 0, 2, 1])
    assert (want0, want1) == (7.5, 21.25)
    assert compare_kv(ref, got, (2, 4), 1e-4, 1e-4) == (
        2.0, "KV after transfer differs first at layer 0, token 1, V, head 3, channel 0: "
             "received 8.0, reference 7.5 (2 of 48 values differ)")


def test_compare_kv_within_tolerance_reports_its_difference_and_no_mismatch():
    ref = _ref_kv()
    got = ref[:, :, :, 0:2].copy()
    got[1, 0, 0, 1, 1] += 0.0625   # within atol 0.1
    assert compare_kv(ref, got, (0, 2), 0.0, 0.1) == (0.0625, None)


# -- verify: compare_run ---------------------------------------------------------------------------

_LOGITS = [np.array([0.0, 1.0, 0.5], np.float32), np.array([2.0, -1.0, 1.0], np.float32),
           np.array([1.0, 1.0, 3.0], np.float32)]
_KV_OK = [(0.0, None), (0.0, None)]


def _bumped(step: int, index: int, by: float) -> list[np.ndarray]:
    out = [x.copy() for x in _LOGITS]
    out[step][index] += by
    return out


def test_compare_run_applies_the_dtypes_logits_tolerance():
    # |diff| 5e-4 on a logit of 1.0: outside float32's 1e-4 + 1e-4 * 1, inside bfloat16's bound.
    got = _bumped(1, 2, 5e-4)
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, _KV_OK, "float32", 8)
    assert (v["ok"], v["logits_ok"], v["tokens_identical"]) == (False, False, True)
    assert v["first_divergence"] == (
        "step 1 (position 8, decode): logits differ by up to 0.0005 (token 2: 1.0005 vs reference "
        "1; tolerance rtol=0.0001, atol=0.0001)")
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, _KV_OK, "bfloat16", 8)
    assert (v["ok"], v["first_divergence"], v["rtol"], v["atol"]) == (True, None, 5e-2, 5e-2)


def test_compare_run_reports_the_largest_difference_of_every_step():
    got = _bumped(0, 1, 0.25)
    got[2][0] += 0.125  # the last step's difference is smaller than the first's
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, [(0.5, None), (0.0, None)], "float32", 8)
    assert dict(v) == {"ok": False, "tokens_identical": True, "logits_max_abs_diff": 0.25,
                       "logits_ok": False, "kv_max_abs_diff": 0.5, "kv_ok": True,
                       "first_divergence": "step 0 (position 7, prefill): logits differ by up to "
                       "0.25 (token 1: 1.25 vs reference 1; tolerance rtol=0.0001, atol=0.0001)",
                       "rtol": 1e-4, "atol": 1e-4}


def test_compare_run_counts_non_finite_logits_as_an_infinite_difference():
    got = _bumped(1, 0, 0.0)
    got[1][1] = np.nan
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, _KV_OK, "float32", 8)
    assert v["logits_max_abs_diff"] == float("inf") and not v["logits_ok"] and not v["ok"]


def test_compare_run_fails_a_missing_logits_step():
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], _LOGITS[:2], _KV_OK, "float32", 8)
    assert (v["ok"], v["logits_ok"], v["tokens_identical"]) == (False, False, True)


def test_compare_run_names_a_short_generation():
    v = compare_run([1, 0, 2], _LOGITS, [1, 0], _LOGITS[:2], _KV_OK, "float32", 8)
    assert (v["ok"], v["tokens_identical"]) == (False, False)
    assert v["first_divergence"] == "generated 2 tokens, reference 3"
    # Logits for a step without its token: the step is named, with no token generated.
    v = compare_run([1, 0, 2], _LOGITS, [1, 0], _LOGITS, _KV_OK, "float32", 8)
    assert v["first_divergence"] == "step 2 (position 9, decode): generated token None, reference 2"


def test_compare_run_without_any_token_is_not_a_pass():
    v = compare_run([], [], [], [], _KV_OK, "float32", 8)
    assert (v["ok"], v["tokens_identical"]) == (False, False)
    assert v["first_divergence"] == "generated 0 tokens, reference 0"


def test_compare_run_fails_on_the_kv_alone_and_names_the_first_rank_that_differs():
    kv = [(0.0, None), (3.0, "rank 1's KV differs"), (0.5, "rank 2's KV differs")]
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], _LOGITS, kv, "float32", 8)
    assert (v["ok"], v["tokens_identical"], v["logits_ok"], v["kv_ok"]) == (False, True, True, False)
    assert (v["kv_max_abs_diff"], v["first_divergence"]) == (3.0, "rank 1's KV differs")
    # With a later divergence as well: the KV comes first, the step follows.
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 7], _LOGITS, kv, "float32", 8)
    assert v["first_divergence"] == ("rank 1's KV differs; then step 2 (position 9, decode): "
                                     "generated token 7, reference 2")


def test_compare_run_without_any_kv_check_is_not_a_pass():
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], _LOGITS, [], "float32", 8)
    assert (v["ok"], v["kv_ok"], v["kv_max_abs_diff"], v["first_divergence"]) == (
        False, False, 0.0, None)


# -- run: the verdict from the collected events, and the exit status -------------------------------

def _state(cfg: DemoConfig, *, tokens=(5, 7, 1), ref_tokens=(5, 7, 1)) -> dict:
    """What the collector gathers from a run whose decode matches the reference exactly."""
    ref = _ref_kv()
    h = ref.shape[3] // cfg.decode_tp
    steps = {s: {"token": t, "logits": pack_array(_LOGITS[s])} for s, t in enumerate(tokens)}
    ref_steps = {s: {"token": t, "logits": pack_array(_LOGITS[s])} for s, t in enumerate(ref_tokens)}
    return {"transfers": {}, "errors": [], "exited_ok": set(),
            "prefill": steps.pop(0), "steps": steps,
            "ref_prefill": ref_steps.pop(0), "ref_steps": ref_steps, "ref_kv": ref,
            "kv": {r: ((r * h, (r + 1) * h), ref[:, :, :, r * h:(r + 1) * h].copy())
                   for r in range(cfg.decode_tp)}}


def test_verdict_passes_a_matching_run_and_records_both_token_lists():
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg, tokens=(5, 7, 1), ref_tokens=(5, 7, 2))
    v = _verdict(cfg, state)
    assert (state["tokens"], state["ref_tokens"]) == ([5, 7, 1], [5, 7, 2])
    assert not v["ok"] and v["first_divergence"] == (
        "step 2 (position 4, decode): generated token 1, reference 2")
    v = _verdict(cfg, _state(cfg))
    assert (v["ok"], v["first_divergence"], v["kv_max_abs_diff"]) == (True, None, 0.0)


def test_verdict_fails_when_a_decode_rank_sent_no_kv():
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    del state["kv"][1]
    v = _verdict(cfg, state)
    assert (v["ok"], v["kv_ok"], v["tokens_identical"]) == (False, False, True)
    assert v["first_divergence"] == "received KV from 1 of 2 decode ranks"


def test_verdict_checks_float32_kv_at_float32_tolerance():
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    state["kv"][1][1][0, 0, 0, 0, 0] += 1e-3  # 1.0 + 1e-3: outside 1e-4 + 1e-4 * 1.0
    v = _verdict(cfg, state)
    assert not v["ok"] and v["first_divergence"] == (
        "KV after transfer differs first at layer 0, token 0, K, head 2, channel 0: received "
        "1.0010000467300415, reference 1.0 (1 of 48 values differ)")


class _NoCollector:
    address = "inproc://unused"

    def close(self) -> None:
        pass


def _fake_run(monkeypatch, cfg: DemoConfig, state: dict, failed: list) -> tuple[int, str]:
    """run_demo with the processes replaced: ``state`` is what the run gathered, ``failed`` the
    children that exited non-zero. Returns the exit code and the printout."""
    class Children:
        def __init__(self, *args) -> None:
            pass

        def wait(self, timeout_s: float) -> None:
            pass

        def failed(self) -> list:
            return failed

        def stop(self) -> None:
            pass

        def log_tail(self, role: str, rank: int) -> str:
            return f"{role}{rank} log"

    def drive(cfg, children, collector, console, into) -> None:
        into.update(state)

    monkeypatch.setattr(demo_run, "Collector", _NoCollector)
    monkeypatch.setattr(demo_run, "_Children", Children)
    monkeypatch.setattr(demo_run, "_drive", drive)
    buf = io.StringIO()
    return run_demo(cfg, console=Console(file=buf, width=300, color_system=None),
                    json_path=None), buf.getvalue()


def test_run_demo_exits_0_on_a_matching_run_and_1_when_a_rank_reported_an_error(monkeypatch):
    cfg = DemoConfig(tokens=3, new_tokens=3)
    code, out = _fake_run(monkeypatch, cfg, _state(cfg), [])
    assert code == 0 and "│ verification │ PASS: tokens identical" in out
    state = _state(cfg)
    state["errors"] = [{"role": "prefill", "rank": 0, "error": "boom", "log": None}]
    code, out = _fake_run(monkeypatch, cfg, state, [])
    assert code == 1
    assert "│ verification │ FAIL: the run did not complete (see the errors below)" in out


def test_run_demo_counts_a_child_that_exited_non_zero_unless_it_reported_success(monkeypatch):
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    code, out = _fake_run(monkeypatch, cfg, state, [("decode", 1, 7)])
    assert code == 1 and "│ error        │ decode rank 1: exited with code 7" in out
    state = _state(cfg)
    state["exited_ok"] = {("decode", 1)}  # reported exit 0, then was slow to tear down
    code, out = _fake_run(monkeypatch, cfg, state, [("decode", 1, -9)])
    assert code == 0 and "error" not in out


# -- summary: the JSON figures and the printed table ------------------------------------------------

def _transfer(rank: int, *, ok: bool = True, nbytes: int, descriptors: int, seconds: float,
              nixl: float) -> dict:
    return {"rank": rank, "ok": ok, "bytes": nbytes, "descriptors": descriptors, "seconds": seconds,
            "nixl_seconds": nixl, "path": "direct", "moved_by": "NIXL", "stats": {}, "error": None}


_PASS = {"ok": True, "tokens_identical": True, "logits_max_abs_diff": 1.5e-5, "logits_ok": True,
         "kv_max_abs_diff": 0.0, "kv_ok": True, "first_divergence": None, "rtol": 1e-4,
         "atol": 1e-4}


def _summary(cfg: DemoConfig, transfers: list[dict], verdict: dict = _PASS, errors=(),
             code: int = 0, **state) -> dict:
    results, _ = precheck(cfg)
    st = {"transfers": {t["rank"]: t for t in transfers}, "tokens": [5, 7], "ref_tokens": [5, 7],
          "wall_seconds": 2.5, **state}
    return summary_dict(cfg, results, st, verdict, list(errors), exit_code=code)


def _rows(s: dict) -> dict[str, str]:
    buf = io.StringIO()
    print_summary(Console(file=buf, width=400, color_system=None), s)
    rows = {}
    for line in buf.getvalue().splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 4 and cells[1]:
            rows[cells[1]] = cells[2]
    return rows


def test_summary_adds_up_every_ranks_transfer():
    cfg = DemoConfig()  # decode TP=2
    s = _summary(cfg, [_transfer(1, nbytes=200, descriptors=8, seconds=0.75, nixl=0.125),
                       _transfer(0, nbytes=100, descriptors=4, seconds=0.5, nixl=0.25)])
    t = s["transfer"]
    assert {k: t[k] for k in ("ok", "bytes", "descriptors", "seconds", "nixl_seconds",
                              "moved_by")} == {"ok": True, "bytes": 300, "descriptors": 12,
                                               "seconds": 0.75, "nixl_seconds": 0.25,
                                               "moved_by": "NIXL"}
    assert [r["rank"] for r in t["per_rank"]] == [0, 1]
    assert _rows(s)["transfer"] == ("ok: 300 bytes in 12 descriptors over 2 read(s); read 750.0 ms, "
                                    "of which NIXL 250.0 ms (slowest rank)")


def test_summary_transfer_fails_when_a_rank_failed_or_is_missing():
    cfg = DemoConfig()
    one = _transfer(0, nbytes=100, descriptors=4, seconds=0.5, nixl=0.25)
    assert _summary(cfg, [one])["transfer"]["ok"] is False
    s = _summary(cfg, [one, _transfer(1, ok=False, nbytes=0, descriptors=0, seconds=0.5, nixl=0.0)])
    assert s["transfer"]["ok"] is False
    assert _rows(s)["transfer"].startswith("FAILED: 100 bytes in 4 descriptors over 2 read(s)")


def test_summary_keeps_each_max_difference_in_its_place_and_infinity_as_null():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    verdict = {**_PASS, "ok": False, "logits_max_abs_diff": 0.25, "kv_max_abs_diff": float("inf"),
               "kv_ok": False, "first_divergence": "KV differs"}
    s = _summary(cfg, xfer, verdict, code=1)
    assert (s["verification"]["logits_max_abs_diff"], s["verification"]["kv_max_abs_diff"]) == (
        0.25, None)
    json.dumps(s, allow_nan=False)  # valid JSON: no Infinity
    rows = _rows(s)
    assert rows["verification"] == ("FAIL: tokens identical; logits max |diff| 0.25; KV after "
                                    "transfer max |diff| n/a (rtol 0.0001, atol 0.0001)")
    assert (rows["diverged at"], rows["exit code"]) == ("KV differs", "1")


def test_summary_prints_pass_only_for_a_passing_verdict_and_says_which_part_differs():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    rows = _rows(_summary(cfg, xfer))
    assert rows["verification"] == ("PASS: tokens identical; logits max |diff| 1.5e-05; KV after "
                                    "transfer max |diff| 0 (rtol 0.0001, atol 0.0001)")
    assert rows["exit code"] == "0" and "diverged at" not in rows
    # Tokens identical, KV wrong: FAIL, yet the tokens are reported identical.
    bad_kv = {**_PASS, "ok": False, "kv_ok": False, "kv_max_abs_diff": 1.0, "first_divergence": "x"}
    rows = _rows(_summary(cfg, xfer, bad_kv, code=1))
    assert rows["verification"].startswith("FAIL: tokens identical; ")
    assert rows["exit code"] == "1"
    bad_tokens = {**_PASS, "ok": False, "tokens_identical": False, "first_divergence": "y"}
    assert _rows(_summary(cfg, xfer, bad_tokens, code=1))["verification"].startswith(
        "FAIL: tokens DIFFER; ")


def test_summary_rejects_when_any_decode_rank_is_refused():
    ok = precheck(DemoConfig())[0][0]
    refused = precheck(DemoConfig(decode_head_size=32))[0][0]
    assert ok.ok and not refused.ok
    s = summary_dict(DemoConfig(), [ok, refused], None, None, None, exit_code=3)
    assert s["handshake"]["decision"] == "reject"
    assert [r["code"] for r in s["handshake"]["reasons"]] == ["head_size"]


# -- summary: --stream --------------------------------------------------------------------------------

_STREAM_CFG = DemoConfig(stream=True, model=ModelConfig(num_layers=2))


def _stream_state() -> dict:
    """Two decode ranks, one prefill rank, two layers; binary fractions so sums are exact."""
    def xfer(rank, landed, completed, seconds, plain_seconds, plain_bytes):
        return {**_transfer(rank, nbytes=plain_bytes, descriptors=2, seconds=seconds, nixl=0.25),
                "stream": True, "landed": landed, "completed": completed,
                "plain": {"ok": True, "seconds": plain_seconds, "bytes": plain_bytes, "error": None},
                "plain_equal": True}
    return {"prefill_ranks": {0: {"forward_start": 10.0, "published": [10.5, 11.0],
                                  "seconds": 1.25}},
            "transfers": [xfer(0, [10.75, 11.25], 11.5, 2.0, 0.5, 100),
                          xfer(1, [10.625, 11.5], 11.75, 2.5, 0.75, 200)]}


def _stream_summary(st: dict) -> dict:
    return _summary(_STREAM_CFG, st.pop("transfers"), **st)


def test_stream_summary_times_the_slowest_rank_from_the_last_layer():
    s = _stream_summary(_stream_state())
    assert s["stream"] == {
        "prefill_forward_seconds": 1.25,
        "streamed": {"tail_seconds": 0.75, "read_seconds": 2.5},
        "non_streamed": {"ok": True, "tail_seconds": 0.75, "bytes": 300, "errors": []},
        "identical": True,
        "layers": [{"layer": 0, "published_seconds": 0.5, "landed_seconds": 0.75,
                    "after_publish_seconds": 0.25},
                   {"layer": 1, "published_seconds": 1.0, "landed_seconds": 1.5,
                    "after_publish_seconds": 0.5}]}
    assert _rows(s)["same KV"] == ("streamed and non-streamed reads identical; prefill forward "
                                     "1250.0 ms")


def test_stream_summary_identical_only_when_every_rank_compared_equal():
    st = _stream_state()
    st["transfers"][1]["plain_equal"] = None  # not compared
    s = _stream_summary(st)
    assert s["stream"]["identical"] is False
    assert _rows(s)["same KV"].startswith("streamed and non-streamed reads DIFFER;")


def test_stream_summary_a_failed_non_streamed_read_has_no_time():
    st = _stream_state()
    st["transfers"][0]["plain"] = {"ok": False, "seconds": 0.25, "bytes": 0, "error": "timeout"}
    ns = _stream_summary(st)["stream"]["non_streamed"]
    assert ns == {"ok": False, "tail_seconds": None, "bytes": 200, "errors": ["timeout"]}


def test_stream_summary_is_incomplete_when_a_streamed_read_failed():
    st = _stream_state()
    st["transfers"][1]["ok"] = False  # every layer's time came back, the read failed
    s = _stream_summary(st)
    assert s["stream"] is None
    assert _rows(s)["streaming"] == "incomplete (a streamed or non-streamed read failed)"


# -- config: the blocks the request uses --------------------------------------------------------------

def test_replicated_kv_heads_are_one_per_rank():
    assert DemoConfig(decode_tp=16).spec("decode").num_kv_heads == 1


def test_decode_blocks_hold_every_transferred_slot_even_for_a_short_generation():
    cfg = DemoConfig(tokens=17, new_tokens=1, prefill_block_size=16, decode_block_size=8)
    # 2 prefill blocks = 32 slots -> 4 decode blocks, though 18 tokens would fit in 3.
    assert (cfg.prefill_blocks(), cfg.decode_prompt_blocks(), cfg.decode_blocks()) == (2, 4, 4)
    assert len(cfg.block_ids("decode")) == 4


@pytest.mark.parametrize("cfg", [DemoConfig(stream=True),
                                 DemoConfig(stream=True, tokens=24, decode_block_size=8)],
                         ids=["default", "small-blocks"])
def test_plain_blocks_are_free_blocks_enough_for_the_prompt(cfg):
    plain, request = cfg.plain_block_ids(), cfg.block_ids("decode")
    assert len(plain) == cfg.decode_prompt_blocks() == len(set(plain))
    assert not set(plain) & set(request)
    assert max(plain) < cfg.spec("decode").num_blocks


# -- bugs the audit found ---------------------------------------------------------------------------

def test_compare_run_names_a_step_the_reference_has_no_token_for():
    # Logits for every step, one reference token short: a divergence, not an IndexError.
    v = compare_run([1, 0], _LOGITS, [1, 0, 2], _LOGITS, _KV_OK, "float32", 8)
    assert (v["ok"], v["tokens_identical"]) == (False, False)
    assert v["first_divergence"] == "step 2 (position 9, decode): generated token 2, reference None"


def test_stream_run_fails_when_the_non_streamed_read_differs_from_the_streamed_one(monkeypatch):
    # The streamed KV matches the reference, but the same KV read again non-streamed came back
    # different: one of the two reads delivered wrong bytes, so the run does not pass.
    cfg = DemoConfig(tokens=3, new_tokens=3, stream=True)
    state = _state(cfg)
    state["transfers"] = {r: {"ok": True, "plain": {"ok": True}, "plain_equal": r != 1}
                          for r in range(2)}
    v = _verdict(cfg, state)
    assert (v["ok"], v["kv_ok"], v["tokens_identical"], v["logits_ok"]) == (False, False, True, True)
    assert v["first_divergence"] == ("decode rank 1: the non-streamed read of the same KV differs "
                                     "from the streamed read")
    assert v["kv_max_abs_diff"] == 0.0  # the figure stays the streamed KV against the reference
    state["transfers"][1]["plain_equal"] = True
    assert _verdict(cfg, state)["ok"] is True


def test_drive_stops_as_soon_as_a_rank_reports_a_failed_exit():
    # A decode rank whose read failed reports its transfer and exits 1 (worker.run_decode). The
    # prefill rank, never notified, holds the request until its lease runs out (120 s): the run
    # stops at once, naming the rank, instead of waiting for that (or for --timeout).
    class Children:  # the ranks' processes: their events come from the reporters below
        def start(self, role: str, rank: int) -> None:
            pass

        def tell(self, role: str, rank: int, message: dict) -> None:
            pass

        def failed(self) -> list:
            return []

        def running(self) -> bool:
            return True

    cfg = DemoConfig(decode_tp=1, tokens=3, new_tokens=3, timeout=5.0)
    collector = Collector()
    try:
        reporters = {role: Reporter(collector.address, role, 0)
                     for role in ("reference", "prefill", "decode")}
        reporters["reference"].send("exit", code=0)
        reporters["prefill"].send("prefilled", token=5, logits=pack_array(_LOGITS[0]))
        reporters["prefill"].send("serving", address="tcp://127.0.0.1:1")
        reporters["decode"].send("transferred", ok=False, bytes=0)
        reporters["decode"].send("exit", code=1)
        for r in reporters.values():
            r.close()
        state = {"transfers": {}, "kv": {}, "steps": {}, "ref_steps": {}, "errors": [],
                 "exited_ok": set()}
        demo_run._drive(cfg, Children(), collector, Console(file=io.StringIO()), state)
    finally:
        collector.close()
    assert state["errors"] == [{"role": "decode", "rank": 0, "error": "exited with code 1",
                                "log": None}]
    assert state["exited_ok"] == {("reference", 0)} and not state["transfers"][0]["ok"]


# == second audit: exact values a second mutation pass found unpinned ================================

# -- config -----------------------------------------------------------------------------------------

def test_head_ranges_refuses_a_rank_outside_the_engine_and_a_tp_the_query_heads_do_not_split():
    with pytest.raises(FkvError) as e:
        head_ranges(ModelConfig(), 2, 2)
    assert str(e.value) == "'rank' must be in [0, 2) (got 2)"
    with pytest.raises(FkvError) as e:
        head_ranges(ModelConfig(), 2, -1)
    assert str(e.value) == "'rank' must be in [0, 2) (got -1)"
    # 32 is a multiple of the 8 KV heads (the handshake accepts it), but 16 query heads do not split.
    with pytest.raises(FkvError) as e:
        head_ranges(ModelConfig(), 32, 0)
    assert str(e.value) == ("'tp' must divide num_q_heads=16 and divide or be a multiple of "
                            "num_kv_heads=8 (got 32)")


def test_default_config_is_the_documented_one():
    # docs/cli.md's defaults and fkv.demo's docstring example.
    cfg = DemoConfig()
    assert (cfg.prefill_tp, cfg.decode_tp, cfg.tokens, cfg.new_tokens, cfg.timeout) == (
        1, 2, 64, 16, 600.0)
    assert repr(cfg.spec("decode")) == (
        "KVCacheSpec(backend='triton', layout='HND', num_blocks=13, block_size=16, num_kv_heads=4, "
        "head_size=64, dtype='float32', num_layers=4)")
    assert cfg.spec("prefill").num_blocks == 11  # 2 * 4 used + 3


def test_engines_are_named_by_side_and_carry_the_models_total_kv_heads():
    from fkv.connector.handshake import EngineDesc

    cfg = DemoConfig(prefill_tp=2, decode_tp=4)
    assert cfg.engine("prefill", 1) == EngineDesc(
        engine_id="prefill-engine", tp_size=2, tp_rank=1, total_num_kv_heads=8,
        model="fkv-demo-transformer", model_dtype="float32")
    assert cfg.engine("decode", 3) == EngineDesc(
        engine_id="decode-engine", tp_size=4, tp_rank=3, total_num_kv_heads=8,
        model="fkv-demo-transformer", model_dtype="float32")


def test_seed_picks_the_prompt_and_the_block_tables():
    cfg, other = DemoConfig(tokens=40), DemoConfig(tokens=40, seed=1)
    prompt = cfg.prompt()
    assert len(prompt) == 40 and all(0 <= t < cfg.model.vocab for t in prompt)
    assert prompt == DemoConfig(tokens=40).prompt() != other.prompt()
    assert cfg.block_ids("decode") != other.block_ids("decode")
    assert cfg.block_ids("prefill") != other.block_ids("prefill")


# -- summary: the JSON ------------------------------------------------------------------------------

def test_summary_json_holds_the_options_tokens_errors_and_every_ranks_plan():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    xfer[1]["error"] = "late"
    errors = [{"role": "decode", "rank": 1, "error": "boom", "log": None}]
    s = _summary(cfg, xfer, errors=errors, code=1, tokens=[5, 7], ref_tokens=[5, 8])
    assert s["config"] == {"prefill_tp": 1, "decode_tp": 2, "prefill_layout": "HND",
                           "decode_layout": "HND", "backend": "triton", "prefill_block_size": 16,
                           "decode_block_size": 16, "tokens": 64, "new_tokens": 16,
                           "device": "cpu", "dtype": "float32", "decode_head_size": None,
                           "corrupt": False, "seed": 0, "timeout": 600.0,
                           "same_host_copies": False}  # no "stream" key unless --stream
    assert s["model"] == {"vocab": 256, "hidden": 128, "num_layers": 4, "num_q_heads": 16,
                          "num_kv_heads": 8, "head_size": 64, "mlp": 256, "seed": 0,
                          "rope_theta": 10000.0}
    assert s["prefill"]["engine"] == ("TP=1 (1 process), triton HND, block 16, "
                                      "8 KV head(s)/rank, float32")
    assert s["decode"]["engine"] == ("TP=2 (2 processes), triton HND, block 16, "
                                     "4 KV head(s)/rank, float32")
    assert s["tokens"] == {"prompt": 64, "new": 16, "generated": [5, 7], "reference": [5, 8]}
    assert s["errors"] == [{"role": "decode", "rank": 1, "error": "boom"}]  # no null log
    assert (s["wall_seconds"], s["exit_code"], "stream" in s) == (2.5, 1, False)
    assert s["transfer"]["per_rank"][1] == {
        "rank": 1, "ok": True, "bytes": 1, "descriptors": 1, "seconds": 0.5, "nixl_seconds": 0.25,
        "path": "direct", "moved_by": "NIXL", "stats": {}, "error": "late"}
    results, _ = precheck(cfg)
    assert len(results) == 2
    assert s["handshake"] == {"decision": "accept", "strategy": "direct",
                              "plans": [h.plan.describe() for h in results]}
    assert s["handshake"]["plans"][1].startswith("decode rank 1 of tp 2 <- prefill tp 1")
    assert _summary(_STREAM_CFG, xfer)["config"]["stream"] is True


def test_summary_json_of_a_refusal_names_each_reasons_local_and_remote_values():
    cfg = DemoConfig(decode_head_size=32)
    s = summary_dict(cfg, precheck(cfg)[0], None, None, None, exit_code=3)
    assert s["handshake"] == {"decision": "reject", "reasons": [
        {"code": "head_size", "path": "remote.spec.head_size", "local": "32", "remote": "64",
         "message": "head sizes differ",
         "fix": "both engines must serve the same model (same head_size)"}]}
    assert s["exit_code"] == 3 and "transfer" not in s and "verification" not in s


def test_summary_names_every_mover_of_the_bytes():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    xfer[0]["moved_by"] = "process_vm_readv"
    s = _summary(cfg, xfer)
    assert s["transfer"]["moved_by"] == "NIXL and process_vm_readv"
    assert _rows(s)["transfer"] == ("ok: 2 bytes in 2 descriptors over 2 read(s); read 500.0 ms, "
                                    "of which NIXL and process_vm_readv 250.0 ms (slowest rank)")
    xfer[0]["moved_by"] = None  # not reported: NIXL
    assert _summary(cfg, xfer)["transfer"]["moved_by"] == "NIXL"


# -- summary: the printed table ----------------------------------------------------------------------

def _printed(s: dict) -> str:
    buf = io.StringIO()
    print_summary(Console(file=buf, width=400, color_system=None), s)
    return buf.getvalue()


def test_summary_table_of_a_passing_run_row_by_row():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    s = _summary(cfg, xfer, wall_seconds=12.25)
    assert _rows(s) == {
        "model": "4 layers, 16 query / 8 KV heads of 64, hidden 128, vocab 256 (seed 0)",
        "prefill": "TP=1 (1 process), triton HND, block 16, 8 KV head(s)/rank, float32",
        "decode": "TP=2 (2 processes), triton HND, block 16, 4 KV head(s)/rank, float32",
        "handshake": "Accept, strategy direct",
        "transfer": "ok: 2 bytes in 2 descriptors over 2 read(s); read 500.0 ms, of which NIXL "
                    "250.0 ms (slowest rank)",
        "tokens": "prompt 64, generated 2: [5, 7]",
        "verification": "PASS: tokens identical; logits max |diff| 1.5e-05; KV after transfer "
                        "max |diff| 0 (rtol 0.0001, atol 0.0001)",
        "wall time": "12.2 s",
        "exit code": "0"}
    out = _printed(s)
    assert " plan of decode rank 0 " in out
    assert "│ decode rank 0 of tp 2 <- prefill tp 1: 8 KV heads total" in out


def test_summary_table_prints_each_ranks_stats_when_it_has_any():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    xfer[0]["stats"] = {"reads": 2, "failures": {}, "gbps": 1.23456}
    xfer[1]["stats"] = {"reads": 1, "failures": {"timeout": 1}, "gbps": None}
    rows = _rows(_summary(cfg, xfer))
    assert rows["rank 0 stats"] == "path direct, 2 read(s), failures none, 1.23 GB/s"
    assert rows["rank 1 stats"] == "path direct, 1 read(s), failures {'timeout': 1}"
    xfer[1]["stats"] = {}
    assert "rank 1 stats" not in _rows(_summary(cfg, xfer))


def test_summary_table_without_any_transfer_reported():
    s = _summary(DemoConfig(), [])
    assert (s["transfer"]["ok"], s["transfer"]["seconds"]) == (False, None)
    assert _rows(s)["transfer"] == "FAILED: 0 bytes in 0 descriptors over 0 read(s); n/a"


def test_summary_table_shows_a_failed_ranks_log():
    cfg = DemoConfig()
    errors = [{"role": "decode", "rank": 1, "error": "exited with code 7", "log": "last words"}]
    out = _printed(_summary(cfg, [], _PASS, errors, code=1))
    assert " decode rank 1 log (tail) " in out and "│ last words" in out


def test_stream_table_compares_both_reads_and_times_each_layer():
    st = _stream_state()
    for t in st["transfers"]:
        t["plain"]["seconds"] = 1.5  # the non-streamed read: twice the streamed tail
    rows = _rows(_stream_summary(st))
    assert rows["transfer"] == ("ok: 300 bytes in 4 descriptors over 2 read(s); streamed read "
                                "(from before the forward) 2500.0 ms, of which NIXL 250.0 ms "
                                "(slowest rank)")
    assert rows["last layer -> KV"] == (
        "streamed 750.00 ms, non-streamed 1500.00 ms (2.0x shorter streamed) (prefill's last layer "
        "published -> complete KV at decode, slowest rank)")
    assert rows["layer 0"] == ("published at 500.0 ms into the forward, landed +250.00 ms after "
                               "its publish")
    assert rows["layer 1"] == ("published at 1000.0 ms into the forward, landed +500.00 ms after "
                               "its publish")
    st = _stream_state()
    st["transfers"][0]["plain"] = {"ok": False, "seconds": 0.25, "bytes": 0, "error": "timeout"}
    assert _rows(_stream_summary(st))["last layer -> KV"].startswith(
        "streamed 750.00 ms, non-streamed n/a (prefill's last layer")


def _two_prefill_ranks() -> tuple[DemoConfig, dict]:
    cfg = DemoConfig(stream=True, prefill_tp=2, model=ModelConfig(num_layers=2))
    st = _stream_state()
    st["prefill_ranks"][1] = {"forward_start": 9.75, "published": [10.25, 11.125], "seconds": 1.5}
    return cfg, st


def test_stream_summary_takes_the_earliest_start_and_the_latest_publish_of_the_prefill_ranks():
    cfg, st = _two_prefill_ranks()
    s = _summary(cfg, st.pop("transfers"), **st)["stream"]
    assert s["prefill_forward_seconds"] == 1.5
    assert s["streamed"]["tail_seconds"] == 0.625  # 11.75 - rank 1's 11.125
    assert s["layers"] == [{"layer": 0, "published_seconds": 0.75, "landed_seconds": 1.0,
                            "after_publish_seconds": 0.25},
                           {"layer": 1, "published_seconds": 1.375, "landed_seconds": 1.75,
                            "after_publish_seconds": 0.375}]


def test_stream_summary_is_incomplete_without_every_prefill_ranks_layers():
    cfg, st = _two_prefill_ranks()
    del st["prefill_ranks"][1]
    assert _summary(cfg, st.pop("transfers"), **st)["stream"] is None
    cfg, st = _two_prefill_ranks()
    st["prefill_ranks"][1]["published"] = [10.25]  # one of two layers
    assert _summary(cfg, st.pop("transfers"), **st)["stream"] is None


def test_print_reject_prints_every_reason_then_the_refusal():
    cfg = DemoConfig(decode_head_size=32)
    buf = io.StringIO()
    print_reject(Console(file=buf, width=400, color_system=None), cfg, precheck(cfg)[1])
    assert buf.getvalue().splitlines() == [
        "prefill: TP=1 (1 process), triton HND, block 16, 8 KV head(s)/rank, float32",
        "decode:  TP=2 (2 processes), triton HND, block 16, 4 KV head(s)/rank, float32",
        "fkv refuses this pairing: 1 reason",
        "  - remote.spec.head_size (head_size): head sizes differ (local 32, remote 64)",
        "    fix: both engines must serve the same model (same head_size)",
        "Reject: no process was started, no byte moved (exit code 3)"]


# -- verify ----------------------------------------------------------------------------------------

def test_compare_kv_tolerance_is_relative_to_the_reference():
    # want 1.0, received 1.75: |diff| 0.75 > rtol 0.5 * |reference| (though <= 0.5 * |received|).
    ref = np.ones((1, 1, 2, 1, 1), np.float32)
    got = ref.copy()
    got[0, 0, 1, 0, 0] = 1.75
    assert compare_kv(ref, got, (0, 1), 0.5, 0.0) == (
        0.75, "KV after transfer differs first at layer 0, token 0, V, head 0, channel 0: "
              "received 1.75, reference 1.0 (1 of 2 values differ)")


def test_compare_kv_never_matches_nan_or_infinity():
    ref = np.ones((1, 1, 2, 1, 1), np.float32)
    ref[0, 0, 0, 0, 0] = np.nan  # a NaN in the reference is not matched by a NaN received
    got = ref.copy()
    worst, msg = compare_kv(ref, got, (0, 1), 1e-4, 1e-4)
    assert worst == float("inf") and msg == (
        "KV after transfer differs first at layer 0, token 0, K, head 0, channel 0: received nan, "
        "reference nan (1 of 2 values differ)")
    got = np.full((1, 1, 2, 1, 1), np.inf, np.float32)  # no finite difference at all
    worst, msg = compare_kv(np.ones_like(got), got, (0, 1), 1e-4, 1e-4)
    assert worst == float("inf")
    assert msg.endswith("received inf, reference 1.0 (2 of 2 values differ)")


def test_compare_run_logits_tolerance_is_relative_to_the_reference():
    # bfloat16: |diff| 0.5625 > 0.05 + 0.05 * 10 (though <= 0.05 + 0.05 * 10.5625).
    ref = [np.array([10.0, 0.0], np.float32)]
    v = compare_run([0], ref, [0], [np.array([10.5625, 0.0], np.float32)], _KV_OK, "bfloat16", 8)
    assert (v["ok"], v["logits_ok"]) == (False, False)
    assert v["first_divergence"] == (
        "step 0 (position 7, prefill): logits differ by up to 0.562 (token 0: 10.5625 vs reference "
        "10; tolerance rtol=0.05, atol=0.05)")


def test_compare_run_never_matches_nan_logits_and_counts_extra_steps():
    nan = [np.array([np.nan, 1.0], np.float32)]
    v = compare_run([1], nan, [1], [x.copy() for x in nan], _KV_OK, "float32", 8)
    assert (v["ok"], v["logits_ok"], v["logits_max_abs_diff"]) == (False, False, float("inf"))
    # One logits step more than the reference has: not the reference's logits.
    v = compare_run([1, 0], _LOGITS[:2], [1, 0], _LOGITS, _KV_OK, "float32", 8)
    assert (v["ok"], v["logits_ok"], v["tokens_identical"]) == (False, False, True)


# -- run: the verdict, the exit status, the JSON file ---------------------------------------------

def test_verdict_orders_the_steps_by_number_not_by_arrival():
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    state["steps"] = dict(reversed(state["steps"].items()))
    state["ref_steps"] = dict(reversed(state["ref_steps"].items()))
    v = _verdict(cfg, state)
    assert (state["tokens"], state["ref_tokens"], v["ok"]) == ([5, 7, 1], [5, 7, 1], True)


def test_verdict_checks_16_bit_kv_at_the_16_bit_tolerance():
    cfg = DemoConfig(tokens=3, new_tokens=3, dtype="bfloat16")
    state = _state(cfg)
    state["kv"][1][1][0, 0, 0, 0, 0] += 1e-3  # within 5e-2 + 5e-2 * 1.0
    v = _verdict(cfg, state)
    assert (v["ok"], v["kv_max_abs_diff"], v["rtol"]) == (True, 0.0010000467300415039, 5e-2)


def test_verdict_names_a_missing_reference_kv():
    # The reference rank sent no KV (it failed): not "received KV from 2 of 2 decode ranks".
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    del state["ref_kv"]
    v = _verdict(cfg, state)
    assert (v["ok"], v["kv_ok"], v["kv_max_abs_diff"]) == (False, False, float("inf"))
    assert v["first_divergence"] == "the reference sent no KV"


def test_run_demo_reports_a_failed_rank_once_with_its_log(monkeypatch):
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    # decode 1 reported its error, then exited 1; prefill 1 exited 9 without a word.
    state["errors"] = [{"role": "decode", "rank": 1, "error": "boom", "log": None}]
    code, out = _fake_run(monkeypatch, cfg, state, [("decode", 1, 1), ("prefill", 1, 9)])
    assert code == 1
    assert [ln.split("│")[2].strip() for ln in out.splitlines() if ln.startswith("│ error ")] == [
        "decode rank 1: boom", "prefill rank 1: exited with code 9"]
    assert " prefill rank 1 log (tail) " in out and "│ prefill1 log" in out


def test_run_demo_refuses_a_pairing_with_exit_3_before_any_process(monkeypatch, tmp_path):
    def no_children(*args):
        raise AssertionError("a process was started")

    monkeypatch.setattr(demo_run, "_Children", no_children)
    monkeypatch.setattr(demo_run, "Collector", no_children)
    path = tmp_path / "refused.json"
    buf = io.StringIO()
    cfg = DemoConfig(decode_head_size=32)
    code = run_demo(cfg, console=Console(file=buf, width=400, color_system=None),
                    json_path=str(path))
    assert code == 3
    assert buf.getvalue().splitlines()[-1] == (
        "Reject: no process was started, no byte moved (exit code 3)")
    s = json.loads(path.read_text())
    assert (s["exit_code"], s["handshake"]["decision"]) == (3, "reject")
    assert path.read_text().endswith("}\n")


def test_run_demo_writes_the_printed_summary_as_json(monkeypatch, tmp_path):
    cfg = DemoConfig(tokens=3, new_tokens=3)
    path = tmp_path / "demo.json"
    monkeypatch.setattr(demo_run, "Collector", _NoCollector)
    waits = []

    class Children:
        def __init__(self, *args) -> None:
            pass

        def wait(self, timeout_s: float) -> None:
            waits.append(timeout_s)

        def failed(self) -> list:
            return []

        def stop(self) -> None:
            pass

    monkeypatch.setattr(demo_run, "_Children", Children)
    monkeypatch.setattr(demo_run, "_drive", lambda cfg, ch, co, con, into: into.update(_state(cfg)))
    code = run_demo(cfg, console=Console(file=io.StringIO()), json_path=str(path))
    s = json.loads(path.read_text())
    assert code == 0 and s["exit_code"] == 0 and s["verification"]["ok"] is True
    assert s["tokens"] == {"prompt": 3, "new": 3, "generated": [5, 7, 1], "reference": [5, 7, 1]}
    assert waits == [30.0]  # the ranks that reported their exit get to finish tearing down
    bad = _state(cfg)
    bad["errors"] = [{"role": "decode", "rank": 0, "error": "boom", "log": None}]
    monkeypatch.setattr(demo_run, "_drive", lambda cfg, ch, co, con, into: into.update(bad))
    assert run_demo(cfg, console=Console(file=io.StringIO()), json_path=None) == 1
    assert waits == [30.0]  # not after a failure: the others are stopped at once


# -- run: the parent's event loop and its children ---------------------------------------------------

class _World:
    """The ranks of a run, scripted: ``failed()`` (called once per turn of the parent's loop) sends
    the next pending event once the last one was received, so what the parent has seen when it
    tells a rank something is fixed, and returns ``failures`` once every event is in; ``tell``
    may queue the ranks' answers. ``log`` is the sequence of events sent and messages told."""

    def __init__(self, collector: Collector, pending: list, on_tell=None) -> None:
        self.collector, self.pending, self.on_tell = collector, list(pending), on_tell
        self.rep = Reporter(collector.address, "reference", 0)
        self.sent = self.received = 0
        self.log: list = []
        self.started: list = []
        self.failures: list = []
        real_poll = collector.poll

        def poll(timeout_s: float) -> list:
            events = real_poll(timeout_s)
            self.received += len(events)
            return events
        collector.poll = poll

    def start(self, role: str, rank: int) -> None:
        self.started.append((role, rank))

    def tell(self, role: str, rank: int, message: dict) -> None:
        self.log.append(("tell", role, rank, message))
        if self.on_tell:
            self.pending += self.on_tell(role, rank, message)

    def failed(self) -> list:
        if self.pending and self.received == self.sent:
            role, rank, kind, fields = self.pending.pop(0)
            self.rep.role, self.rep.rank = role, rank
            self.rep.send(kind, **fields)
            self.sent += 1
            self.log.append(("event", role, rank, kind))
            return []
        return self.failures if self.received == self.sent else []  # once every event is in

    def running(self) -> bool:
        return True

    def log_tail(self, role: str, rank: int) -> str:
        return f"{role}{rank} log"


def _drive_world(cfg: DemoConfig, pending: list, on_tell=None, **world) -> tuple[_World, dict]:
    collector = Collector()
    state = {"transfers": {}, "kv": {}, "steps": {}, "ref_steps": {}, "errors": [],
             "exited_ok": set()}
    try:
        w = _World(collector, pending, on_tell)
        for k, v in world.items():
            setattr(w, k, v)
        try:
            demo_run._drive(cfg, w, collector, Console(file=io.StringIO()), state)
        finally:
            w.rep.close()
    finally:
        collector.close()
    return w, state


def _ev(role: str, rank: int, kind: str, **fields) -> tuple:
    return (role, rank, kind, fields)


_REF = _ref_kv()


def _decode_answer(rank: int) -> list:
    """A decode rank's events once told where to read: its read, its KV, its step, its exit."""
    h = (2 * rank, 2 * rank + 2)
    out = [_ev("decode", rank, "transferred", ok=True, bytes=8),
           _ev("decode", rank, "kv", heads=list(h), kv=pack_array(_REF[:, :, :, h[0]:h[1]]))]
    if rank == 0:
        out.append(_ev("decode", 0, "step", step=1, token=7, logits=pack_array(_LOGITS[1])))
    return out


def test_drive_tells_the_decode_ranks_rank_0s_address_and_token_once_every_prefill_rank_serves():
    cfg = DemoConfig(prefill_tp=2, decode_tp=2, tokens=3, new_tokens=2, timeout=30.0)
    pending = [
        _ev("reference", 0, "prefilled", token=5, logits=pack_array(_LOGITS[0])),
        _ev("reference", 0, "kv", heads=[0, 4], kv=pack_array(_REF)),
        _ev("reference", 0, "step", step=1, token=7, logits=pack_array(_LOGITS[1])),
        _ev("reference", 0, "exit", code=0),
        _ev("prefill", 1, "serving", address="tcp://p1"),
        _ev("prefill", 0, "prefilled", token=5, logits=pack_array(_LOGITS[0]), seconds=0.25),
        _ev("prefill", 1, "prefilled", token=6, logits=pack_array(_LOGITS[2]), seconds=0.5),
        _ev("prefill", 0, "serving", address="tcp://p0")]

    def answer(role, rank, message):
        if rank == 0:
            return _decode_answer(0) + [_ev("decode", 0, "exit", code=0)]
        # Decode rank 1 finishes last: its KV comes after every other rank exited.
        return [_ev("prefill", 0, "exit", code=0), _ev("prefill", 1, "exit", code=0),
                *_decode_answer(1), _ev("decode", 1, "exit", code=0)]

    w, state = _drive_world(cfg, pending, answer)
    assert w.started == [("reference", 0), ("prefill", 0), ("prefill", 1), ("decode", 0),
                         ("decode", 1)]
    told = {"address": "tcp://p0", "first_token": 5}
    assert w.log[7:10] == [("event", "prefill", 0, "serving"), ("tell", "decode", 0, told),
                           ("tell", "decode", 1, told)]
    assert [e for e in w.log if e[0] == "tell"] == [("tell", "decode", 0, told),
                                                    ("tell", "decode", 1, told)]
    assert state["errors"] == [] and len(state["exited_ok"]) == 5
    assert state["prefill"]["token"] == 5 and sorted(state["prefill_ranks"]) == [0, 1]
    assert state["prefill_ranks"][1] == {"forward_start": None, "published": None, "seconds": 0.5}
    assert sorted(state["transfers"]) == [0, 1] and list(state["steps"]) == [1]
    assert {r: heads for r, (heads, _) in state["kv"].items()} == {0: (0, 2), 1: (2, 4)}
    assert np.array_equal(state["ref_kv"], _REF)
    v = _verdict(cfg, state)
    assert (v["ok"], state["tokens"], v["first_divergence"]) == (True, [5, 7], None)


def test_drive_streams_address_first_then_go_once_every_decode_rank_connected_then_the_token():
    cfg = DemoConfig(prefill_tp=2, decode_tp=2, tokens=3, new_tokens=2, timeout=30.0, stream=True)
    pending = [_ev("prefill", 1, "serving", address="tcp://p1"),
               _ev("prefill", 0, "serving", address="tcp://p0")]

    def answer(role, rank, message):
        if role == "decode" and "address" in message:
            return [_ev("decode", rank, "connected")]
        if (role, rank) == ("prefill", 0):
            return [_ev("prefill", 0, "prefilled", token=5, logits=pack_array(_LOGITS[0]))]
        if role == "decode":  # the first token: finish (every rank, to end the loop)
            return [_ev(*who, "exit", code=0) for who in (("reference", 0), ("prefill", 0),
                                                          ("prefill", 1), ("decode", 0),
                                                          ("decode", 1))] if rank == 1 else []
        return []

    w, state = _drive_world(cfg, pending, answer)
    assert w.log == [
        ("event", "prefill", 1, "serving"), ("event", "prefill", 0, "serving"),
        ("tell", "decode", 0, {"address": "tcp://p0"}),
        ("tell", "decode", 1, {"address": "tcp://p0"}),
        ("event", "decode", 0, "connected"), ("event", "decode", 1, "connected"),
        ("tell", "prefill", 0, {"go": True}), ("tell", "prefill", 1, {"go": True}),
        ("event", "prefill", 0, "prefilled"),
        ("tell", "decode", 0, {"first_token": 5}), ("tell", "decode", 1, {"first_token": 5}),
        *[("event", role, rank, "exit") for role, rank in (("reference", 0), ("prefill", 0),
                                                           ("prefill", 1), ("decode", 0),
                                                           ("decode", 1))]]
    assert state["errors"] == []


def test_drive_stops_at_a_ranks_error_event():
    cfg = DemoConfig(decode_tp=1, tokens=3, new_tokens=2, timeout=30.0)
    _, state = _drive_world(cfg, [_ev("prefill", 0, "error", error="RuntimeError: boom"),
                                  _ev("reference", 0, "exit", code=0)])
    assert state["errors"] == [{"role": "prefill", "rank": 0, "error": "RuntimeError: boom",
                                "log": None}]


def test_drive_stops_at_a_child_that_exited_without_a_word():
    cfg = DemoConfig(decode_tp=1, tokens=3, new_tokens=2, timeout=30.0)
    _, state = _drive_world(cfg, [_ev("reference", 0, "exit", code=0)],
                            failures=[("reference", 0, 1), ("prefill", 0, -11)])
    # A rank that reported its exit is not counted again.
    assert state["errors"] == [{"role": "prefill", "rank": 0, "error": "exited with code -11",
                                "log": "prefill0 log"}]


def test_drive_names_its_timeout_and_a_process_that_exited_without_reporting():
    cfg = DemoConfig(decode_tp=1, tokens=3, new_tokens=2, timeout=0.25)
    _, state = _drive_world(cfg, [])
    assert state["errors"] == [{"role": "demo", "rank": 0, "error": "timed out after 0.25 s"}]
    cfg = DemoConfig(decode_tp=1, tokens=3, new_tokens=2, timeout=30.0)
    _, state = _drive_world(cfg, [], running=lambda: False)
    assert state["errors"] == [{"role": "demo", "rank": 0,
                                "error": "a process exited without reporting"}]


class _Popen:
    def __init__(self, argv, **kwargs) -> None:
        self.argv, self.kwargs, self.returncode, self.stdin = argv, kwargs, None, None

    def poll(self):
        return self.returncode


def test_children_run_the_worker_with_nixl_moving_the_bytes_unless_told(monkeypatch, tmp_path):
    import subprocess
    import sys

    monkeypatch.setattr(demo_run.subprocess, "Popen", _Popen)
    monkeypatch.delenv("FKV_CMA", raising=False)
    cfg = DemoConfig(decode_tp=1)
    ch = demo_run._Children(cfg, "tcp://parent", str(tmp_path))
    for role in ("reference", "prefill", "decode"):
        ch.start(role, 0)
    p = ch.procs[("decode", 0)]
    assert p.argv == [sys.executable, "-m", "fkv.demo.worker", "decode", "0", "tcp://parent",
                      str(tmp_path), cfg.to_json()]
    assert p.kwargs["env"]["FKV_CMA"] == "0" and p.kwargs["env"]["TRITON_INTERPRET"] == "1"
    # Only the ranks the parent talks to get a stdin: decode ranks (and prefill ranks --stream).
    assert [ch.procs[(r, 0)].kwargs["stdin"] for r in ("reference", "prefill", "decode")] == [
        subprocess.DEVNULL, subprocess.DEVNULL, subprocess.PIPE]
    ch.procs[("reference", 0)].returncode = 0
    ch.procs[("prefill", 0)].returncode = 3
    assert ch.failed() == [("prefill", 0, 3)] and ch.running()
    stream = demo_run._Children(DemoConfig(stream=True, same_host_copies=True), "tcp://parent",
                                str(tmp_path))
    stream.start("prefill", 0)
    assert stream.procs[("prefill", 0)].kwargs["stdin"] == subprocess.PIPE
    assert "FKV_CMA" not in stream.env


# -- the command line's options ---------------------------------------------------------------

def _main_config(monkeypatch, argv: list[str]) -> tuple[int, list]:
    """``fkv demo ARGV`` with run_demo replaced: the exit code and the (config, json_path) it got."""
    from fkv.cli import main

    got = []
    monkeypatch.setattr(demo_run, "run_demo",
                        lambda cfg, console, json_path: got.append((cfg, json_path)) or 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return main(["demo", *argv]), got


def test_demo_options_reach_the_config(monkeypatch, tmp_path):
    import os

    code, got = _main_config(monkeypatch, [])
    assert (code, got) == (0, [(DemoConfig(), None)])  # the flags' defaults are the config's
    assert os.environ["TRITON_INTERPRET"] == "1"  # before any child imports triton
    path = str(tmp_path / "s.json")
    code, got = _main_config(monkeypatch, [
        "--prefill-tp", "2", "--decode-tp", "4", "--prefill-layout", "NHD", "--decode-layout",
        "HND", "--backend", "flashinfer", "--prefill-block-size", "8", "--decode-block-size",
        "32", "--tokens", "24", "--new-tokens", "3", "--device", "cuda", "--dtype", "bfloat16",
        "--decode-head-size", "32", "--corrupt", "--stream", "--same-host-copies", "--seed", "7",
        "--timeout", "12.5", "--json", path])
    assert (code, got) == (0, [(DemoConfig(
        prefill_tp=2, decode_tp=4, prefill_layout="NHD", decode_layout="HND",
        backend="flashinfer", prefill_block_size=8, decode_block_size=32, tokens=24, new_tokens=3,
        device="cuda", dtype="bfloat16", decode_head_size=32, corrupt=True, stream=True,
        same_host_copies=True, seed=7, timeout=12.5), path)])
    assert os.environ["TRITON_INTERPRET"] == "0"  # CUDA: the kernels compile


def test_demo_refuses_an_mla_backend_and_more_ranks_than_the_models_query_heads(monkeypatch,
                                                                              capsys):
    code, got = _main_config(monkeypatch, ["--backend", "mla"])
    assert (code, got) == (2, [])
    assert "argument --backend: invalid choice: 'mla'" in capsys.readouterr().err
    # 24 and 32 are multiples of the 8 KV heads (the handshake accepts them), but the model's 16
    # query heads do not split into them: a usage error, before any process starts.
    for flag, tp in (("--decode-tp", 32), ("--prefill-tp", 24), ("--decode-tp", 17)):
        code, got = _main_config(monkeypatch, [flag, str(tp)])
        assert (code, got) == (2, [])
        assert " ".join(capsys.readouterr().err.split()) == (
            f"fkv demo: error: argument {flag}: must be at most 16, the demo model's query heads "
            f"(got {tp})")
    code, got = _main_config(monkeypatch, ["--decode-tp", "16", "--prefill-tp", "16"])
    assert code == 0 and [c.decode_tp for c, _ in got] == [16]
