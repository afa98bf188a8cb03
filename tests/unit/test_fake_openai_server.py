"""The loopback OpenAI fake is itself a contract: integration tests script planner replies with it and
Celery workers in other processes call it through ``base_url``."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.fakes.openai_server import FakeOpenAIServer, error, ok


def post(base_url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(text: str) -> dict[str, Any]:
    return {"model": "planner", "messages": [{"role": "user", "content": text}]}


def reply_text(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["message"]["content"])


def test_script_is_fifo_then_reply_function_then_echo() -> None:
    with FakeOpenAIServer() as srv:
        srv.script(ok("first"), error(503, "busy"))
        assert reply_text(post(srv.base_url, chat("a"))[1]) == "first"
        status, body = post(srv.base_url, chat("b"))
        assert (status, body["error"]["message"]) == (503, "busy")
        assert reply_text(post(srv.base_url, chat("c"))[1]) == "echo: c"

        srv.reply_with(lambda body: f"planned: {body['messages'][-1]['content']}")
        assert reply_text(post(srv.base_url, chat("d"))[1]) == "planned: d"
        assert [b["messages"][0]["content"] for b in srv.bodies] == ["a", "b", "c", "d"]
        assert srv.pending == 0


def test_unknown_path_is_a_404_in_openai_format() -> None:
    with FakeOpenAIServer() as srv:
        request = urllib.request.Request(f"{srv.base_url}/embeddings", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=5)
        assert info.value.code == 404
        assert "error" in json.loads(info.value.read())


def test_concurrent_callers_are_each_answered_and_recorded() -> None:
    with FakeOpenAIServer(reply=lambda body: body["messages"][0]["content"].upper()) as srv:
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda i: reply_text(post(srv.base_url, chat(f"m{i}"))[1]), range(32)))
        assert results == [f"M{i}" for i in range(32)]
        assert len(srv.requests) == 32


def test_another_process_can_call_it_through_base_url() -> None:
    code = (
        "import json, sys, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1] + '/chat/completions', method='POST',\n"
        "    data=json.dumps({'model': 'p', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode(),\n"
        "    headers={'content-type': 'application/json'})\n"
        "reply = json.loads(urllib.request.urlopen(req, timeout=5).read())\n"
        "print(reply['choices'][0]['message']['content'])\n"
    )
    with FakeOpenAIServer(reply=lambda body: '{"steps": []}') as srv:
        out = subprocess.run(
            [sys.executable, "-c", code, srv.base_url], capture_output=True, text=True, timeout=10, check=True
        )
        assert out.stdout.strip() == '{"steps": []}'
        assert srv.wait_for_requests(1)[0].body["messages"][0]["content"] == "hi"
