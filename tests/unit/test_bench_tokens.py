"""The tokens benchmark's workflows are the shapes it names, and its count follows what each step sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.tokens import WORKFLOWS, count


def words(text: str) -> int:
    return len(text.split())


def test_published_moa_example_is_four_references_two_layers_and_an_aggregator() -> None:
    # togethercomputer/MoA advanced-moa.py, layers = 3: 4 references, 4 that see all four, 1 aggregator
    deps = WORKFLOWS["moa 4x2+1"]
    assert len(deps) == 9
    assert deps[:4] == [[], [], [], []]
    assert deps[4:8] == [[0, 1, 2, 3]] * 4
    assert deps[8] == [4, 5, 6, 7]


def test_a_step_pays_for_each_answer_it_sees_and_only_those() -> None:
    answer = "x " * 50  # 50 words
    alone = count("task", [[]], answer, words)
    seeing_one = count("task", [[], [0]], answer, words) - alone
    seeing_two = count("task", [[], [], [0, 1]], answer, words) - 2 * alone
    assert seeing_one - alone >= 50  # the second step's prompt carries the first answer
    assert seeing_two - seeing_one >= 50  # and one more answer costs at least its length again
    chain = count("task", [[], [0], [1]], answer, words)
    everything = count("task", [[], [0], [0, 1]], answer, words)
    assert everything - chain >= 50  # the access list is what keeps the answer out



def test_importing_the_benchmark_leaves_the_process_environment_alone() -> None:
    # bench.env points its process at the benchmarks' broker and database: imported by this module at
    # collection, it had sent every worker the integration tests start to the benchmarks' Redis database
    check = ("import os; before = dict(os.environ); import bench.tokens; "
             "changed = sorted(k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)); "
             "assert not changed, changed")
    done = subprocess.run([sys.executable, "-c", check], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_planning_call_counts_the_conductors_prompt_and_its_answer() -> None:
    from bench.tokens import planning
    from conductor.planning.prompt import system_prompt
    from conductor.pool.config import load_pool
    from conductor.settings import DEFAULT_POOL_FILE

    prompt = words(system_prompt(load_pool(DEFAULT_POOL_FILE)))
    short, long = planning("task", words), planning("task " * 100, words)
    assert short > prompt  # the whole system prompt, then the request and the workflow written
    assert long - short >= 190  # 99 more words, in the request and again as the one step's subtask


def test_the_prompt_cache_pass_prices_a_five_minute_cache_that_expires_between_steps_as_a_loss() -> None:
    # pev with long prompts, through the provider and the loopback cache model: steps back to back read what
    # the step before wrote; 400 s apart, a 5-minute cache has expired at each read (every step writes, none
    # reads: more than no cache), while the one-hour cache reads the same as back to back, at its write price
    from bench.tokens import TASKS, with_prompt_cache

    tasks = [TASKS[0] + " Sources: " + "finding " * 400]

    def pev(ttl: str, step_s: float) -> dict[str, float]:
        return with_prompt_cache(tasks, "answer " * 300, lambda t: len(t.split()), 100, ttl, step_s)["pev"]

    fast, slow, hour = pev("5m", 0), pev("5m", 400), pev("1h", 400)
    assert fast["read"] > 0 and fast["input_price_vs_no_cache"] < 1
    assert slow["read"] == 0 and slow["written"] > fast["written"] and slow["input_price_vs_no_cache"] > 1
    assert (hour["read"], hour["written"]) == (fast["read"], fast["written"])
    assert fast["input_price_vs_no_cache"] < hour["input_price_vs_no_cache"] < 1
