"""Tokens: what the same task costs in prompt + output tokens under three context policies, counted
with the cl100k_base BPE (``tiktoken`` when its data is cached; else ``bpe-openai``, which ships the
same table) on the exact messages the engine sends (``conductor.context.worker_messages``):

- access lists: each step sees only the steps its access list names (pev, and a 5-step DAG);
- see-everything: the same workflows, every step seeing every earlier step;
- MoA: 3 proposers + an aggregator, 3 proposers x 2 layers + an aggregator (7 calls), and the published
  3-layer example (togethercomputer/MoA ``advanced-moa.py``, ``layers = 3``: 4 reference models, 4 more
  that each see all four answers, an aggregator that sees those: 9 calls).

A one-step workflow (what a conductor writes for an easy question) is counted too, as the other end of
what the access-list workflows cost, alone and with the planning call that wrote it: the conductor's
prompt for the shipped research pool (``conductor.planning.prompt``) and a one-step workflow as its
answer. Template workflows (pev, MoA) need no planning call.

No model runs: every answer is a fixed synthetic text of ``--answer-tokens`` tokens, so the figures
compare context policies, not answer lengths (a real run's answers vary per agent).

With Anthropic's prompt cache: each workflow runs again on one ``anthropic`` agent, through the real provider
and SDK, against the loopback Anthropic server that models the cache by its documented rules
(``tests/fakes/anthropic_server.py``: prefixes of at least ``--cache-min-tokens`` tokens, counted with the
same BPE; a workflow's parallel steps, sent together, read none of each other's writes). Each step carries
the cache points the engine gives it (``conductor.context.cache_points``). What the cache saves is the input
price: reads cost 0.1 times it, writes 1.25 times, Anthropic's 5-minute rates.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from conductor.context import cache_scope, worker_messages

if TYPE_CHECKING:
    from bench.env import Result

TASKS = [
    "Write a Python function that parses RFC 3339 timestamps, with tests.",
    "Explain why the sky is blue to a ten-year-old, then to a physicist.",
    "Design a rate limiter for an API gateway shared by many tenants; name the trade-offs.",
    "Prove that the square root of 2 is irrational.",
    "Summarize the causes of the 2008 financial crisis in five bullet points.",
    "Translate 'the early bird catches the worm' into French, German and Japanese, and explain each idiom.",
    "Find the bug: def mean(xs): return sum(xs) / len(xs) - what happens on an empty list, and fix it.",
    "Plan a three-day trip to Kyoto for a family with two children on a modest budget.",
]
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do", "eiusmod",
         "tempor")
WORKFLOWS: dict[str, list[list[int]]] = {
    "one step": [[]],
    "pev": [[], [0], [0, 1]],
    "dag5": [[], [], [0], [1], [2, 3]],
    "moa 3+1": [[], [], [], [0, 1, 2]],
    "moa 3x2+1": [[], [], [], [0, 1, 2], [0, 1, 2], [0, 1, 2], [3, 4, 5]],
    "moa 4x2+1": [[], [], [], [], *[[0, 1, 2, 3]] * 4, [4, 5, 6, 7]],
}
MOA = ("moa 3+1", "moa 3x2+1", "moa 4x2+1")


TTLS = ("5m", "1h")
SCOPE = cache_scope("bench")
"""Every prompt carries a tenant's cache scope, as the engine's do by default (``prompt_cache_scope``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--answer-tokens", type=int, default=300)
    p.add_argument("--task-tokens", type=int, default=0,
                   help="pad each task with a document of about this many tokens (a deep-research job's sources)")
    p.add_argument("--cache-min-tokens", type=int, default=1024,
                   help="the shortest prefix Anthropic caches (1,024 for Sonnet and Opus, more for Haiku)")
    p.add_argument("--cache-ttl", choices=TTLS, default="5m",
                   help="the agent's prompt_cache_ttl in the prompt-cache pass")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="in the prompt-cache pass, how long each wave of steps runs (the cache model's clock)")


def waves(deps: Sequence[Sequence[int]]) -> list[list[int]]:
    """The steps in the order a workflow runs them: each wave starts when the steps it sees have ended."""
    level: list[int] = []
    for ds in deps:
        level.append(1 + max((level[d] for d in ds), default=-1))
    return [[i for i, lv in enumerate(level) if lv == w] for w in range(max(level) + 1)]


class WaveClock:
    """The cache model's clock: ``step_s`` later after each wave of steps."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now

    def wave_ended(self) -> None:
        self.now += self.step_s


def with_prompt_cache(tasks: Sequence[str], answer: str, n: Callable[[str], int], min_tokens: int,
                      ttl: str = "5m", step_s: float = 0.0) -> dict[str, dict[str, float]]:
    """Per workflow, mean per task: the input tokens the steps sent, of them read from and written to the
    cache, and the input's price relative to no cache; an agent with ``prompt_cache_ttl`` ``ttl``, each wave of
    steps running ``step_s`` seconds on the cache model's clock."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from conductor.context import PlannedStep, cache_points
    from conductor.pool.base import CallOptions, Completion
    from conductor.pool.config import AgentConfig, Price
    from conductor.pool.registry import build_provider
    from tests.fakes.anthropic_server import FakeAnthropicServer
    from tests.fakes.http_base import Reply

    os.environ.setdefault("CONDUCTOR_BENCH_ANTHROPIC_KEY", "sk-ant-loopback")
    out: dict[str, dict[str, float]] = {}
    clock = WaveClock(step_s)
    with FakeAnthropicServer(lambda _body: Reply(text=answer), prompt_cache_min_tokens=min_tokens,
                             count=n, clock=clock) as srv, ThreadPoolExecutor(max_workers=8) as pool:
        agent = AgentConfig(provider="anthropic", model="claude-bench", base_url=srv.base_url,
                            api_key_env="CONDUCTOR_BENCH_ANTHROPIC_KEY", price=Price(input_per_mtok=1e6),
                            options={"prompt_cache_ttl": ttl})
        provider = build_provider("claude", agent)
        price = agent.billing  # an input token costs 1: the engine's own prices of reads and writes
        for wf, deps in WORKFLOWS.items():
            srv.clear_cache()  # each workflow from a cold cache: the tasks' prefixes are the same in each
            sent = read = written = 0
            paid = 0.0
            for task in tasks:
                def call(i: int, task: str = task, deps: Sequence[Sequence[int]] = deps) -> Completion:
                    visible = [(f"subtask {d}", answer) for d in sorted(deps[i])]
                    messages = worker_messages(task=task, visible=visible, instruction=f"subtask {i}", scope=SCOPE)
                    points = cache_points(i, [PlannedStep("claude", d) for d in deps], inherited=0)
                    return provider.complete(messages, CallOptions(cache_points=points))

                for wave in waves(deps):
                    with srv.held_writes():
                        for c in pool.map(call, wave):
                            sent, read, written = sent + c.input_tokens, read + c.cached_input_tokens, \
                                written + c.cache_write_tokens
                            paid += price.cost(c.input_tokens, 0, c.cached_input_tokens, c.cache_write_tokens,
                                               c.cache_write_1h_tokens)
                    clock.wave_ended()
            out[wf] = {"input_tokens": sent / len(tasks), "read": read / len(tasks),
                       "written": written / len(tasks), "input_price_vs_no_cache": paid / sent}
    return out


def encoder() -> tuple[str, Callable[[str], int]]:
    """cl100k_base from tiktoken, or from bpe-openai when tiktoken cannot download its table."""
    try:
        import tiktoken

        enc = tiktoken.get_encoding("cl100k_base")
        return "tiktoken cl100k_base", lambda t: len(enc.encode(t))
    except Exception:
        import bpe_openai  # type: ignore[import-not-found]

        benc = bpe_openai.get_encoding("cl100k_base")
        return "bpe-openai cl100k_base (tiktoken could not fetch its table offline)", lambda t: len(benc.encode(t))


def count(task: str, deps: Sequence[Sequence[int]], answer: str, n: Callable[[str], int]) -> int:
    total = 0
    for i, ds in enumerate(deps):
        visible = [(f"subtask {d}", answer) for d in ds]
        messages = worker_messages(task=task, visible=visible, instruction=f"subtask {i}", scope=SCOPE)
        total += sum(n(m.content) + 4 for m in messages) + n(answer)  # +4: per-message chat overhead
    return total


def filler(tokens: int, n: Callable[[str], int]) -> str:
    """A synthetic text of at least ``tokens`` tokens."""
    text = ""
    while n(text) < tokens:
        text += " ".join(WORDS) + " "
    return text


def planning(task: str, n: Callable[[str], int]) -> int:
    """A planning call that writes a one-step workflow: the conductor's prompt for the shipped research
    pool (at the server's default limits) in, the workflow JSON out."""
    from conductor.planning.prompt import build_planner_messages
    from conductor.pool.config import load_pool
    from conductor.settings import DEFAULT_POOL_FILE

    pool = load_pool(DEFAULT_POOL_FILE)
    messages = build_planner_messages(task, pool, max_steps=5, allow_conductor=True, scope=SCOPE)
    plan = json.dumps({"model_ids": [pool.worker_names[0]], "subtasks": [task], "access_lists": [[]]})
    return sum(n(m.content) + 4 for m in messages) + n(plan)


def run(args: argparse.Namespace) -> Result:
    # bench.env points this process at the benchmarks' broker and database when imported: only here, so
    # that importing the workflows and the count (tests/unit/test_bench_tokens.py) changes nothing
    from bench.env import Result, table

    name, n = encoder()
    answer = ""
    while n(answer) < args.answer_tokens:
        answer += f"{WORDS[len(answer) % len(WORDS)]} "
    tasks = TASKS[:2] if args.quick else TASKS
    if args.task_tokens:
        document = filler(args.task_tokens, n)
        tasks = [f"{task}\n\nSources:\n{document}" for task in tasks]
    rows, data = [], {}
    for wf, deps in WORKFLOWS.items():
        everything = [list(range(i)) for i in range(len(deps))]
        scoped = sum(count(t, deps, answer, n) for t in tasks) / len(tasks)
        full = sum(count(t, everything, answer, n) for t in tasks) / len(tasks)
        data[wf] = {"steps": len(deps), "access_lists": scoped, "see_everything": full}
        rows.append([wf, len(deps), round(scoped), round(full), f"{full / scoped:.2f}x"])
    planned = sum(planning(t, n) + count(t, WORKFLOWS["one step"], answer, n) for t in tasks) / len(tasks)
    data["one step + planning"] = {"steps": 1, "access_lists": planned, "see_everything": planned}
    rows.insert(1, ["one step + planning call", 1, round(planned), round(planned), "1.00x"])
    for wf in MOA:
        data[wf]["vs_pev_access_lists"] = data[wf]["access_lists"] / data["pev"]["access_lists"]
        data[wf]["vs_one_step"] = data[wf]["access_lists"] / data["one step"]["access_lists"]
        data[wf]["vs_one_step_planned"] = data[wf]["access_lists"] / planned
    md = table(["workflow", "steps", "tokens, access lists", "tokens, see-everything", "see-everything / lists"], rows)
    padded = f" (each with a {args.task_tokens}-token document)" if args.task_tokens else ""
    md += (f"\n\nMean tokens per task over {len(tasks)} tasks{padded}, answers of {n(answer)} tokens, "
           f"counted with {name}. "
           "Against pev with access lists: "
           + ", ".join(f"{wf} {data[wf]['vs_pev_access_lists']:.2f}x" for wf in MOA)
           + "; against one step: " + ", ".join(f"{wf} {data[wf]['vs_one_step']:.2f}x" for wf in MOA)
           + "; against one step with the planning call that wrote it (research pool): "
           + ", ".join(f"{wf} {data[wf]['vs_one_step_planned']:.2f}x" for wf in MOA)
           + ". MoA 4x2+1 is togethercomputer/MoA's `advanced-moa.py` (`layers = 3`, 4 reference models).")
    cached = with_prompt_cache(tasks, answer, n, args.cache_min_tokens, args.cache_ttl, args.step_seconds)
    from conductor.pool.config import ANTHROPIC_CACHE_READ_FACTOR, CACHE_WRITE_1H_FACTOR, CACHE_WRITE_FACTOR

    lifetime = "5-minute" if args.cache_ttl == "5m" else "one-hour"
    write_rate = CACHE_WRITE_FACTOR if args.cache_ttl == "5m" else CACHE_WRITE_1H_FACTOR
    spacing = f", each wave of steps running {args.step_seconds:g} s on its clock" if args.step_seconds else ""
    md += ("\n\nWith Anthropic's prompt cache (each workflow on one `anthropic` agent, through the SDK, against the "
           f"loopback server's model of the cache: prefixes of at least {args.cache_min_tokens} tokens, the "
           f"{lifetime} cache{spacing}, reads at {ANTHROPIC_CACHE_READ_FACTOR}x and writes at {write_rate}x the "
           "input price):\n\n")
    md += table(["workflow", "input tokens", "read from the cache", "written to it", "input price vs no cache"],
                [[wf, round(c["input_tokens"]), round(c["read"]), round(c["written"]),
                  f"{c['input_price_vs_no_cache']:.2f}x"] for wf, c in cached.items()])
    cmd = "python -m bench tokens --quick" if args.quick else \
        (f"python -m bench tokens --answer-tokens {args.answer_tokens} --cache-min-tokens {args.cache_min_tokens}"
         + (f" --task-tokens {args.task_tokens}" if args.task_tokens else "")
         + (f" --cache-ttl {args.cache_ttl}" if args.cache_ttl != "5m" else "")
         + (f" --step-seconds {args.step_seconds:g}" if args.step_seconds else ""))
    data_out = {"encoder": name, "answer_tokens": n(answer), "task_tokens": args.task_tokens, "tasks": len(tasks),
                "workflows": data,
                "prompt_cache": {"min_tokens": args.cache_min_tokens, "ttl": args.cache_ttl,
                                 "step_seconds": args.step_seconds, "workflows": cached}}
    return Result("tokens", cmd, data_out, md)
