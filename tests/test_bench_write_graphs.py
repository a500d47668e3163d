"""``fkv bench write``'s graph figures: the engine-style baseline writes the reference's bytes,
and the primed decode graphs (``primed_decode``, run in a child process) are checked, timed and
reported, or their failure is named in the result.

The child's success path needs CUDA (``gpu``); its failure path and the parent's parsing run on
the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fkv
from fkv.bench import write
from fkv.bench._engine_style import engine_style_call
from fkv.ops import reference

SMALL = write.Shape(num_blocks=64, block_size=16, heads=2, head_size=32, prefill=(48,), decode=16)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_engine_style_baseline_writes_the_reference_bytes_and_skips_padding(
        layout: str, device: str) -> None:
    spec = fkv.KVCacheSpec(layout=layout, num_blocks=8, block_size=4, num_kv_heads=2,
                           head_size=16, dtype="bfloat16")
    g = torch.Generator().manual_seed(5)
    key = torch.randn(6, 2, 16, generator=g).bfloat16().to(device)
    value = torch.randn(6, 2, 16, generator=g).bfloat16().to(device)
    slots = torch.tensor([3, 17, -1, 30, 4, 9], device=device)
    (ours,) = fkv.allocate(spec, device=device)
    ours.view(torch.int16).copy_(torch.randint(-100, 100, ours.shape, generator=g,
                                               dtype=torch.int16).to(device))
    start, ref = ours.clone(), ours.clone()
    engine_style_call(spec, ours, key, value, slots, {})()
    reference.write_kv(key, value, ref, slots, spec, validate=False)
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))
    assert int((ours.view(torch.int16) != start.view(torch.int16)).sum()) == 5 * 2 * 2 * 16


def _decode_cases() -> list[write.Case]:
    return [write.Case("decode", 16, "NHD", "bfloat16"), write.Case("prefill", 48, "NHD",
                                                                     "bfloat16"),
            write.Case("decode", 16, "HND", "float8_e4m3fn")]


@pytest.mark.interpreter  # the failure path needs a machine without CUDA
def test_without_cuda_the_primed_child_fails_and_each_decode_case_names_why() -> None:
    cases = _decode_cases()
    write._run_primed(cases, SMALL, rep=1)
    for case in (cases[0], cases[2]):
        assert case.extra["primed_error"].startswith("child exited 1: ")
        assert case.extra["primed_error"].endswith(
            "fkv.errors.FkvError: graph_primer: needs a CUDA device "
            "(torch.cuda.is_available() is False)")
        assert "graph_per_call_primed_us" not in case.extra
    assert cases[1].extra == {}  # prefill cases are not primed


def test_the_primed_figures_of_the_child_land_in_each_decode_case(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[list[str]] = []
    answer = {"decode 16 NHD bfloat16": {"graph_per_call_primed_us": 2.1,
                                          "engine_graph_per_call_primed_us": 2.4,
                                          "primed_rounds_us": [2.1, 2.0, 2.2],
                                          "engine_primed_rounds_us": [2.4, 2.4, 2.5]},
              "decode 16 HND float8_e4m3fn": {"graph_per_call_primed_us": 2.15,
                                               "engine_graph_per_call_primed_us": 2.6,
                                               "primed_rounds_us": [2.15, 2.1, 2.2],
                                               "engine_primed_rounds_us": [2.6, 2.6, 2.6]}}

    def child(args: list[str], **kw: object) -> subprocess.CompletedProcess:
        sent.append(args)
        return subprocess.CompletedProcess(args, 0, "compiling\nPRIMED " + json.dumps(answer)
                                           + "\n", "")

    monkeypatch.setattr(subprocess, "run", child)
    cases = _decode_cases()
    write._run_primed(cases, SMALL, rep=7)
    assert cases[0].extra == answer["decode 16 NHD bfloat16"]
    assert cases[2].extra == answer["decode 16 HND float8_e4m3fn"]
    assert cases[1].extra == {}
    (args,) = sent
    assert args[:2] == [sys.executable, "-c"]
    request = json.loads(eval(args[2].split("_primed_child(", 1)[1][:-1]))  # the repr'd JSON
    assert request == {"names": ["decode 16 NHD bfloat16", "decode 16 HND float8_e4m3fn"],
                       "shape": {"num_blocks": 64, "block_size": 16, "heads": 2,
                                 "head_size": 32, "prefill": [48], "decode": 16},
                       "rep": 7}


def test_a_child_that_prints_no_answer_is_an_error_not_a_figure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: subprocess.CompletedProcess(
        args, 0, "PRIMEDX {}\n", "warning: one\nwarning: two\n"))
    cases = _decode_cases()
    write._run_primed(cases, SMALL, rep=1)
    assert cases[0].extra == {"primed_error": "child exited 0: warning: one | warning: two"}


@pytest.mark.gpu
def test_primed_decode_graphs_are_checked_and_timed_on_the_gpu() -> None:
    names = ["decode 16 NHD bfloat16", "decode 16 HND float8_e4m3fn"]
    out = write.primed_decode(names, SMALL, rep=5)
    assert sorted(out) == sorted(names)
    for figures in out.values():
        assert len(figures["primed_rounds_us"]) == len(figures["engine_primed_rounds_us"]) == 3
        assert 0 < figures["graph_per_call_primed_us"] < 100
        assert 0 < figures["engine_graph_per_call_primed_us"] < 100


@pytest.mark.gpu
def test_a_primed_graph_that_writes_one_wrong_element_stops_the_bench(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import fkv.ops

    real = fkv.ops.write_kv

    def one_key_element_off(key, value, cache, slots, spec, **kw):  # type: ignore[no-untyped-def]
        wrong = key.clone()  # (a poisoned cache element may be NaN, where + 1 changes no bit)
        wrong[0, 0, 0] += 1
        real(wrong, value, cache, slots, spec, **kw)

    monkeypatch.setattr(fkv.ops, "write_kv", one_key_element_off)
    # one element per call; a later call that writes the same slot can hide an earlier one's
    with pytest.raises(SystemExit, match=r"^MISMATCH: the primed write_kv graph differs from "
                                         r"fkv\.ops\.reference\.write_kv in "
                                         r"([1-9]|[12][0-9]|3[0-2]) elements "
                                         r"\(decode 16 NHD bfloat16\)$"):
        write.primed_decode(["decode 16 NHD bfloat16"], SMALL, rep=5)


def test_wrong_bytes_in_the_primed_child_stop_the_bench_with_its_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    line = ("MISMATCH: the primed write_kv graph differs from fkv.ops.reference.write_kv in 3 "
            "elements (decode 16 NHD bfloat16)")
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: subprocess.CompletedProcess(
        args, 1, "", f"Traceback (most recent call last):\n{line}\n"))
    with pytest.raises(SystemExit) as stopped:
        write._run_primed(_decode_cases(), SMALL, rep=1)
    assert stopped.value.code == line


def test_a_primed_child_that_never_answers_is_named_timed_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def hang(args: list[str], **kw: object) -> subprocess.CompletedProcess:
        raise subprocess.TimeoutExpired(args, kw["timeout"])  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess, "run", hang)
    cases = _decode_cases()
    write._run_primed(cases, SMALL, rep=1)
    assert cases[0].extra == {"primed_error": "child timed out: no answer in 900 s"}
