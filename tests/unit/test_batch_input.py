"""Batch input files: what refuses a whole file (with its line) and what fails one line only."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from conductor.batches import BatchFileError, InputLine, LineError, line_job, parse_input
from conductor.settings import Settings

SETTINGS = Settings(batch_max_lines=3, batch_max_file_bytes=2048, max_body_bytes=1024)


def jsonl(*items: Any) -> bytes:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items).encode()


def test_lines_keep_their_numbers_and_blank_lines_are_skipped() -> None:
    lines = parse_input(jsonl({"custom_id": "a"}, "", {"custom_id": "b"}), SETTINGS)
    assert [(x.line, x.custom_id) for x in lines] == [(1, "a"), (3, "b")]


def test_lines_end_at_newlines_only() -> None:
    # U+2028/U+2029/U+0085 may stand unescaped in a JSON string (JSON.stringify, ensure_ascii=False);
    # str.splitlines cut such a line in two. CRLF and CR line ends are line ends.
    task = "first\u2028second\u2029third\u0085fourth"
    content = (json.dumps({"custom_id": "a", "body": {"task": task}}, ensure_ascii=False) + "\r\n"
               + json.dumps({"custom_id": "b"}) + "\r" + json.dumps({"custom_id": "c"}) + "\n").encode()
    lines = parse_input(content, SETTINGS)
    assert [(x.line, x.custom_id) for x in lines] == [(1, "a"), (2, "b"), (3, "c")]
    assert lines[0].request["body"]["task"] == task


def test_a_line_nested_past_the_parsers_recursion_limit_is_refused_with_its_line() -> None:
    deep = '{"custom_id": "b", "body": ' + "[" * 50_000 + "]" * 50_000 + "}"
    with pytest.raises(BatchFileError) as refused:
        parse_input(jsonl({"custom_id": "a"}, deep), Settings(batch_max_file_bytes=1_000_000))
    assert refused.value.code == "invalid_json" and refused.value.line == 2


@pytest.mark.parametrize(
    ("content", "code", "line"),
    [
        (jsonl({"custom_id": "a"}, {"custom_id": "b"}, {"custom_id": "a"}), "duplicate_custom_id", 3),
        (jsonl({"custom_id": "a"}, "{nope"), "invalid_json", 2),
        (jsonl({"custom_id": "a"}, '{"custom_id": "b", "x": NaN}'), "invalid_json", 2),
        (jsonl([1, 2]), "invalid_json", 1),
        (jsonl({"custom_id": ""}), "invalid_custom_id", 1),
        (jsonl({"custom_id": 7}), "invalid_custom_id", 1),
        (jsonl({"custom_id": "a\u0000"}), "invalid_custom_id", 1),
        (jsonl(*({"custom_id": str(n)} for n in range(4))), "too_many_requests", 4),
        (b"\n\n", "empty_file", None),
        (b"\xff\xfe", "invalid_encoding", None),
        (b"x" * 2049, "file_too_large", None),
    ],
)
def test_files_refused_whole(content: bytes, code: str, line: int | None) -> None:
    with pytest.raises(BatchFileError) as refused:
        parse_input(content, SETTINGS)
    assert refused.value.code == code and refused.value.line == line
    if line is not None:
        assert str(refused.value).startswith(f"line {line}:")


def item(**request: Any) -> InputLine:
    return InputLine(line=5, custom_id="x", request={"custom_id": "x", **request})


GOOD_CHAT = {"model": "conductor/template:pev",
             "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]}


def test_a_chat_line_becomes_a_job_with_context() -> None:
    made = line_job(item(method="POST", url="/v1/chat/completions", body=GOOD_CHAT), "/v1/chat/completions",
                    SETTINGS)
    assert made.body.task == "why?" and made.body.planner == "template:pev"
    assert made.context == [{"role": "system", "content": "be brief"}]


def test_a_chat_line_with_a_long_message_becomes_a_job() -> None:
    question = "Explain each step of the derivation. " * 20  # 740 characters, under the 1,024-byte body
    body = {"model": "conductor", "messages": [{"role": "user", "content": question}]}
    made = line_job(item(method="POST", url="/v1/chat/completions", body=body), "/v1/chat/completions", SETTINGS)
    assert made.body.task == question


def test_a_chat_request_is_answered_before_the_openai_sdk_gives_up_and_retries() -> None:
    # The SDK retries a timed-out request (a second job); our 504 after the wait says not to retry.
    assert openai.DEFAULT_TIMEOUT.read is not None
    assert Settings.model_fields["chat_max_wait_s"].default < openai.DEFAULT_TIMEOUT.read


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        ({"method": "GET", "url": "/v1/chat/completions", "body": GOOD_CHAT}, "invalid_method"),
        ({"method": "POST", "url": "/v1/jobs", "body": GOOD_CHAT}, "invalid_url"),
        ({"method": "POST", "url": "/v1/chat/completions", "body": "hi"}, "invalid_body"),
        ({"method": "POST", "url": "/v1/chat/completions", "body": {**GOOD_CHAT, "stream": True}}, "invalid_body"),
        ({"method": "POST", "url": "/v1/chat/completions", "body": {**GOOD_CHAT, "tools": [{"type": "function"}]}},
         "invalid_body"),
        ({"method": "POST", "url": "/v1/chat/completions", "body": {**GOOD_CHAT, "model": "gpt-5"}},
         "model_not_found"),
        ({"method": "POST", "url": "/v1/chat/completions", "body": {"model": "conductor", "messages": [
            {"role": "user", "content": "x" * 2000}]}}, "body_too_large"),
        ({"method": "POST", "url": "/v1/chat/completions", "body": GOOD_CHAT, "extra": 1}, "invalid_request"),
    ],
)
def test_lines_that_fail_alone(request_: dict[str, Any], code: str) -> None:
    with pytest.raises(LineError) as failed:
        line_job(item(**request_), "/v1/chat/completions", SETTINGS)
    assert failed.value.code == code


def test_a_byte_order_mark_is_not_part_of_the_first_line() -> None:
    # Windows tools save UTF-8 with a BOM; line 1 was refused as invalid JSON (the CLI read it fine)
    [line] = parse_input(b"\xef\xbb\xbf" + jsonl({"custom_id": "a", "method": "POST"}), SETTINGS)
    assert (line.line, line.custom_id) == (1, "a")


def test_a_bodys_size_is_its_utf8_bytes_as_on_the_live_route() -> None:
    settings = Settings(max_body_bytes=3000)
    # 600 emoji: 2,400 bytes of UTF-8, but 7,200 characters once JSON-escaped (it was refused as too large)
    body = {"model": "conductor", "messages": [{"role": "user", "content": "\U0001f600" * 600}]}
    assert line_job(item(method="POST", url="/v1/chat/completions", body=body), "/v1/chat/completions", settings)
    too_big = {"model": "conductor", "messages": [{"role": "user", "content": "\U0001f600" * 800}]}
    with pytest.raises(LineError) as failed:
        line_job(item(method="POST", url="/v1/chat/completions", body=too_big), "/v1/chat/completions", settings)
    assert failed.value.code == "body_too_large"


def test_a_body_with_an_unpaired_surrogate_fails_its_line_alone() -> None:
    # JSON admits "\ud800"; measuring the body's UTF-8 size raised UnicodeEncodeError, failing the whole batch
    [line] = parse_input(b'{"custom_id": "s", "method": "POST", "url": "/v1/jobs", "body": {"task": "a\\ud800"}}',
                         SETTINGS)
    with pytest.raises(LineError) as failed:
        line_job(line, "/v1/jobs", SETTINGS)
    assert failed.value.code == "invalid_body" and "unicode" in str(failed.value).lower()


def test_a_bad_byte_after_a_byte_order_mark_is_named_where_it_is() -> None:
    with pytest.raises(BatchFileError, match=r"byte 6\)"):
        parse_input(b"\xef\xbb\xbf{\"a\xff", SETTINGS)
