"""Evaluation pieces that need no job: the dataset, the scorers, the sandbox, statistics, the router."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conductor.evaluation.dataset import DatasetError, Item, load_dataset, parse_items
from conductor.evaluation.planners import PlannerSpecError, parse_planners, request_fields
from conductor.evaluation.report import planner_table, summarize
from conductor.evaluation.results import JobResult, grpo_reward
from conductor.evaluation.router import fit_router, split_items
from conductor.evaluation.sandbox import run_python
from conductor.evaluation.scoring import extract_code, extract_letter, extract_number, score
from conductor.evaluation.stats import wilson_interval
from conductor.pool.base import CallOptions, Message
from conductor.pool.config import PoolConfig
from conductor.pool.sim import SimOptions, SimProvider

SHIPPED = load_dataset("shipped")


def item(**fields: object) -> Item:
    base: dict[str, object] = {"id": "x", "category": "c", "question": "Q?"}
    return Item.model_validate({**base, **fields})


# --- the shipped dataset ----------------------------------------------------------------------------


def test_shipped_dataset_has_the_three_kinds_and_at_least_60_items() -> None:
    categories = {i.category for i in SHIPPED}
    assert len(SHIPPED) >= 60
    assert {"arithmetic", "science", "code"} <= categories
    assert {i.scorer for i in SHIPPED} == {"numeric", "choice", "python_tests", "exact"}
    for category in ("arithmetic", "science", "code"):
        assert sum(i.category == category for i in SHIPPED) >= 20


@pytest.mark.parametrize("it", SHIPPED, ids=lambda i: i.id)
def test_every_reference_answer_scores_correct_and_a_non_answer_does_not(it: Item) -> None:
    assert it.reference is not None
    assert score(it, it.reference).correct, score(it, it.reference)
    assert not score(it, "I do not know.").correct


def test_a_bad_line_is_named_with_file_and_line() -> None:
    good = json.dumps({"id": "a", "category": "c", "question": "q", "scorer": "exact", "answer": "x"})
    with pytest.raises(DatasetError, match=r"data:2: .*scorer"):
        parse_items([good, json.dumps({"id": "b", "category": "c", "question": "q"})], source="data")
    with pytest.raises(DatasetError, match="appears twice"):
        parse_items([good, good], source="data")
    with pytest.raises(DatasetError, match="choice answer must be one letter"):
        parse_items([json.dumps({"id": "a", "category": "c", "question": "q", "scorer": "choice",
                                 "choices": ["x", "y"], "answer": "C"})])
    with pytest.raises(DatasetError, match="not JSON"):
        parse_items(["{"])


def test_the_prompt_lists_the_choices_and_says_how_to_answer() -> None:
    it = item(scorer="choice", choices=["red", "blue"], answer="B")
    assert it.prompt == "Q?\n\nA) red\nB) blue\n\nEnd with a line of the form 'Answer: <letter>'."


# --- scorers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,081.", 1081.0),
        ("47 * 23 = 1081\nAnswer: 1081", 1081.0),
        ("so x = 3/4", 0.75),
        ("Answer: -2.5e3 metres", -2500.0),
        ("no digits here", None),
        ("first 12 then 7\nFinal answer: 19 apples (not 20)", 19.0),  # the stated number, not the aside's
        ("Answer: 1 (since 37 × 27 = 999)", 1.0),  # noqa: RUF001 (models write the sign)
        ("Answer: 1081 (computed as 47 × 23)", 1081.0),  # noqa: RUF001
        ("The final answer is 47 × 23 = 1081", 1081.0),  # noqa: RUF001
        ("Answer: 91 cm^2", 91.0),
        ("Answer: 91 cm2", 91.0),
        ("Answer: \\frac{19}{24}", 19 / 24),
        ("Answer: $\\boxed{42}$", 42.0),
        ("Answer: (3/4)", 0.75),
        ("Answer: I cannot tell. (maybe 1?)", None),  # a refusal is no answer, whatever its asides say
        ("1000 = 37*27 + 1\nAnswer: unknown", None),  # ... nor does the reasoning stand in for it
        ("The result is 1081.\nHope this helps!", 1081.0),  # no marker: the text's last number
        ("**Answer:**\n\n1081", 1081.0),  # the marker's line holds only decoration
        ("**Final Answer:**\n\\[\n\\boxed{54}\n\\]", 54.0),
        ("The answer is straightforward...\n47 × 23 = 1081", 1081.0),  # noqa: RUF001 -- a marker in prose
        ("Multiplying 47 by 23 gives 1081.", 1081.0),
        ("The final answer is: 18 pencils cost $6.30", 6.3),
        ("Answer: 15% of 360 is 54", 54.0),
        ("Answer: 2^12 is 4096", 4096.0),
        ("Answer: 1000 = 37 × 27 + 1, so the remainder is 1", 1.0),  # noqa: RUF001
        ("The answer is not 50; it is 54.", 54.0),
        ("Answer: 5050 (n(n+1)/2 with n = 100)", 5050.0),  # nested asides
        ("Answer: 91 m²", 91.0),
    ],
)
def test_extract_number(text: str, expected: float | None) -> None:
    assert extract_number(text) == expected


def test_numeric_tolerance() -> None:
    it = item(scorer="numeric", answer="42.5", tolerance=0.01)
    assert score(it, "Answer: 42.505").correct
    assert not score(it, "Answer: 42.6").correct


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: C", "C"),
        ("The correct answer is (B).", "B"),
        ("I think option d is right", "D"),
        ("B) Nitrogen", "B"),
        ("**A**", "A"),
        ("Nitrogen is most common", None),
        ("Answer: B\n\nThe answer is a well-known fact.", "B"),  # "a" is a word, not a choice
        ("To answer a question like this, look it up.\nB", "B"),
        ("Answer: I think it's B", "B"),  # "I" is not one of the four letters
        ("I pick (B).", "B"),
        ("answer: (c)", "C"),
        ("The answer is B, since option A describes something else", "B"),  # the letter opening the answer
        ("Answer: B, not option C", "B"),
        ("The answer is B; (a) is a common misconception.", "B"),
        ("Answer: B. Choice (C) is close but wrong", "B"),
        ("The answer is b.", "B"),  # a lone lower-case letter is the answer
        ("Answer: c", "C"),
    ],
)
def test_extract_letter(text: str, expected: str | None) -> None:
    assert extract_letter(text, 4) == expected


def test_exact_match_ignores_case_punctuation_and_prose_before_the_answer() -> None:
    it = item(scorer="exact", answer="Canberra")
    assert score(it, "It is not Sydney.\nAnswer: canberra.").correct
    assert not score(it, "Answer: Sydney").correct


def test_extract_code_prefers_the_block_defining_the_entry_point() -> None:
    text = "Use:\n```python\nprint(f(1))\n```\nHere:\n```python\ndef f(x):\n    return x\n```\n"
    assert extract_code(text, "f") == "def f(x):\n    return x\n"
    assert extract_code("```python\ndef f(): pass", "f") == "def f(): pass"


def test_python_tests_pass_and_fail_on_behaviour() -> None:
    it = item(scorer="python_tests", tests="assert add(2, 3) == 5\n", entry_point="add")
    assert score(it, "```python\ndef add(a, b):\n    return a + b\n```").correct
    wrong = score(it, "```python\ndef add(a, b):\n    return a - b\n```")
    assert not wrong.correct and "AssertionError" in wrong.detail


@pytest.mark.parametrize(("main_block", "why"), [
    ("import unittest\nif __name__ == '__main__':\n    unittest.main()", "its own tests exit 0 first"),
    ("import sys\nif __name__ == '__main__':\n    sys.exit(0)", "it exits 0 in its main block"),
])
def test_a_wrong_answer_cannot_pass_by_exiting_before_the_items_tests(main_block: str, why: str) -> None:
    it = item(scorer="python_tests", tests="assert is_even(7) is False\n", entry_point="is_even")
    assert not score(it, f"```python\ndef is_even(n):\n    return True\n{main_block}\n```").correct, why


@pytest.mark.parametrize(("tests", "why"), [
    ("import unittest\nclass T(unittest.TestCase):\n    def test(self):\n        self.assertFalse(is_even(7))\n"
     "unittest.main()\n", "the tests end the program themselves (exit 0)"),
    ("import doctest\nassert doctest.testmod().failed == 0\nassert not is_even(7)\n",
     "doctest.testmod() reads the answer's docstrings"),
    ("import pickle\nassert pickle.loads(pickle.dumps(Parity.EVEN)) is Parity.EVEN\nassert is_even(2)\n",
     "what the answer defines pickles"),
    ("from concurrent.futures import ProcessPoolExecutor\nwith ProcessPoolExecutor(2) as pool:\n"
     "    assert list(pool.map(is_even, [1, 2])) == [False, True]\n", "a process pool runs the answer's code"),
])
def test_items_tests_run_as_they_were_written(tests: str, why: str) -> None:
    answer = ("```python\nimport enum\n\nclass Parity(enum.Enum):\n    EVEN = 0\n\ndef is_even(n):\n"
              "    \"\"\"\n    >>> is_even(4)\n    True\n    \"\"\"\n    return n % 2 == 0\n```")
    wrong = answer.replace(">>> is_even(4)", ">>> is_even(3)").replace("return n % 2 == 0", "return True")
    it = item(scorer="python_tests", tests=tests, entry_point="is_even")
    result = score(it, answer)
    assert result.correct, (why, result.detail)
    if "is_even(7)" in tests:
        assert not score(it, wrong).correct, why


def test_exiting_0_while_loading_is_not_a_pass() -> None:
    it = item(scorer="python_tests", tests="assert is_even(7) is False\n", entry_point="is_even")
    result = score(it, "```python\nimport os\ndef is_even(n):\n    return True\nos._exit(0)\n```")
    assert not result.correct and "before the tests ran" in result.detail


def test_a_right_answer_with_an_interactive_main_block_passes() -> None:
    it = item(scorer="python_tests", tests="assert is_even(4) and not is_even(7)\nassert fact(5) == 120\n",
              entry_point="is_even")
    answer = ("```python\ndef fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n\ndef is_even(n):\n"
              "    return n % 2 == 0\n\nif __name__ == '__main__':\n    print(is_even(int(input())))\n```")
    assert score(it, answer).correct


def test_a_process_left_running_does_not_hold_the_run() -> None:
    # the program exits 0 at once; what it started (in its group, or in a session of its own) keeps the
    # output open no longer: the run is not a timeout
    started = ("import subprocess, sys\n"
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)'])\n"
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)'], start_new_session=True)\n")
    result = run_python(started, timeout_s=5)
    assert result.passed and not result.timed_out, result.output


def test_the_sandbox_kills_a_runaway_program_at_its_timeout() -> None:
    result = run_python("while True:\n    pass\n", timeout_s=1)
    assert result.timed_out and not result.passed


def test_the_sandbox_sees_no_environment_and_runs_in_an_empty_directory() -> None:
    result = run_python("import os\nassert 'CONDUCTOR_DATABASE_URL' not in os.environ\n"
                        "assert os.listdir('.') == ['program.py'], os.listdir('.')\n", timeout_s=10)
    assert result.passed, result.output


# --- statistics, rewards, the router ------------------------------------------------------------------


def test_wilson_interval_known_values() -> None:
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_grpo_reward() -> None:
    assert grpo_reward(format_valid=False, correct=True) == 0.0
    assert grpo_reward(format_valid=None, correct=False) == 0.0
    assert grpo_reward(format_valid=True, correct=False) == 0.5
    assert grpo_reward(format_valid=True, correct=True) == 1.0


def result(category: str, agent: str, correct: bool, cost: float = 0.0) -> JobResult:
    return JobResult(run="r", phase="fit", item_id="i", category=category, planner=f"single:{agent}", job_id="j",
                     status="succeeded", correct=correct, reward=1.0 if correct else 0.5, extracted=None, detail="",
                     input_tokens=0, output_tokens=0, cost_usd=cost, latency_s=0.0, steps=1, format_valid=True,
                     workflow_source="request")


def test_samples_of_one_item_do_not_narrow_the_interval() -> None:
    # 6 items, 4 right; 8 identical samples each: 48 jobs, but still 6 items' worth of evidence
    once = [replace(result("c", "a", n < 4), item_id=f"i{n}") for n in range(6)]
    eight = [replace(r, sample=k) for r in once for k in range(8)]
    (single,), (sampled,) = summarize(once, by_category=False), summarize(eight, by_category=False)
    assert (sampled.n, sampled.items, sampled.correct) == (48, 6, 32)
    assert (sampled.ci_low, sampled.ci_high) == (single.ci_low, single.ci_high) == wilson_interval(4, 6)
    assert "48 (6 items)" in planner_table([sampled])


def test_split_keeps_every_category_on_both_sides() -> None:
    fit, held_out = split_items(SHIPPED, 0.5)
    assert {i.category for i in fit} == {i.category for i in held_out} == {i.category for i in SHIPPED}
    assert not {i.id for i in fit} & {i.id for i in held_out}
    assert len(fit) + len(held_out) == len(SHIPPED)


def test_router_picks_the_best_agent_per_category_and_the_cheaper_on_a_tie() -> None:
    results = [
        result("math", "a", True), result("math", "a", True), result("math", "b", False), result("math", "b", True),
        result("code", "a", False), result("code", "b", True),
        result("chat", "a", True, cost=2.0), result("chat", "b", True, cost=1.0),
    ]
    router = fit_router(results, ["a", "b"])
    assert router.agent_for("math") == "a"
    assert router.agent_for("code") == "b"
    assert router.agent_for("chat") == "b"
    assert router.table["math"].accuracy == 1.0
    assert router.agent_for("never-seen") == router.default.agent


def test_planner_specs() -> None:
    pool = PoolConfig.model_validate({"planner": "template:single", "agents": {"a": {"provider": "sim"}}})
    specs = parse_planners("conductor, single:a, router, template:moa, fanout, pev, fanout, planner:a", pool)
    assert [s.label for s in specs] == ["conductor", "single:a", "router", "moa", "fanout", "pev", "planner:a"]
    assert request_fields(specs[6]) == {"planner": "a"}
    assert request_fields(specs[1])["workflow"]["steps"][0]["agent"] == "a"
    assert request_fields(specs[2], routed_agent="a")["workflow"]["steps"][0]["agent"] == "a"
    assert request_fields(specs[3]) == {"planner": "template:moa"}
    with pytest.raises(PlannerSpecError, match="no worker agent 'zz'"):
        parse_planners("single:zz", pool)
    with pytest.raises(PlannerSpecError, match="unknown planner 'best'"):
        parse_planners("best", pool)


# --- the sim provider's scripted replies --------------------------------------------------------------


def sim_reply(options: dict[str, object], task: str) -> str:
    provider = SimProvider("bot", SimOptions.model_validate(options))
    messages = [Message("system", f"The overall task:\n{task}"), Message("user", "Solve it.")]
    return provider.complete(messages, CallOptions()).text


def test_sim_answers_its_skills_with_the_reference_and_the_rest_with_its_unknown_reply() -> None:
    arith = next(i for i in SHIPPED if i.category == "arithmetic")
    code = next(i for i in SHIPPED if i.category == "code")
    options = {"dataset": "shipped", "skills": ["arithmetic"]}
    assert sim_reply(options, arith.prompt) == arith.reference
    assert sim_reply(options, code.prompt) == "I do not know."
    assert sim_reply(options, "not a dataset question") == "[bot] Solve it."
    scripted = {**options, "category_replies": {"code": "by category"}, "item_replies": {arith.id: "by item"}}
    assert sim_reply(scripted, arith.prompt) == "by item"
    assert sim_reply(scripted, code.prompt) == "by category"
