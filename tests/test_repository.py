"""The repository stands alone: no tracked file points to a file outside it (a sibling folder, a
document that only exists on the authors' machines, an absolute path of a checkout)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match itself.
_OUTSIDE = re.compile("|".join([
    r"\.\./" + "shared",                                   # the authors' sibling folder
    r"(?:^|[\s\"'`(=:])/" + "work/",                       # absolute paths of a checkout
    r"(?:^|[\s\"'`(=:])/" + r"(?:home|Users|root|tmp)/[\w.-]+/",
]))
_MD_NAME = re.compile(r"(?<![\w/.-])([\w.-]+\.md)\b")
_MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                         check=True).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:4096]:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def test_no_tracked_file_references_a_path_outside_the_repository() -> None:
    files = _tracked()
    md_names = {p.name for p in files if p.suffix == ".md"}
    problems = []
    for path in files:
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT)
        for n, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE.search(line):
                problems.append(f"{rel}:{n}: a path outside the repository: {line.strip()[:100]}")
            for name in _MD_NAME.findall(line):
                if name not in md_names:
                    problems.append(f"{rel}:{n}: {name} is not a file of the repository")
            if path.suffix == ".md":
                for target in _MD_LINK.findall(re.sub(r"`[^`]*`", "", line)):
                    if re.match(r"[a-z]+:", target):
                        continue                           # http:, https:, mailto:
                    resolved = (path.parent / target).resolve()
                    if not resolved.is_relative_to(ROOT) or not resolved.exists():
                        problems.append(f"{rel}:{n}: link to {target}, not in the repository")
    assert not problems, "\n".join(problems)


_COMMANDS = (["show"], ["plan"], ["demo"], *(["bench", name] for name in
                                            ("write", "convert", "attention", "transfer", "plan",
                                             "report")))


def _help(argv: list[str]) -> str:
    """What ``fkv ARGV --help`` prints (the benchmarks' own parsers for ``bench NAME``)."""
    import contextlib
    import importlib
    import io

    from fkv.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        if argv[0] == "bench":
            importlib.import_module(f"fkv.bench.{argv[1]}").main(["--help"])
        else:
            build_parser().parse_args([*argv, "--help"])
    return out.getvalue()


def test_every_flag_of_every_command_is_in_the_cli_doc(monkeypatch) -> None:
    """docs/cli.md lists each flag ``--help`` knows, so a new flag cannot go undocumented."""
    monkeypatch.setenv("COLUMNS", "1000")  # no flag broken over two lines
    doc = (ROOT / "docs" / "cli.md").read_text()
    missing = []
    for argv in _COMMANDS:
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", _help(argv))) - {"--help"}
        assert flags, argv  # the help was printed
        missing += [f"fkv {' '.join(argv)} {flag}" for flag in sorted(flags)
                    if f"`{flag}" not in doc]
    assert not missing, f"flags missing from docs/cli.md: {missing}"
