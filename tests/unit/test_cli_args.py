"""The CLI refuses bad values where it parses them (exit 2, a usage line) instead of handing them on: a
bad --loglevel crashed the supervised worker's child at start, and it was restarted for ever; Flower took
--port 70000 modulo 65536."""

from __future__ import annotations

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
