"""Prompt caching on request (Anthropic): where a step's messages end a prefix another step of its job on the
same agent sends (``context.cache_points``), how those points become ``cache_control`` markers, and what
the cache's reads and writes cost. The loopback server models Anthropic's cache by its documented rules, so
a later call reads only what an earlier call's markers wrote."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from conductor.budget import Spent, allowed_output_tokens, step_reservation
from conductor.context import PlannedStep, cache_points, cache_scope, worker_messages
from conductor.pool.anthropic_provider import AnthropicProvider
from conductor.pool.base import CallOptions, Completion, Message
from conductor.pool.chat_turns import to_conversation
from conductor.pool.config import AgentConfig, PoolConfig, Price
from conductor.pool.errors import ConfigError
from conductor.pool.registry import build_provider, caches_for_an_hour, caches_on_request
from conductor.settings import Settings
from tests.fakes.anthropic_server import AnthropicReply, FakeAnthropicServer, _blocks
from tests.fakes.http_base import RecordedRequest, count_words

KEY_ENV = "CONDUCTOR_TEST_ANTHROPIC_KEY"
TASK = "Summarise the findings of the three attached studies on sleep and memory for a general reader."
PEV = [[], [0], [0, 1]]  # plan, execute (sees the plan), verify (sees both)
ANSWERS = ["Plan: read each study, list its finding, then compare them in plain words.",
           "The studies agree that sleep after learning helps memory, most of all deep sleep.",
           "Verified: the summary matches the plan and the studies."]


def points_of(index: int, lists: list[list[int]], inherited: int = 0, agents: str = "",
              reused: tuple[int, ...] = ()) -> tuple[int, ...]:
    workflow = [PlannedStep(agents[i] if agents else "c", access, i in reused) for i, access in enumerate(lists)]
    return cache_points(index, workflow, inherited=inherited)


def test_each_step_marks_the_prefixes_it_shares_with_a_step_before_or_after_it() -> None:
    # 0 is the system message; after k shared steps the prefix ends at message 2k
    assert [points_of(i, PEV) for i in range(3)] == [(0,), (0, 2), (0, 2)]
    # three proposers and an aggregator: the proposers share the system message with the aggregator, and
    # run together: the first writes it for the aggregator, the others would pay for the same write
    moa = [[], [], [], [0, 1, 2]]
    assert [points_of(i, moa) for i in range(4)] == [(0,), (), (), (0,)]
    # a child job's inherited context is part of every prefix; access lists count in step order
    assert points_of(2, [[], [], [1, 0], [0, 1, 2]], inherited=3) == (3, 7)


def test_a_prefix_shared_only_with_steps_that_may_run_at_the_same_time_is_not_marked() -> None:
    # the published 3-layer MoA: the four second-layer proposers all see the four first answers, and run
    # together; none can read what another writes, so their long shared prefix is not marked (each would pay
    # the write price for nothing); each marks the system message, which the aggregator after them sends
    moa = [[], [], [], [], *[[0, 1, 2, 3]] * 4, [4, 5, 6, 7]]
    assert [points_of(i, moa) for i in range(9)] == [(0,), (), (), (), (0,), (0,), (0,), (0,), (0,)]
    # two steps that see nothing, nor each other: nothing to mark
    assert points_of(0, [[], []]) == ()


def test_a_step_leaves_a_write_to_a_step_beside_it_that_writes_more_for_the_same_later_step() -> None:
    # 2 (sees 0) and 3 (sees 0, 1) run together; 4 (sees 0-3) reads what 3 writes, which covers what 2
    # would write for it: 2 marks only the system message, which it reads (0 wrote it)
    lists = [[], [], [0], [0, 1], [0, 1, 2, 3]]
    assert points_of(2, lists, agents="cdccc") == (0,)
    assert points_of(3, lists, agents="cdccc") == (0, 4)
    assert points_of(4, lists, agents="cdccc") == (0, 2, 4)


def test_a_replay_reads_what_its_reused_steps_share_and_writes_what_they_no_longer_do() -> None:
    # a replay from step 1 of [[], [], [0, 1]]: step 0 is reused (it ran in the original job) and does not
    # run here, so step 1 writes the system message for step 2 instead of leaving it to step 0
    lists = [[], [], [0, 1]]
    assert points_of(1, lists) == ()  # when step 0 runs too, it writes it
    assert points_of(1, lists, reused=(0,)) == (0,)
    assert points_of(2, lists, reused=(0,)) == (0,)  # it reads it (and the original's write, if fresh)


def test_a_step_before_another_through_a_step_on_another_agent_still_counts() -> None:
    # 0 (agent c) -> 1 (agent d) -> 2 (agent c): 2 sees only 1, yet runs after 0, so both mark the system
    assert points_of(0, [[], [0], [1]], agents="cdc") == (0,)
    assert points_of(2, [[], [0], [1]], agents="cdc") == (0,)
    # and the step on the other agent marks nothing: no other step of its agent
    assert points_of(1, [[], [0], [1]], agents="cdc") == ()


def test_a_step_no_other_step_shares_with_marks_nothing_and_at_most_four_points_are_kept() -> None:
    assert points_of(1, [[], [0]], agents="cd") == ()
    chain = [[], [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert points_of(5, chain) == (2, 4, 6, 8)  # the longest four of 0, 2, 4, 6, 8


def test_a_point_is_kept_only_where_a_turn_or_the_system_text_ends() -> None:
    plain = [Message("system", "S"), Message("user", "u0"), Message("assistant", "a0"), Message("user", "u1")]
    conversation = to_conversation(plain)
    assert [conversation.ending_at(p, plain) for p in range(4)] == [-1, 0, 1, 2]
    # an earlier step that answered nothing: its subtask merges with the next user turn, no prefix ends there
    blank = [Message("system", "S"), Message("user", "u0"), Message("assistant", " "), Message("user", "u1")]
    assert to_conversation(blank).ending_at(2, blank) is None
    # inherited context ending with a user turn merges with the first subtask
    inherited = [Message("system", "S"), Message("user", "ctx"), Message("user", "u0")]
    assert to_conversation(inherited).ending_at(1, inherited) is None
    # a system message further on joins the system text: the system prefix is not what it would be alone
    late = [Message("system", "S"), Message("user", "u0"), Message("system", "T"), Message("user", "u1")]
    assert to_conversation(late).ending_at(0, late) is None


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAnthropicServer]:
    monkeypatch.setenv(KEY_ENV, "sk-ant-test")
    with FakeAnthropicServer(prompt_cache_min_tokens=10) as srv:
        yield srv


def claude(srv: FakeAnthropicServer, **options: object) -> AnthropicProvider:
    config = AgentConfig.model_validate({"provider": "anthropic", "model": "claude-test", "base_url": srv.base_url,
                                         "api_key_env": KEY_ENV, "options": options})
    provider = build_provider("claude", config)
    assert isinstance(provider, AnthropicProvider)
    return provider


def run_pev(provider: AnthropicProvider) -> list[Completion]:
    """The three steps of a pev workflow one after another, each with its messages and points."""
    completions = []
    for i, access in enumerate(PEV):
        visible = [(f"subtask {d}", ANSWERS[d]) for d in access]
        messages = worker_messages(task=TASK, visible=visible, instruction=f"subtask {i}")
        completions.append(provider.complete(messages, CallOptions(cache_points=points_of(i, PEV))))
    return completions


def test_of_parallel_steps_one_writes_what_a_later_step_reads(server: FakeAnthropicServer) -> None:
    # MoA 3+1 with a long task: the proposers run together (writes held until all three were sent), the
    # aggregator after them
    long_task = TASK + " Background: " + "sleep " * 40
    moa = [[], [], [], [0, 1, 2]]
    provider = claude(server)

    def call(i: int) -> Completion:
        visible = [(f"subtask {d}", ANSWERS[0]) for d in moa[i]]
        messages = worker_messages(task=long_task, visible=visible, instruction=f"subtask {i}")
        return provider.complete(messages, CallOptions(cache_points=points_of(i, moa)))

    with server.held_writes():
        proposers = [call(i) for i in range(3)]
    aggregator = call(3)

    system = words(worker_messages(task=long_task, visible=[], instruction="x")[0].content)
    assert [(c.cached_input_tokens, c.cache_write_tokens) for c in proposers] == [(0, system), (0, 0), (0, 0)]
    assert (aggregator.cached_input_tokens, aggregator.cache_write_tokens) == (system, 0)


def words(*texts: str) -> int:
    return sum(count_words(t) for t in texts)


def test_a_later_step_reads_the_prefix_an_earlier_step_wrote(server: FakeAnthropicServer) -> None:
    plan, execute, verify = run_pev(claude(server))

    system = words(worker_messages(task=TASK, visible=[], instruction="x")[0].content)
    turn0 = words("subtask 0", ANSWERS[0])
    # the plan writes the system prefix; execute reads it and writes the plan's turn after it; verify reads both
    assert (plan.cached_input_tokens, plan.cache_write_tokens) == (0, system)
    assert (execute.cached_input_tokens, execute.cache_write_tokens) == (system, turn0)
    assert (verify.cached_input_tokens, verify.cache_write_tokens) == (system + turn0, 0)
    # input_tokens stays every prompt token
    assert verify.input_tokens == system + turn0 + words("subtask 1", ANSWERS[1], "subtask 2")
    # the markers sit where the points say: the system block, then the plan's answer
    marked = [[text for _, text, mark in _blocks(body) if mark] for body in server.bodies]
    assert marked[0] == [worker_messages(task=TASK, visible=[], instruction="x")[0].content]
    assert marked[1] == marked[2] == [marked[0][0], ANSWERS[0]]


def test_with_prompt_cache_off_nothing_is_marked_or_read(server: FakeAnthropicServer) -> None:
    completions = run_pev(claude(server, prompt_cache=False))

    assert [(c.cached_input_tokens, c.cache_write_tokens) for c in completions] == [(0, 0)] * 3
    assert all(isinstance(m["content"], str) for body in server.bodies for m in body["messages"])
    assert all(isinstance(body["system"], str) for body in server.bodies)


def test_a_call_without_points_sends_plain_strings(server: FakeAnthropicServer) -> None:
    messages = worker_messages(task=TASK, visible=[], instruction="subtask 0")
    claude(server).complete(messages, CallOptions())

    (body,) = server.bodies
    assert isinstance(body["system"], str) and isinstance(body["messages"][0]["content"], str)


def test_the_fake_refuses_more_markers_than_the_api_allows(server: FakeAnthropicServer) -> None:
    # the four-point cap above would pass vacuously if the fake took any number of markers
    block = {"type": "text", "text": "t", "cache_control": {"type": "ephemeral"}}
    body = {"messages": [{"role": "user", "content": [block] * 5}]}
    assert "maximum of 4" in (server.invalid(body) or "")
    assert server.invalid({"messages": [{"role": "user", "content": [block] * 4}]}) is None
    empty = {**block, "text": ""}
    assert "empty text blocks" in (server.invalid({"messages": [{"role": "user", "content": [block, empty]}]}) or "")


def test_the_provider_sends_at_most_four_markers_the_longest(server: FakeAnthropicServer) -> None:
    # five earlier steps seen: six turn ends and the system text could be marked; the API takes four
    visible = [(f"subtask {d}", ANSWERS[d % 3]) for d in range(5)]
    messages = worker_messages(task=TASK, visible=visible, instruction="subtask 5")
    claude(server).complete(messages, CallOptions(cache_points=(0, 2, 4, 6, 8, 10)))

    (body,) = server.bodies
    marked = [text for _, text, mark in _blocks(body) if mark]
    assert marked == [ANSWERS[1], ANSWERS[2], ANSWERS[0], ANSWERS[1]]  # the answers of steps 1 to 4


def test_prompt_cache_is_a_strict_boolean_and_only_anthropic_agents_cache_on_request() -> None:
    with pytest.raises(ConfigError, match="prompt_cache"):
        build_provider("claude", AgentConfig(provider="anthropic", model="m", options={"prompt_cache": "no"}))
    assert caches_on_request(AgentConfig(provider="anthropic", model="m"))
    assert not caches_on_request(AgentConfig(provider="anthropic", model="m", options={"prompt_cache": False}))
    assert not caches_on_request(AgentConfig(provider="openai", model="m"))


def test_cache_writes_cost_their_own_price_by_default_a_quarter_above_the_input() -> None:
    price = Price(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.3)
    # 1,000 prompt tokens: 600 read, 300 written, 100 plain; 10 out
    assert price.cost(1000, 10, 600, 300) == pytest.approx((100 * 3.0 + 300 * 3.75 + 600 * 0.3 + 10 * 15) / 1e6)
    explicit = price.model_copy(update={"cache_write_per_mtok": 6.0})
    assert explicit.cost(1000, 10, 600, 300) == pytest.approx((100 * 3.0 + 300 * 6.0 + 600 * 0.3 + 10 * 15) / 1e6)
    # never more writes and reads than prompt tokens
    assert price.cost(100, 0, 80, 80) == pytest.approx((80 * 0.3 + 20 * 3.75) / 1e6)


def test_an_unset_write_price_stays_out_of_a_pool_snapshot() -> None:
    # a job's pool snapshot is read by every worker of a rolling deploy; an older one refuses unknown keys
    pool = PoolConfig.model_validate({"agents": {"c": {"provider": "anthropic", "model": "m",
                                                       "price": {"input_per_mtok": 3.0}}}})
    assert pool.model_dump()["agents"]["c"]["price"] == {"input_per_mtok": 3.0, "output_per_mtok": 0.0}
    pool.agents["c"].price.cache_write_per_mtok = 3.75
    assert pool.model_dump()["agents"]["c"]["price"]["cache_write_per_mtok"] == 3.75


def test_a_step_that_may_write_the_cache_reserves_that_part_of_its_prompt_at_the_write_price() -> None:
    price = Price(input_per_mtok=4.0, output_per_mtok=8.0)
    limits = {"max_cost_usd": 1.0}
    plain = step_reservation(limits, prompt_tokens=1000, max_tokens=100, price=price)
    writing = step_reservation(limits, prompt_tokens=1000, max_tokens=100, price=price, cache_write_tokens=600)
    assert plain.cost_usd == pytest.approx((1000 * 4.0 + 100 * 8.0) / 1e6)
    assert writing.cost_usd == pytest.approx((400 * 4.0 + 600 * 5.0 + 100 * 8.0) / 1e6)
    # what is left for the output shrinks by the same quarter of the writable part's price
    spent = Spent(tokens=0, cost_usd=0.0)
    tight = {"max_cost_usd": (400 * 4.0 + 600 * 5.0 + 50 * 8.0) / 1e6}
    assert allowed_output_tokens(tight, spent, prompt_tokens=1000, max_tokens=4096, price=price,
                                 cache_write_tokens=600) == 50
    assert allowed_output_tokens(tight, spent, prompt_tokens=1000, max_tokens=4096, price=price) == 125
    # a write price below the input price (a pool's choice) never lowers the bound below plain input
    cheap = Price(input_per_mtok=4.0, output_per_mtok=8.0, cache_write_per_mtok=1.0)
    assert step_reservation(limits, prompt_tokens=1000, max_tokens=100, price=cheap,
                            cache_write_tokens=600).cost_usd == pytest.approx(plain.cost_usd)


def test_an_anthropic_agent_without_a_cached_price_costs_a_read_at_a_tenth_of_the_input() -> None:
    # Anthropic's rate for every Claude model; elsewhere the rate differs by model, so unset stays the input's
    claude = AgentConfig(provider="anthropic", model="m", price=Price(input_per_mtok=3.0))
    assert claude.billing.cached_input_per_mtok == pytest.approx(0.3)
    assert claude.price.cached_input_per_mtok is None  # the pool (and a job's snapshot) unchanged
    set_price = AgentConfig(provider="anthropic", model="m", price=Price(input_per_mtok=3.0, cached_input_per_mtok=1.0))
    assert set_price.billing.cached_input_per_mtok == 1.0
    gpt = AgentConfig(provider="openai", model="m", price=Price(input_per_mtok=3.0))
    assert gpt.billing.cost(1000, 0, 1000) == pytest.approx(3000 / 1e6)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeAnthropicServer, Clock]]:
    monkeypatch.setenv(KEY_ENV, "sk-ant-test")
    clock = Clock()
    with FakeAnthropicServer(prompt_cache_min_tokens=10, clock=clock) as srv:
        yield srv, clock


def run_pev_with_pauses(provider: AnthropicProvider, clock: Clock, pause_s: float) -> list[Completion]:
    """pev's steps, each starting ``pause_s`` after the one before began (the earlier step's run time)."""
    completions = []
    for i, access in enumerate(PEV):
        visible = [(f"subtask {d}", ANSWERS[d]) for d in access]
        messages = worker_messages(task=TASK, visible=visible, instruction=f"subtask {i}")
        completions.append(provider.complete(messages, CallOptions(cache_points=points_of(i, PEV))))
        clock.now += pause_s
    return completions


def test_a_five_minute_cache_is_gone_when_a_step_runs_longer_than_five_minutes(
        timed: tuple[FakeAnthropicServer, Clock]) -> None:
    server, clock = timed
    plan, execute, verify = run_pev_with_pauses(claude(server), clock, pause_s=400)

    system = words(worker_messages(task=TASK, visible=[], instruction="x")[0].content)
    turn0 = words("subtask 0", ANSWERS[0])
    # each step starts 400 s after the one before: nothing the step before wrote is left to read
    assert [(c.cached_input_tokens, c.cache_write_tokens) for c in (plan, execute, verify)] == [
        (0, system), (0, system + turn0), (0, system + turn0)]
    assert [c.cache_write_1h_tokens for c in (plan, execute, verify)] == [0, 0, 0]
    assert all("anthropic-beta" not in r.headers for r in server.requests)
    assert all(mark == "5m" for body in server.bodies for _, _, mark in _blocks(body) if mark)


def test_a_one_hour_cache_outlives_a_long_step_and_asks_for_it_as_the_api_requires(
        timed: tuple[FakeAnthropicServer, Clock]) -> None:
    server, clock = timed
    plan, execute, verify = run_pev_with_pauses(claude(server, prompt_cache_ttl="1h"), clock, pause_s=400)

    system = words(worker_messages(task=TASK, visible=[], instruction="x")[0].content)
    turn0 = words("subtask 0", ANSWERS[0])
    assert [(c.cached_input_tokens, c.cache_write_tokens) for c in (plan, execute, verify)] == [
        (0, system), (system, turn0), (system + turn0, 0)]
    # the usage's split says the writes went to the hour's cache: that is what prices them
    assert [c.cache_write_1h_tokens for c in (plan, execute, verify)] == [system, turn0, 0]
    # every marker asks for the hour, and each request sends the beta header that introduced it
    bodies = server.bodies
    assert [[block["cache_control"] for block in body["system"]] for body in bodies] == [
        [{"type": "ephemeral", "ttl": "1h"}]] * 3
    assert [r.headers.get("anthropic-beta") for r in server.requests] == ["extended-cache-ttl-2025-04-11"] * 3


def test_a_call_with_nothing_to_mark_sends_no_beta_header(timed: tuple[FakeAnthropicServer, Clock]) -> None:
    server, _ = timed
    messages = worker_messages(task=TASK, visible=[], instruction="subtask 0")
    claude(server, prompt_cache_ttl="1h").complete(messages, CallOptions())

    (request,) = server.requests
    assert "anthropic-beta" not in request.headers and isinstance(request.body["system"], str)


def test_the_fakes_cache_lives_as_long_as_asked_renewed_by_each_read(
        timed: tuple[FakeAnthropicServer, Clock]) -> None:
    # the lifetimes the tests above rely on; without the beta header the fake keeps a "1h" mark 5 minutes
    server, clock = timed
    marked = {"type": "text", "text": "word " * 20, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    body = {"system": [marked], "messages": [{"role": "user", "content": "hi"}]}
    plain = RecordedRequest("POST", "/v1/messages", {}, {}, body, b"")
    beta = RecordedRequest("POST", "/v1/messages", {}, {"anthropic-beta": "extended-cache-ttl-2025-04-11"}, body, b"")
    assert server._cached_usage(plain, body)["cache_creation"] == {"ephemeral_5m_input_tokens": 20,
                                                                    "ephemeral_1h_input_tokens": 0}
    clock.now += 400
    assert server._cached_usage(beta, body)["cache_creation"] == {"ephemeral_5m_input_tokens": 0,
                                                                   "ephemeral_1h_input_tokens": 20}
    clock.now += 3000
    assert server._cached_usage(beta, body)["cache_read_input_tokens"] == 20  # read within the hour: renewed
    clock.now += 3000
    assert server._cached_usage(beta, body)["cache_read_input_tokens"] == 20
    clock.now += 3601
    assert server._cached_usage(beta, body)["cache_read_input_tokens"] == 0


def test_the_fake_refuses_a_bad_ttl_and_an_hour_after_five_minutes(server: FakeAnthropicServer) -> None:
    def body(*ttls: str) -> dict[str, object]:
        blocks = [{"type": "text", "text": "t", "cache_control": {"type": "ephemeral", "ttl": t}} for t in ttls]
        return {"messages": [{"role": "user", "content": blocks}]}

    assert "'5m' or '1h'" in (server.invalid(body("10m")) or "")
    assert "must not come after" in (server.invalid(body("5m", "1h")) or "")
    assert server.invalid(body("1h", "5m")) is None and server.invalid(body("1h", "1h")) is None


def test_prompt_cache_ttl_is_5m_or_1h_and_an_hours_write_costs_twice_the_input() -> None:
    with pytest.raises(ConfigError, match="prompt_cache_ttl"):
        build_provider("claude", AgentConfig(provider="anthropic", model="m", options={"prompt_cache_ttl": "2h"}))
    assert caches_for_an_hour(AgentConfig(provider="anthropic", model="m", options={"prompt_cache_ttl": "1h"}))
    assert not caches_for_an_hour(AgentConfig(provider="anthropic", model="m"))
    assert not caches_for_an_hour(AgentConfig(provider="anthropic", model="m",
                                              options={"prompt_cache_ttl": "1h", "prompt_cache": False}))
    # 1,000 written, 400 of them to the hour's cache: each part at its own price
    price = Price(input_per_mtok=3.0)
    assert (price.write_per_mtok, price.write_1h_per_mtok) == (pytest.approx(3.75), pytest.approx(6.0))
    assert price.cost(1000, 0, 0, 1000, 400) == pytest.approx((600 * 3.75 + 400 * 6.0) / 1e6)
    # a 5-minute price the pool sets (research.yaml's list price) leaves the hour's at its own rate
    listed = Price(input_per_mtok=3.0, cache_write_per_mtok=3.75)
    assert listed.cost(1000, 0, 0, 1000, 1000) == pytest.approx(6000 / 1e6)
    assert Price(input_per_mtok=3.0, cache_write_1h_per_mtok=5.0).cost(1000, 0, 0, 1000, 1000) == \
        pytest.approx(5000 / 1e6)
    # never more hour writes than writes
    assert price.cost(1000, 0, 0, 100, 500) == pytest.approx((900 * 3.0 + 100 * 6.0) / 1e6)


def test_writes_are_priced_by_the_lifetime_the_api_reports_not_the_one_asked(
        server: FakeAnthropicServer) -> None:
    # asked for the hour, the API reports 300 of 500 writes as 5-minute ones (it kept them 5 minutes)
    server.script(AnthropicReply(text="ok", input_tokens=100, output_tokens=0, cache_creation_input_tokens=500,
                                 ephemeral_1h_input_tokens=200))
    messages = worker_messages(task=TASK, visible=[], instruction="subtask 0")
    completion = claude(server, prompt_cache_ttl="1h").complete(messages, CallOptions(cache_points=(0,)))
    assert (completion.input_tokens, completion.cache_write_tokens, completion.cache_write_1h_tokens) == (
        600, 500, 200)
    agent = AgentConfig(provider="anthropic", model="m", price=Price(input_per_mtok=3.0),
                        options={"prompt_cache_ttl": "1h"})
    assert agent.billing.cost(completion.input_tokens, 0, 0, completion.cache_write_tokens,
                              completion.cache_write_1h_tokens) == pytest.approx(
        (100 * 3.0 + 300 * 3.75 + 200 * 6.0) / 1e6)


def test_a_step_that_may_write_the_hours_cache_reserves_at_its_price() -> None:
    price = Price(input_per_mtok=4.0, output_per_mtok=8.0)
    limits = {"max_cost_usd": 1.0}
    hour = step_reservation(limits, prompt_tokens=1000, max_tokens=100, price=price, cache_write_tokens=600,
                            cache_write_1h=True)
    assert hour.cost_usd == pytest.approx((400 * 4.0 + 600 * 8.0 + 100 * 8.0) / 1e6)
    # a pool whose hour price is below its 5-minute one: the bound is still the higher (either may be billed)
    odd = Price(input_per_mtok=4.0, output_per_mtok=8.0, cache_write_per_mtok=6.0, cache_write_1h_per_mtok=5.0)
    assert step_reservation(limits, prompt_tokens=1000, max_tokens=100, price=odd, cache_write_tokens=600,
                            cache_write_1h=True).cost_usd == pytest.approx((400 * 4.0 + 600 * 6.0 + 800) / 1e6)
    spent = Spent(tokens=0, cost_usd=0.0)
    tight = {"max_cost_usd": (400 * 4.0 + 600 * 8.0 + 50.5 * 8.0) / 1e6}  # room for 50 output tokens, not 51
    assert allowed_output_tokens(tight, spent, prompt_tokens=1000, max_tokens=4096, price=price,
                                 cache_write_tokens=600, cache_write_1h=True) == 50
    assert allowed_output_tokens(tight, spent, prompt_tokens=1000, max_tokens=4096, price=price,
                                 cache_write_tokens=600) == 50 + int(600 * 3.0 / 8.0)


def test_a_jobs_batch_line_carries_every_usage_field_of_get_job() -> None:
    # a /v1/jobs batch line's body is GET /v1/jobs/{id}'s outcome: its usage lacked the cache writes
    from datetime import UTC, datetime

    from conductor.batches import job_result
    from conductor.service.schemas import JobUsage
    from conductor.store.models import Job

    job = Job(tenant="t", task="x", pool="p", pool_config={}, planner="single", status="succeeded",
              created_at=datetime.now(UTC), input_tokens=10, output_tokens=5, cached_input_tokens=4,
              cache_write_tokens=3, reasoning_tokens=2)
    usage = job_result(job)["usage"]
    assert set(usage) == set(JobUsage.model_fields) - {"planner"}
    assert (usage["cached_input_tokens"], usage["cache_write_tokens"], usage["reasoning_tokens"]) == (4, 3, 2)


def test_writes_without_a_lifetime_split_count_as_long_as_the_call_asked(server: FakeAnthropicServer) -> None:
    # a compatible server (or an older API) reports the writes' total only: a call that asked for the hour is
    # billed the hour's price for them (not the 5-minute one: that was 37.5 % short), one that did not, not
    messages = worker_messages(task=TASK, visible=[], instruction="subtask 0")
    reply = AnthropicReply(text="ok", input_tokens=100, output_tokens=0, cache_creation_input_tokens=500)
    server.script(reply, reply, reply)
    hour = claude(server, prompt_cache_ttl="1h").complete(messages, CallOptions(cache_points=(0,)))
    five = claude(server).complete(messages, CallOptions(cache_points=(0,)))
    unmarked = claude(server, prompt_cache_ttl="1h").complete(messages, CallOptions())
    assert [(c.cache_write_tokens, c.cache_write_1h_tokens) for c in (hour, five, unmarked)] == [
        (500, 500), (500, 0), (500, 0)]


def test_the_fake_dates_a_held_write_by_its_request_and_reads_a_list_of_betas(
        timed: tuple[FakeAnthropicServer, Clock]) -> None:
    # inside held_writes() a write becomes readable when the block ends, but lives from its request: a clock
    # that moved on meanwhile does not lengthen its life
    server, clock = timed
    marked = {"type": "text", "text": "word " * 20, "cache_control": {"type": "ephemeral"}}
    body = {"system": [marked], "messages": [{"role": "user", "content": "hi"}]}
    request = RecordedRequest("POST", "/v1/messages", {}, {}, body, b"")
    with server.held_writes():
        assert server._cached_usage(request, body)["cache_creation_input_tokens"] == 20
        clock.now += 200
    clock.now += 150  # 350 s after the write, 150 s after the block ended
    assert server._cached_usage(request, body)["cache_read_input_tokens"] == 0
    # the beta header as a comma list with spaces, as clients send several
    listed = RecordedRequest("POST", "/v1/messages", {},
                             {"anthropic-beta": "other-beta-2025-01-01, extended-cache-ttl-2025-04-11"}, body, b"")
    hour_body = {**body, "system": [{**marked, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
    clock.now += 1000
    assert server._cached_usage(listed, hour_body)["cache_creation"]["ephemeral_1h_input_tokens"] == 20


def test_a_claimed_step_that_may_write_the_hours_cache_reserves_at_the_hours_price() -> None:
    # the engine's render of a step: pev's plan step on a Claude agent writes the system prefix for the steps
    # after it, so its reservation prices that prefix at the write price of the cache it asks for
    from datetime import UTC, datetime

    from conductor.budget import estimate_tokens
    from conductor.engine import _render
    from conductor.store.jobs import StepInput

    def reserved(job_id: str, **options: object) -> float:
        agent = {"provider": "anthropic", "model": "m", "price": {"input_per_mtok": 4.0, "output_per_mtok": 8.0},
                 "max_tokens": 100, "options": options}
        row = StepInput(job_status="running", task=TASK, context=None, limits={"max_cost_usd": 1.0},
                        pool_config={"planner": "template:single", "agents": {"c": agent}},
                        created_at=datetime.now(UTC), spent_tokens=0, spent_cost_usd=0.0, agent="c",
                        instruction="subtask 0", access_list=[], tenant="t", unstarted=3, visible=[],
                        index=0, workflow=[PlannedStep("c", access) for access in PEV])
        return float(_render(row, job_id, datetime.now(UTC), scope="").values["reserved_usd"])

    system = estimate_tokens(worker_messages(task=TASK, visible=[], instruction="x")[0].content)
    plain, five, hour = (reserved("job-plain", prompt_cache=False), reserved("job-5m"),
                         reserved("job-1h", prompt_cache_ttl="1h"))
    assert five - plain == pytest.approx(system * 4.0 * 0.25 / 1e6)
    assert hour - plain == pytest.approx(system * 4.0 * 1.0 / 1e6)


# --- one tenant's prefixes are its own ----------------------------------------------------------------------


def test_a_tenants_cache_scope_is_its_own_and_does_not_name_it() -> None:
    a, b = cache_scope("tenant-a"), cache_scope("tenant-b")
    assert a == cache_scope("tenant-a") and a != b
    assert re.fullmatch(r"\[cache scope [0-9a-f]{16}\]\n", a) and "tenant" not in a


def test_the_scope_sits_after_the_text_every_tenant_shares_and_before_the_task() -> None:
    plain = worker_messages(task=TASK, visible=[], instruction="x")[0].content
    scoped = worker_messages(task=TASK, visible=[], instruction="x", scope=cache_scope("t"))[0].content
    shared = plain[:plain.index("The overall task")]
    assert scoped.startswith(shared) and scoped.index("[cache scope") == len(shared)
    assert scoped.replace(cache_scope("t"), "", 1) == plain


def test_settings_scope_prompts_by_tenant_unless_caches_are_shared() -> None:
    assert Settings().prompt_cache_scope == "tenant"
    assert Settings().cache_scope("tenant-a") == cache_scope("tenant-a")
    assert Settings(prompt_cache_scope="shared").cache_scope("tenant-a") == ""
    with pytest.raises(ValidationError):
        Settings(prompt_cache_scope="per-job")  # type: ignore[arg-type]
