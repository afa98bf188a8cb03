"""The CLI refuses bad values where it parses them (exit 2, a usage line) instead of handing them on: a
bad --loglevel crashed the supervised worker's child at start, and it was restarted for ever; Flower took
--port 70000 modulo 65536."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.cli import _parser


@pytest.mark.parametrize("argv", [
    ["worker", "--loglevel", "bogus"],
    ["worker", "--concurrency", "-3"],
    ["worker", "--concurrency", "0"],
    ["beat", "--loglevel", "bogus"],
    ["serve", "--port", "70000"],
    ["serve", "--port", "0"],
    ["flower", "--port", "70000"],
    ["planner", "serve", "--port", "70000"],
    ["webhooks", "secret", "--tenant", "t", "--rotate", "--keep-previous-hours", "721"],
    ["webhooks", "secret", "--tenant", "t", "--rotate", "--keep-previous-hours", "nan"],
])
def test_bad_values_are_refused_at_parse_time(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _parser().parse_args(argv)
    assert stopped.value.code == 2
    assert f"argument {argv[-2]}" in capsys.readouterr().err  # the option before the bad value


def test_good_values_pass() -> None:
    args = _parser().parse_args(["worker", "--loglevel", "WARNING", "--concurrency", "1000"])
    assert (args.loglevel, args.concurrency) == ("warning", 1000)
    assert _parser().parse_args(["flower", "--port", "65535"]).port == 65535


@pytest.mark.parametrize("argv", [["status", "some-job"], ["--help"], ["worker", "--help"]])
def test_a_bad_setting_is_one_line_naming_the_variable_not_a_traceback(argv: list[str], tmp_path: Path) -> None:
    """The parser reads settings for its defaults, outside the handlers' error handling: a bad setting
    (even with --help) was a pydantic traceback, and a mistyped secrets key's message carries no value."""
    env = {**os.environ, "CONDUCTOR_MAX_STEPS": "100", "CONDUCTOR_SECRETS_KEY": "whsec-not-a-fernet-key"}
    env.pop("CONDUCTOR_DEBUG", None)
    done = subprocess.run([sys.executable, "-c", "import sys; from conductor.cli import main; sys.exit(main())", *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("conductor: invalid setting: ")
    assert "CONDUCTOR_MAX_STEPS: Input should be less than or equal to 50" in lines[0]
    assert "CONDUCTOR_SECRETS_KEY: " in lines[0]
    assert "whsec-not-a-fernet-key" not in done.stderr


def test_conductor_reconcile_fails_on_every_error_a_pass_reports() -> None:
    """`conductor reconcile` exits 1 on the problems it knows: a failing metrics fold was not one of them
    (it exited 0 while every scrape read the history's rows)."""
    import re

    import conductor.reconcile
    from conductor.cli import RECONCILE_PROBLEMS

    source = Path(conductor.reconcile.__file__).read_text()
    flagged = set(re.findall(r'report\["(\w+)"\] = True', source))
    assert "metrics_rollup_error" in flagged
    assert flagged <= set(RECONCILE_PROBLEMS)
