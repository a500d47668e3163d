"""The ``fkv`` command line refuses bad flag values: one error naming the flag and the value,
exit status 2, before any work starts and without touching a file; never a traceback, never a
value silently replaced by a default."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fkv import FkvError
from fkv.bench import results
from fkv.cli import main

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = sorted((ROOT / "tests" / "data").glob("sample-*.json"))
DOC = "# x\n<!-- fkv-report:tests -->\nkept\n<!-- /fkv-report -->\n"


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run ``fkv ARGV`` in this process: it must exit 2 and print nothing on stdout; returns
    the last line of stderr (argparse prints its usage above it)."""
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "Traceback" not in out.err
    return out.err.strip().splitlines()[-1]


# -- fkv bench report --------------------------------------------------------------------------------

@pytest.fixture
def doc(tmp_path: Path) -> Path:
    path = tmp_path / "README.md"
    path.write_text(DOC)
    return path


@pytest.fixture
def sample_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    for p in SAMPLES:
        shutil.copy(p, folder / p.name)
    return folder


def test_report_refuses_a_missing_or_non_folder_results(
        tmp_path: Path, doc: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nonexistent"
    assert _error(capsys, ["bench", "report", "--results", str(missing), "--docs", str(doc)]) == (
        f"fkv bench report: error: argument --results: must be an existing folder "
        f"(got '{missing}': no such folder)")
    assert _error(capsys, ["bench", "report", "--results", str(doc), "--docs", str(doc)]) == (
        f"fkv bench report: error: argument --results: must be an existing folder "
        f"(got '{doc}': a file)")
    assert doc.read_text() == DOC  # the tables were not blanked


def test_report_refuses_a_folder_without_result_files(
        tmp_path: Path, doc: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _error(capsys, ["bench", "report", "--results", str(empty), "--docs", str(doc)]) == (
        f"fkv bench report: error: --results '{empty}' holds no result files (*.json); the "
        f"tables would all say 'no committed result yet'")
    smoke = results.Run("write", env={}, config={"mode": "cpu-smoke"})
    smoke.add("prefill 16 NHD float32", metrics={"gbps": 1.0})
    results.write(smoke, results_dir=empty)
    assert _error(capsys, ["bench", "report", "--results", str(empty), "--docs", str(doc)]) == (
        f"fkv bench report: error: --results '{empty}' holds only --cpu-smoke runs, whose "
        f"timings mean nothing; the tables would all say 'no committed result yet'")
    assert doc.read_text() == DOC


def test_report_refuses_a_json_that_is_not_a_result_file(
        sample_dir: Path, doc: Path, capsys: pytest.CaptureFixture) -> None:
    other = sample_dir / "zz-other.json"
    other.write_text(json.dumps({"name": "not fkv"}))
    assert _error(capsys, ["bench", "report", "--results", str(sample_dir), "--docs", str(doc)]) == (
        f"fkv bench report: error: --results '{sample_dir}': {other}: 'schema' must be "
        f"'fkv.bench/1' (got None); fkv reads only its own result files, version 1")
    other.write_text("not json {")
    line = _error(capsys, ["bench", "report", "--results", str(sample_dir), "--docs", str(doc)])
    assert line.startswith(f"fkv bench report: error: --results '{sample_dir}': {other}: not JSON (")
    assert doc.read_text() == DOC


def test_report_refuses_missing_documents_and_nothing_to_do(
        tmp_path: Path, sample_dir: Path, doc: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nonexistent-doc.txt"
    assert _error(capsys, ["bench", "report", "--check", "--docs", str(missing)]) == (
        f"fkv bench report: error: argument --docs: must be an existing file "
        f"(got '{missing}': no such file)")
    assert _error(capsys, ["bench", "report", "--results", str(sample_dir), "--docs"]) == (
        "fkv bench report: error: --docs names no document and --plots no folder: nothing to do")
    bad = tmp_path / "bad-doc.txt"
    bad.write_text("<!-- fkv-report:nope -->\n<!-- /fkv-report -->\n")
    line = _error(capsys, ["bench", "report", "--results", str(sample_dir), "--docs", str(doc),
                           str(bad)])
    assert line.startswith(f"fkv bench report: error: --docs: {bad}: '<!-- fkv-report:nope -->' "
                           f"must name one of ")
    assert doc.read_text() == DOC  # nothing written when any document is refused
    assert _error(capsys, ["bench", "report", "--results", str(sample_dir), "--docs", str(doc),
                           "--plots", str(doc)]) == (
        f"fkv bench report: error: argument --plots: must be a folder (got '{doc}': a file)")


def test_report_refuses_missing_default_results_and_documents(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Without --results / --docs the checkout's bench/results, README.md and bench/NOTES.md
    are used: when they are not there, a usage error names them (nothing is written)."""
    from fkv.bench import report

    monkeypatch.setattr(report.results, "_repo_root", lambda: tmp_path)
    folder = tmp_path / "bench" / "results"
    assert _error(capsys, ["bench", "report", "--check"]) == (
        f"fkv bench report: error: --results: the default folder '{folder}' does not exist; "
        f"name the folder of result files with --results DIR")
    folder.mkdir(parents=True)
    for p in SAMPLES:
        shutil.copy(p, folder / p.name)
    assert _error(capsys, ["bench", "report"]) == (
        f"fkv bench report: error: --docs: '{tmp_path}/README.md', '{tmp_path}/bench/NOTES.md' "
        f"not found; name the documents with --docs PATH ...")
    assert sorted(p.name for p in tmp_path.rglob("*.md")) == []


def test_report_still_renders_a_good_folder(sample_dir: Path, doc: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "report", "--results", str(sample_dir), "--docs", str(doc)]) == 0
    assert capsys.readouterr().out == f"rewrote {doc}\n"
    assert "| pytest -m gpu | SAMPLE GPU" in doc.read_text()


# -- fkv bench transfer / plan: flag values ------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", "abc"], "argument --sizes: must be a comma list of positive integers (got 'abc')"),
    (["--sizes", "-4"], "argument --sizes: must be a comma list of positive integers (got '-4')"),
    (["--sizes", "1,,2"], "argument --sizes: must be a comma list of positive integers (got '1,,2')"),
    (["--d-gpus", "a,b"],
     "argument --d-gpus: must be a comma list of non-negative integers (got 'a,b')"),
    (["--d-gpus", "1,-1"],
     "argument --d-gpus: must be a comma list of non-negative integers (got '1,-1')"),
    (["--blocks", "0"], "argument --blocks: must be a positive integer (got 0)"),
    (["--request-blocks", "0"], "argument --request-blocks: must be a positive integer (got 0)"),
    (["--reps", "0"], "argument --reps: must be a positive integer (got 0)"),
    (["--layers", "0"], "argument --layers: must be a positive integer (got 0)"),
    (["--p-gpu", "-1"], "argument --p-gpu: must be a non-negative integer (got -1)"),
    (["--compute-ms", "nan"], "argument --compute-ms: must be a finite positive number (got 'nan')"),
    (["--cases", "link,nosuch"],
     "argument --cases: must be a comma list of link, hnd-direct, nhd-staging, nhd-direct, "
     "hnd2nhd-auto, hnd2nhd-direct, hnd-staging, hnd-packed, nhd-packed, hnd-auto, link-packed, "
     "hnd-ipc, nhd-ipc, hnd2nhd-ipc, hnd-ipc-tp1 (got 'link,nosuch': unknown 'nosuch')"),
    (["--sizes", "8192"],
     "argument --sizes: a request of 8192 blocks is larger than the cache (4096 blocks, --blocks)"),
    (["--quick", "--sizes", "16,2048"],
     "argument --sizes: a request of 2048 blocks is larger than the cache (1024 blocks, --blocks)"),
    (["--blocks", "64", "--request-blocks", "65"],
     "argument --request-blocks: a request of 65 blocks is larger than the cache (64 blocks, "
     "--blocks)"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_transfer_refuses_bad_values(args: list[str], message: str,
                                     capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, ["bench", "transfer", "--no-save", *args]) == (
        f"fkv bench transfer: error: {message}")


def test_transfer_help_lists_every_case(capsys: pytest.CaptureFixture) -> None:
    from fkv.bench.transfer import CASE_NAMES

    assert main(["bench", "transfer", "--help"]) == 0
    assert ",".join(CASE_NAMES) in "".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("value", ["0", "-5", "x"])
def test_bench_plan_refuses_a_bad_block_count(value: str, capsys: pytest.CaptureFixture) -> None:
    shown = repr(value) if value == "x" else value
    assert _error(capsys, ["bench", "plan", "--no-save", "--blocks", value]) == (
        f"fkv bench plan: error: argument --blocks: must be a positive integer (got {shown})")


@pytest.mark.parametrize("bench", ["plan", "transfer", "write", "convert", "attention"])
def test_every_bench_checks_its_output_paths_before_it_runs(
        bench: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One rule in fkv.bench.results.add_output_arguments: --json and --plot write into an
    existing folder; --results-dir must be a folder (it is created when missing)."""
    missing = tmp_path / "nonexistent" / "dir"
    prog = f"fkv bench {bench}: error: argument"
    assert _error(capsys, ["bench", bench, "--json", str(missing / "x.json")]) == (
        f"{prog} --json: must be a file in an existing folder (got '{missing}/x.json': "
        f"'{missing}' does not exist)")
    assert _error(capsys, ["bench", bench, "--plot", str(missing / "x.png")]) == (
        f"{prog} --plot: must be a file in an existing folder (got '{missing}/x.png': "
        f"'{missing}' does not exist)")
    assert _error(capsys, ["bench", bench, "--json", str(tmp_path)]) == (
        f"{prog} --json: must be a file to write, not a folder (got '{tmp_path}')")
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert _error(capsys, ["bench", bench, "--results-dir", str(a_file)]) == (
        f"{prog} --results-dir: must be a folder (got '{a_file}': a file)")
    assert _error(capsys, ["bench", bench, "--results-dir", str(a_file / "sub")]) == (
        f"{prog} --results-dir: must be a folder fkv can create (got '{a_file}/sub': "
        f"'{a_file}' is a file)")
    assert not (tmp_path / "nonexistent").exists()


# -- fkv plan ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("local", "message"), [
    ("tp=2,rank=1,head_size=0", "--local: head_size=0 must be a positive integer"),
    ("tp=2,rank=1,kv_heads=0", "--local: kv_heads=0 must be a positive integer"),
    ("tp=2,heads=-8", "--local: heads=-8 must be a positive integer"),
    ("rank=-1", "--local: rank=-1 must be a non-negative integer"),
    ("tp=2,rank=2", "--local: rank=2 must be below tp=2 (ranks 0..1)"),
    ("tp=2,tp=1", "--local: key 'tp' given twice (tp=2, then tp=1); give each key once"),
    ("cross-layer=1,cross_layer=0",
     "--local: key 'cross_layer' given twice (cross-layer=1, then cross_layer=0); give each key once"),
    ("engine=", "--local: engine= must have a value (drop the key for its default)"),
])
def test_plan_refuses_zero_and_repeated_keys(local: str, message: str,
                                             capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, ["plan", "--local", local, "--remote", "tp=1"]) == f"error: {message}"


def test_plan_keeps_a_given_value_and_derives_only_missing_ones(
        capsys: pytest.CaptureFixture) -> None:
    from fkv.commands.plan import parse_side

    _, spec = parse_side("local", "tp=2,rank=1,head_size=64,kv_heads=2")
    assert (spec.head_size, spec.num_kv_heads) == (64, 2)
    engine, spec = parse_side("remote", "tp=1")
    assert (engine.engine_id, spec.head_size, spec.num_kv_heads) == ("prefill", 128, 8)


# -- fkv demo ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_demo_refuses_a_bad_timeout_before_it_starts(value: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, ["demo", "--timeout", value]) == (
        f"fkv demo: error: argument --timeout: must be a finite positive number (got '{value}')")


def test_demo_refuses_a_summary_into_a_missing_folder(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "nonexistent" / "demo.json"
    assert _error(capsys, ["demo", "--json", str(path)]) == (
        f"fkv demo: error: argument --json: must be a file in an existing folder (got '{path}': "
        f"'{path.parent}' does not exist)")


@pytest.mark.parametrize("flag", ["--prefill-tp", "--decode-tp", "--prefill-block-size",
                                  "--decode-block-size", "--tokens", "--new-tokens",
                                  "--decode-head-size"])
def test_demo_refuses_counts_below_one(flag: str, capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, ["demo", flag, "0"]) == (
        f"fkv demo: error: argument {flag}: must be a positive integer (got 0)")


# -- the shared validators and the last resort in main() -------------------------------------------

def test_validators_name_what_they_expect() -> None:
    from fkv.cli import int_list, non_negative_int, positive_float, positive_int

    assert positive_int("3") == 3 and non_negative_int("0") == 0 and positive_float("0.5") == 0.5
    assert int_list(0)("1, 0") == [1, 0]
    for parse, text, message in (
            (positive_int, "1.5", "must be a positive integer (got '1.5')"),
            (non_negative_int, "-1", "must be a non-negative integer (got -1)"),
            (positive_float, "-0.0", "must be a finite positive number (got '-0.0')"),
            (int_list(1), "", "must be a comma list of positive integers (got '')")):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            parse(text)
        assert str(e.value) == message


def test_an_fkv_error_a_command_leaves_is_a_one_line_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import fkv.commands.show as show

    def boom(args: argparse.Namespace) -> int:
        raise FkvError("'blocks' must be a positive int (got 0)")

    monkeypatch.setattr(show, "run", boom)
    assert _error(capsys, ["show"]) == "fkv show: error: 'blocks' must be a positive int (got 0)"


def test_bad_values_exit_2_from_a_shell_without_a_traceback(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "fkv", "bench", "plan", "--blocks", "0"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines()[-1] == (
        "fkv bench plan: error: argument --blocks: must be a positive integer (got 0)")


# -- holes found by mutation (2026-12-04) ----------------------------------------------------------

def test_non_negative_float_takes_zero_and_names_what_it_expects() -> None:
    from fkv.cli import non_negative_float

    assert non_negative_float("0") == 0.0 and non_negative_float("2.5") == 2.5
    for text in ("-1", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            non_negative_float(text)
        assert str(e.value) == f"must be a finite number >= 0 (got {text!r})"


def test_path_validators_say_what_the_path_is(tmp_path: Path) -> None:
    from fkv.cli import existing_file, existing_folder, output_file, output_folder

    a_file = tmp_path / "f"
    a_file.write_text("")
    assert existing_file(str(a_file)) == a_file and existing_folder(str(tmp_path)) == tmp_path
    for parse, text, message in (
            (existing_file, str(tmp_path), f"must be an existing file (got '{tmp_path}': a folder)"),
            (output_file, f"{a_file}/x.json",
             f"must be a file in an existing folder (got '{a_file}/x.json': '{a_file}' is a file)"),
            (output_folder, "", "must be a folder (got '')")):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            parse(text)
        assert str(e.value) == message


def test_output_paths_must_be_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked with os.access (root passes any mode bits, so it is faked here)."""
    import os

    from fkv.cli import output_file, output_folder

    asked = []

    def access(path, mode) -> bool:
        asked.append((Path(path), mode))
        return False

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(argparse.ArgumentTypeError) as e:
        output_file(str(tmp_path / "x.json"))
    assert str(e.value) == (f"must be a file in a folder this user can write (got "
                            f"'{tmp_path}/x.json': folder '{tmp_path}' is not writable)")
    with pytest.raises(argparse.ArgumentTypeError) as e:
        output_folder(str(tmp_path / "new" / "sub"))
    assert str(e.value) == (f"must be a folder this user can write (got '{tmp_path}/new/sub': "
                            f"'{tmp_path}' is not writable)")
    assert asked == [(tmp_path, os.W_OK | os.X_OK)] * 2


def test_main_exit_codes_for_help_no_command_and_a_message_exit(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import fkv.commands.show as show

    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: fkv ")
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("usage: fkv ")

    def mismatch(args: argparse.Namespace) -> int:
        raise SystemExit("MISMATCH: kernel differs from the reference")

    monkeypatch.setattr(show, "run", mismatch)
    assert main(["show"]) == 1
    assert capsys.readouterr().err == "MISMATCH: kernel differs from the reference\n"
    monkeypatch.setattr(show, "run", lambda args: (_ for _ in ()).throw(SystemExit(3)))
    assert main(["show"]) == 3


def test_build_parser_skips_only_a_missing_command_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command module that is absent is left out; one whose own import fails (a missing
    dependency) is an error, never a silently missing command."""
    import importlib

    from fkv import cli

    real = importlib.import_module

    def without(missing: str):
        def fake(name: str, *args):
            if name == "fkv.commands.demo":
                raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
            return real(name, *args)
        return fake

    monkeypatch.setattr(importlib, "import_module", without("fkv.commands.demo"))
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == ["bench", "plan", "show"]
    monkeypatch.setattr(importlib, "import_module", without("zmq"))
    with pytest.raises(ModuleNotFoundError) as e:
        cli.build_parser()
    assert e.value.name == "zmq"
