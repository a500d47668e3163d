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
    ("tp=0", "--local: tp=0 must be a positive integer"),
    ("block_size=0", "--local: block_size=0 must be a positive integer"),
    ("layers=0", "--local: layers=0 must be a positive integer"),
    ("num_blocks=0", "--local: num_blocks=0 must be a positive integer"),
    ("layout=", "--local: layout= must have a value (drop the key for its default)"),
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


# -- holes found by mutation in fkv.commands (plan, show, demo, bench) ----------------------------

def test_plan_defaults_of_each_side() -> None:
    from fkv import KVCacheSpec
    from fkv.commands.plan import parse_side
    from fkv.connector.handshake import PROTOCOL_VERSION, EngineDesc

    engine, spec = parse_side("local", "")
    assert engine == EngineDesc(engine_id="decode", tp_size=1, tp_rank=0, total_num_kv_heads=8,
                                model="", model_dtype="", protocol=PROTOCOL_VERSION)
    assert spec == KVCacheSpec(backend="triton", layout="HND", num_blocks=1024, block_size=16,
                               num_kv_heads=8, head_size=128, dtype="bfloat16", num_layers=1,
                               cross_layer=False)
    engine, spec = parse_side("remote", "backend=mla")
    assert (engine.engine_id, engine.total_num_kv_heads) == ("prefill", 1)
    assert (spec.num_kv_heads, spec.head_size) == (1, 576)
    _, spec = parse_side("local", "tp=16,rank=15,heads=8")  # more ranks than heads: one each
    assert spec.num_kv_heads == 1
    engine, _ = parse_side("local", "protocol=7,model=,model_dtype=float16,engine=d3")
    assert (engine.protocol, engine.model, engine.model_dtype, engine.engine_id) == (
        7, "", "float16", "d3")


def test_plan_reads_spaces_case_and_a_trailing_comma() -> None:
    from fkv.commands.plan import parse_side

    engine, spec = parse_side("local", " tp = 2 , rank=1, layout= NHD ,cross-layer=ON,layers=2,")
    assert (engine.tp_size, engine.tp_rank, spec.layout, spec.cross_layer, spec.num_layers) == (
        2, 1, "NHD", True, 2)
    engine, _ = parse_side("local", "model= llama ,engine= d3 ,tp=1")
    assert (engine.model, engine.engine_id) == ("llama", "d3")
    for raw, value in [("1", True), ("true", True), ("yes", True), ("on", True), ("TRUE", True),
                       ("0", False), ("false", False), ("no", False), ("off", False), ("Off", False)]:
        assert parse_side("local", f"cross_layer={raw}")[1].cross_layer is value, raw


def _plan(capsys: pytest.CaptureFixture, *argv: str) -> list[str]:
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    return out.out.splitlines()


def test_plan_prints_a_single_reason_in_full(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--local", "tp=2,rank=1,dtype=float16", "--remote", "tp=1"]) == 3
    assert capsys.readouterr().out == (
        "Reject: 1 reason\n"
        "  - remote.spec.dtype (cache_dtype): cache dtypes differ; local 'float16', remote "
        "'bfloat16'\n"
        "    fix: use the same kv-cache dtype on both engines\n")


def test_plan_example_request_is_bounded_by_both_caches(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # no title broken over two lines

    def title(*argv: str) -> str:
        return next(ln for ln in _plan(capsys, *argv) if ln.startswith("example request"))

    d, p = "tp=2,rank=1", "tp=1"
    assert title("--local", d, "--remote", p) == (
        "example request: 64 tokens, remote blocks 0..3 -> local blocks 0..3: 8 rows, 131072 B")
    assert title("--local", d, "--remote", p + ",num_blocks=2") == (  # the remote cache's 2 blocks
        "example request: 32 tokens, remote blocks 0..1 -> local blocks 0..1: 4 rows, 65536 B")
    assert title("--local", d + ",num_blocks=1", "--remote", p) == (  # the local cache's 1 block
        "example request: 16 tokens, remote blocks 0..0 -> local blocks 0..0: 2 rows, 32768 B")
    assert title("--local", d + ",block_size=32", "--remote", p, "--blocks", "1") == (
        "example request: 16 tokens, remote blocks 0..0 -> local blocks 0..0: 8 rows, 32768 B")


def test_plan_prints_rows_as_asked(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    argv = ("--local", "tp=2,rank=1", "--remote", "tp=1", "--blocks", "2")  # 4 rows

    def table(rows: str) -> tuple[list[list[str]], list[str]]:
        lines = _plan(capsys, *argv, "--rows", rows)
        body = [ln.strip("│ ").split() for ln in lines if ln.startswith("│")]
        return body, [ln for ln in lines if ln.startswith("...")]

    rows, caption = table("4")
    assert [" ".join(r) for r in rows] == [
        "0 │ 0 │ 16384 │ 0 │ 0 │ 16384", "0 │ 0 │ 49152 │ 0 │ 16384 │ 16384",
        "0 │ 0 │ 81920 │ 0 │ 32768 │ 16384", "0 │ 0 │ 114688 │ 0 │ 49152 │ 16384"]
    assert caption == []
    rows, caption = table("1")
    assert len(rows) == 1 and caption == ["... 3 more rows"]
    rows, caption = table("0")
    assert rows == [] and caption == ["... 4 more rows"]
    assert _error(capsys, ["plan", *argv, "--rows", "-1"]) == (
        "error: --blocks must be >= 1 and --rows >= 0 (got 2, -1)")


def test_plan_strategy_is_passed_to_the_handshake(capsys: pytest.CaptureFixture) -> None:
    lines = _plan(capsys, "--local", "tp=2,rank=1", "--remote", "tp=1", "--strategy", "staging",
                  "--blocks", "1", "--rows", "0")
    assert any(ln.startswith("strategy staging: ") for ln in lines)
    assert lines[-1] == ("move: staging[0] (+0 B) layer 0 heads (4, 8) -> local heads (0, 4), "
                         "16 tokens")


def _show(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
          *argv: str) -> tuple[str, dict[str, str], list[str]]:
    """``fkv show ARGV``: its spec line, its info rows and the labels of its pattern table."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["show", *argv]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    lines = out.out.splitlines()
    cells = [[c.strip() for c in ln.strip("│").split("│")] for ln in lines if ln.startswith("│")]
    info = {c[0]: c[1] for c in cells[:8]}
    return lines[0], info, [c[0] for c in cells[8:]]


def test_show_defaults_and_every_row(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    line, _, labels = _show(monkeypatch, capsys)
    assert line == ("KVCacheSpec(backend='triton', layout='NHD', num_blocks=32768, block_size=16, "
                    "num_kv_heads=8, head_size=128, dtype='bfloat16')")
    assert labels == ["triton NHD + layers", "triton HND", "triton HND + layers", "flashinfer NHD",
                      "flashinfer NHD + layers", "flashinfer HND", "flashinfer HND + layers",
                      "flash_attn NHD", "flash_attn NHD + layers", "flash_attn HND",
                      "flash_attn HND + layers"]
    line, info, labels = _show(monkeypatch, capsys, "--layout", "HND", "--blocks", "4", "--layers",
                               "2", "--cross-layer", "--dtype", "float32")
    assert line == ("KVCacheSpec(backend='triton', layout='HND', num_blocks=4, block_size=16, "
                    "num_kv_heads=8, head_size=128, dtype='float32', num_layers=2, cross_layer=True)")
    assert info == {"logical axes": "B two N H C", "logical shape": "(4, 2, 16, 8, 128)",
                    "stride order": "(1, 2, 4, 0, 3, 5)", "physical axes": "B two H L N C",
                    "physical shape": "(4, 2, 8, 2, 16, 128)",
                    "strides (elements)": "(65536, 32768, 128, 4096, 1)",
                    "page bytes": "131,072", "regions": "1 × 1,048,576 B"}
    assert labels[:3] == ["triton NHD", "triton NHD + layers", "triton HND"]
    assert "triton HND + layers" not in labels and len(labels) == 11
    _, info, labels = _show(monkeypatch, capsys, "--backend", "mla", "--heads", "1",
                            "--head-size", "8", "--blocks", "2")
    assert (info["logical axes"], info["regions"], labels) == ("B N C", "1 × 512 B", ["mla + layers"])


@pytest.mark.parametrize("flag", ["--blocks", "--block-size", "--heads", "--head-size", "--layers"])
def test_show_refuses_counts_below_one(flag: str, capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, ["show", flag, "0"]) == (
        f"fkv show: error: argument {flag}: must be a positive integer (got 0)")


def test_show_reports_a_bad_spec_on_stderr(capsys: pytest.CaptureFixture) -> None:
    assert _error(capsys, ["show", "--layout", "NDH"]).startswith(
        "error: 'layout' must be in ('NHD', 'HND') or an alias in (")
    assert _error(capsys, ["show", "--backend", "mla"]) == (
        "error: 'num_kv_heads' must be 1 for backend 'mla' (one latent vector per token) (got 8); "
        "pass num_kv_heads=1 and the latent width (e.g. 576) as head_size")


@pytest.fixture
def demo_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """``fkv demo`` with ``run_demo`` replaced: records ``(cfg, json_path, TRITON_INTERPRET)``."""
    import os

    from fkv.demo import run as demo_run

    seen: list[tuple] = []

    def fake(cfg, *, console, json_path):
        seen.append((cfg, json_path, os.environ.get("TRITON_INTERPRET")))
        return 7

    monkeypatch.setattr(demo_run, "run_demo", fake)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return seen


def test_demo_defaults_reach_the_run(demo_runs: list[tuple]) -> None:
    from fkv.demo.config import DemoConfig

    assert main(["demo"]) == 7
    assert demo_runs == [(DemoConfig(
        prefill_tp=1, decode_tp=2, prefill_layout="HND", decode_layout="HND", backend="triton",
        prefill_block_size=16, decode_block_size=16, tokens=64, new_tokens=16, device="cpu",
        dtype="float32", decode_head_size=None, corrupt=False, seed=0, timeout=600.0,
        stream=False, same_host_copies=False), None, "1")]


def test_demo_passes_every_flag_to_the_run(tmp_path: Path, demo_runs: list[tuple]) -> None:
    from fkv.demo.config import DemoConfig

    path = str(tmp_path / "s.json")
    assert main(["demo", "--prefill-tp", "2", "--decode-tp", "4", "--prefill-layout", "NHD",
                 "--decode-layout", "LBHNC", "--backend", "flashinfer", "--prefill-block-size", "8",
                 "--decode-block-size", "32", "--tokens", "40", "--new-tokens", "3", "--device",
                 "cuda", "--dtype", "bfloat16", "--decode-head-size", "32", "--corrupt", "--stream",
                 "--same-host-copies", "--seed", "5", "--timeout", "12.5", "--json", path]) == 7
    assert demo_runs == [(DemoConfig(
        prefill_tp=2, decode_tp=4, prefill_layout="NHD", decode_layout="LBHNC",
        backend="flashinfer", prefill_block_size=8, decode_block_size=32, tokens=40, new_tokens=3,
        device="cuda", dtype="bfloat16", decode_head_size=32, corrupt=True, seed=5, timeout=12.5,
        stream=True, same_host_copies=True), path, None)]  # cuda: no interpreter


def test_demo_checks_the_prefill_layout_too(capsys: pytest.CaptureFixture,
                                            demo_runs: list[tuple]) -> None:
    assert main(["demo", "--prefill-layout", "NDH"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and " ".join(out.err.split()) == (
        "fkv demo: error: 'layout' must be in ('NHD', 'HND') or an alias in ('NHD', 'HND', "
        "'LBNHC', 'LBHNC', 'LHBNC', 'BLNHC', 'BLHNC', 'BHLNC') (got 'NDH')")
    assert demo_runs == []


def test_bench_runs_the_named_benchmark_with_the_rest_of_the_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from fkv import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = next(a for a in sub.choices["bench"]._actions if a.dest == "name").choices
    assert sorted(names) == ["attention", "convert", "plan", "report", "transfer", "write"]
    for name in names:  # every choice is a benchmark module with a main
        assert callable(importlib.import_module(f"fkv.bench.{name}").main)
    from fkv.bench import write

    seen = []
    monkeypatch.setattr(write, "main", lambda argv: seen.append(argv) or 5)
    assert main(["bench", "write", "--cpu-smoke", "--reps", "1"]) == 5
    monkeypatch.setattr(write, "main", lambda argv: seen.append(argv))
    assert main(["bench", "write"]) == 0
    assert seen == [["--cpu-smoke", "--reps", "1"], []]
