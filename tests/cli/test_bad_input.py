"""Every kind of bad input in tests/cli/cases.py, through the real `eyas` command in its own process: the
expected exit status, one line naming the problem (no traceback), and every file the user had left as it was."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter

import pytest

from tests.cli.cases import CASES, Case
from tests.cli.harness import REPO, debris, snapshot


def _argv(case: Case, t, assets) -> list[str]:
    names = {k: str(v) for k, v in assets.items()}
    return [a.format(t=t, **names) for a in case.argv]


def _check(case: Case, t, before, result) -> None:
    err = result.stderr
    assert result.status == case.status, f"exit {result.status}, expected {case.status}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert re.search(case.match, last), f"the last stderr line does not match {case.match!r}:\n{last}"
    after = snapshot(t)
    assert {k: v for k, v in after.items() if k in before} == before, "a file the user had changed or went missing"
    assert not debris(t), debris(t)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, eyas, assets, tmp_path):
    if case.setup:
        case.setup(tmp_path, assets)
    before = snapshot(tmp_path)
    _check(case, tmp_path, before, eyas.run(_argv(case, tmp_path, assets), tmp_path, case.env))


def test_kinds_are_distinct():
    assert len({c.id for c in CASES}) == len(CASES) >= 100
    assert len({(c.argv, c.match) for c in CASES}) == len(CASES)  # no case repeats another's command and check


# The fork server shares only imports; the console script itself must answer the same (a sample across commands).
SAMPLE = ["no-command", "generate-max-new-tokens-0", "export-out-holds-user-files", "train-config-a-list",
          "prepare-source-empty"]


@pytest.mark.parametrize("name", SAMPLE)
def test_console_script_answers_the_same(name, eyas, assets, tmp_path):
    case = next(c for c in CASES if c.id == name)
    for sub in ("fork", "script"):
        (tmp_path / sub).mkdir()
        if case.setup:
            case.setup(tmp_path / sub, assets)
    fork = eyas.run(_argv(case, tmp_path / "fork", assets), tmp_path / "fork")
    before = snapshot(tmp_path / "script")
    script = subprocess.run([str(REPO / ".venv" / "bin" / "eyas") if (REPO / ".venv/bin/eyas").exists()
                             else shutil.which("eyas"), *_argv(case, tmp_path / "script", assets)],
                            cwd=tmp_path / "script", capture_output=True, text=True, timeout=300)
    script.status = script.returncode
    _check(case, tmp_path / "script", before, script)
    assert (fork.status, fork.stderr.splitlines()[-1].replace("/fork", "")) == (
        script.returncode, script.stderr.splitlines()[-1].replace("/script", ""))


def _commands(parser=None, prefix=()) -> list[tuple[str, ...]]:
    """Every command `eyas` offers, as its words (("generate",), ("data", "prepare"), ...), from the real parser."""
    from eyas.inference.cli import build_parser

    parser = parser or build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix]
    return [c for name, sub in subs[0].choices.items() for c in _commands(sub, (*prefix, name))]


MIN_CASES = 3  # per command (chat has the fewest): a command added without its bad inputs fails here
RANGE = re.compile(r"at least \d|>= ?\d|> ?0|\(0, 1|\[0, 1|non-negative")  # how a message states the valid values


def test_totals():
    """Every command has its share of the corpus (printed with -s, for the record), every out-of-range value's
    message names the setting and its valid range (the problem and the fix), and no message regex is so loose
    that a line naming nothing would pass."""
    commands = _commands()
    per = Counter(next((" ".join(c) for c in commands if case.argv[:len(c)] == c), "(none)") for case in CASES)
    print(f"\n{len(CASES)} kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(per.items())))
    assert {" ".join(c): per[" ".join(c)] for c in commands if per[" ".join(c)] < MIN_CASES} == {}
    out_of_range = [c for c in CASES if c.id.endswith(("-0", "-negative"))]
    assert out_of_range  # the ids keep their convention, so the loop below checks something
    for case in out_of_range:  # the setting is the last one on its command line: `--opt value` or `key=value`
        setting = case.argv[-2] if case.argv[-2].startswith("--") else case.argv[-1].split("=")[0]
        plain = case.match.replace("\\", "")
        assert setting in plain and RANGE.search(case.match), (case.id, case.match)
    vague = ["eyas generate: error: invalid input", "eyas data: error: something went wrong", "error", ""]
    assert [c.id for c in CASES if any(re.search(c.match, line) for line in vague)] == []


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_of_an_expected_error(how, eyas, assets, tmp_path):
    argv = ["--debug"] * (how == "flag") + ["export", str(tmp_path / "nohead"), "--out", str(tmp_path / "out")]
    result = eyas.run(argv, tmp_path, {"EYAS_DEBUG": "1"} if how == "env" else None)
    assert result.status == 2 and "Traceback" in result.stderr and "MissingInput" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("eyas export: error: ") and "nohead is neither" in result.stderr
