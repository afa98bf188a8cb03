"""Reading planner model text into the three lists: the shapes real planners emit, and broken ones."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conductor.planning.parse import PlannerFormatError, parse_planner_output
from conductor.workflow import Step, Workflow, _blank, parse_workflow

POOL = ["gpt-5", "claude-sonnet-4", "qwen3-32b"]


def parse(text: str) -> dict:
    return parse_planner_output(text, POOL)


# --- the research model's three Python lists -------------------------------------------------------


def test_three_lists_with_integer_ids_after_think_block() -> None:
    text = """<think>
The question is hard maths. I will let model 2 draft and model 0 verify; model_ids should be short.
</think>
model_ids = [2, 0]
subtasks = ["Solve x^2 - 5x + 6 = 0 and show each step.", "Check the solution above; give the final roots."]
access_lists = [[], "all"]"""
    assert parse(text) == {
        "model_ids": ["qwen3-32b", "gpt-5"],
        "subtasks": [
            "Solve x^2 - 5x + 6 = 0 and show each step.",
            "Check the solution above; give the final roots.",
        ],
        "access_lists": [[], "all"],
    }


def test_three_lists_without_think_and_with_all_in_a_list() -> None:
    text = (
        "model_ids = [0, 1, 2]\n"
        "subtasks = ['Attempt A', 'Attempt B', 'Combine the attempts']\n"
        'access_lists = [[], [], ["all"]]\n'
    )
    raw = parse(text)
    assert raw["access_lists"] == [[], [], ["all"]]
    workflow = parse_workflow(raw, agents=POOL, max_steps=5)
    assert workflow.steps[2].access_list == "all"


def test_agent_names_and_conductor_by_name() -> None:
    text = (
        'model_ids = ["claude-sonnet-4", "conductor"]\n'
        'subtasks = ["draft", "check"]\naccess_lists = [[], [0]]'
    )
    assert parse(text)["model_ids"] == ["claude-sonnet-4", "conductor"]


def test_single_quoted_strings_with_escapes_and_brackets_inside() -> None:
    text = (
        "model_ids = [1]\n"
        "subtasks = ['Don\\'t stop: parse \"a[0]\" and ]] and [[ then print(\\'done\\')\\nnext line']\n"
        "access_lists = [[]]"
    )
    expected = "Don't stop: parse \"a[0]\" and ]] and [[ then print('done')\nnext line"
    assert parse(text)["subtasks"] == [expected]


def test_trailing_prose_after_the_lists_is_ignored() -> None:
    text = (
        "model_ids = [0]\nsubtasks = ['Answer: what is 2+2?']\naccess_lists = [[]]\n\n"
        "This workflow uses one step because the question is easy: model_ids = [0] is enough."
    )
    assert parse(text)["model_ids"] == ["gpt-5"]


def test_a_list_given_twice_differently_is_refused_not_guessed() -> None:
    # which one the model meant is not knowable: re-asked, never pieced together from a draft and prose
    text = "model_ids = [0]\nsubtasks = ['x']\naccess_lists = [[]]\nOr else model_ids = [9] could work."
    with pytest.raises(PlannerFormatError, match="model_ids is given twice, differently"):
        parse(text)


def test_the_last_complete_json_object_is_the_workflow_not_a_list_in_the_prose_before_it() -> None:
    real = {"model_ids": ["gpt-5", "qwen3-32b"], "subtasks": ["solve", "check"], "access_lists": [[], [0]]}
    text = "I first thought of access_lists: [[], []] but chose\n" + json.dumps(real)
    assert parse(text) == real
    draft = {"model_ids": ["qwen3-32b"], "subtasks": ["DRAFT"], "access_lists": [[]]}
    assert parse(f"Draft: {json.dumps(draft)}\nFinal:\n```json\n{json.dumps(real)}\n```") == real


def test_an_unreadable_list_is_not_replaced_by_a_later_one_in_the_prose() -> None:
    text = ('{"model_ids":["gpt-5","gpt-5"],"subtasks":["x","y"],"access_lists":[[],all]}\n'
            "Alternatively one could use access_lists = [[], []].")
    with pytest.raises(PlannerFormatError, match="access_lists is not a valid list literal"):
        parse(text)


@pytest.mark.parametrize("text", [
    'Sure.\n<think>model_ids = [2]\nsubtasks = ["DRAFT"]\naccess_lists = [[]] -- no, two steps.</think>\n{REAL}',
    '<think>ok</think>\n<think>{{"model_ids": [2], "subtasks": ["DRAFT"], "access_lists": [[]]}}</think>\n{REAL}',
])
def test_drafts_inside_any_think_block_are_not_the_workflow(text: str) -> None:
    real = {"model_ids": ["gpt-5", "qwen3-32b"], "subtasks": ["solve", "check"], "access_lists": [[], [0]]}
    assert parse(text.replace("{REAL}", json.dumps(real)).replace("{{", "{").replace("}}", "}")) == real


def test_think_opened_by_the_chat_template_only_closing_tag_in_output() -> None:
    text = "I should plan two steps.\n</think>\nmodel_ids = [0]\nsubtasks = ['x']\naccess_lists = [[]]"
    assert parse(text)["subtasks"] == ["x"]


def test_multiline_lists() -> None:
    text = """model_ids = [
    0,
    1,
]
subtasks = [
    "first",
    "second",
]
access_lists = [
    [],
    [0],
]"""
    assert parse(text)["access_lists"] == [[], [0]]


# --- JSON ------------------------------------------------------------------------------------------


def test_bare_json_object() -> None:
    text = json.dumps({"model_ids": ["gpt-5"], "subtasks": ["Say hi"], "access_lists": [[]]})
    assert parse(text) == {"model_ids": ["gpt-5"], "subtasks": ["Say hi"], "access_lists": [[]]}


def test_json_in_a_code_fence_with_prose_around_it() -> None:
    text = """Here is the workflow (model_ids: see below):

```json
{
  "model_ids": ["qwen3-32b", "claude-sonnet-4", "gpt-5"],
  "subtasks": ["Plan it.", "Implement it with \\"quotes\\" and a \\u00e9.", "Verify it."],
  "access_lists": [[], [0], "all"]
}
```
I hope this helps."""
    raw = parse(text)
    assert raw["subtasks"][1] == 'Implement it with "quotes" and a \u00e9.'
    assert raw["access_lists"] == [[], [0], "all"]


def test_key_names_inside_an_instruction_are_not_mistaken_for_the_lists() -> None:
    text = json.dumps(
        {
            "subtasks": ["Explain what access_lists = [1, 2] means and why model_ids: [0] is short."],
            "model_ids": [1],
            "access_lists": [[]],
        }
    )
    raw = parse(text)
    assert raw["access_lists"] == [[]]
    assert raw["model_ids"] == ["claude-sonnet-4"]


def test_json_with_integer_ids() -> None:
    text = '{"model_ids": [2], "subtasks": ["go"], "access_lists": [[]]}'
    assert parse(text)["model_ids"] == ["qwen3-32b"]


# --- broken outputs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the answer is empty"),
        ("   \n", "the answer is empty"),
        ("model_ids = [0]\nsubtasks = ['x']", "no access_lists list found"),
        ("I think the best worker is gpt-5.", "no model_ids list found; no subtasks list found"),
        ("model_ids = [0, 1\nsubtasks = ['a', 'b']\naccess_lists = [[], [0]]", "model_ids list starting"),
        ("model_ids = [0]\nsubtasks = ['a]\naccess_lists = [[]]", "never closed"),
        ("model_ids = 0\nsubtasks = ['a']\naccess_lists = [[]]", "model_ids is not a list (found '0"),
        ('{"model_ids": "gpt-5", "subtasks": ["a"], "access_lists": [[]]}', "model_ids is not a list"),
        ("model_ids = [0, 1]\nsubtasks = ['a']\naccess_lists = [[], [0]]", "subtasks has 1"),
        ("model_ids = [gpt5]\nsubtasks = ['a']\naccess_lists = [[]]", "list literal (only quoted"),
        ("model_ids = [3]\nsubtasks = ['a']\naccess_lists = [[]]", "numbered 0 to 2"),
        ("model_ids = [-1]\nsubtasks = ['a']\naccess_lists = [[]]", "model_ids[0] is -1"),
        ("<think>\nLet me consider the workers. Model 0 is strong and", "<think> block is never closed"),
        ("<think>planning...</think>\n  \n", "nothing follows the </think> block"),
        ("<think>\n", "<think> block is never closed"),
    ],
)
def test_broken_outputs_name_what_is_wrong(text: str, expected: str) -> None:
    with pytest.raises(PlannerFormatError) as info:
        parse(text)
    assert expected in str(info.value)


def test_length_mismatch_names_every_length() -> None:
    with pytest.raises(PlannerFormatError) as info:
        parse("model_ids = [0, 1]\nsubtasks = ['a', 'b', 'c']\naccess_lists = [[]]")
    message = str(info.value)
    assert "model_ids has 2, subtasks has 3, access_lists has 1" in message


def test_unclosed_think_with_lists_still_parses() -> None:
    text = "<think>\nmodel_ids = [0]\nsubtasks = ['x']\naccess_lists = [[]]"
    assert parse(text)["model_ids"] == ["gpt-5"]


def test_conductor_is_not_numbered() -> None:
    with pytest.raises(PlannerFormatError) as info:
        parse(f"model_ids = [{len(POOL)}]\nsubtasks = ['x']\naccess_lists = [[]]")
    assert '"conductor", not numbered' in str(info.value)


# --- round trip ------------------------------------------------------------------------------------

# Instructions full of the parser's own syntax (quotes, brackets, fences, list names) must survive too.
TRICKY = [*"[]{}'\"\\:=`\n ", "model_ids = [", "access_lists: [", "```json", "'''", '"""', "x"]
instructions = st.one_of(
    # (no NUL: an instruction holding one is refused, rightly, as Postgres text cannot store it)
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=80),
    st.lists(st.sampled_from(TRICKY), min_size=1, max_size=20).map("".join),
).filter(lambda s: not _blank(s) and "think>" not in s)  # blank as the parser counts it: format characters
# (U+00AD soft hyphen, U+200B ...) are invisible, so "\xad" alone is refused as an instruction, rightly


@st.composite
def workflows(draw: st.DrawFn) -> Workflow:
    n = draw(st.integers(min_value=1, max_value=5))
    steps = []
    for i in range(n):
        access = draw(
            st.one_of(
                st.just("all"),
                st.lists(st.integers(min_value=0, max_value=i - 1), unique=True, max_size=i).map(sorted),
            )
            if i
            else st.just([])
        )
        agent = draw(st.sampled_from(POOL))
        steps.append(Step(agent=agent, instruction=draw(instructions), access_list=access))
    return Workflow(steps=steps)


def as_python_lists(workflow: Workflow, *, integer_ids: bool, think: bool) -> str:
    lists = workflow.to_lists()
    ids = [POOL.index(a) for a in lists["model_ids"]] if integer_ids else lists["model_ids"]
    head = "<think>\nThree lists follow.\n</think>\n" if think else ""
    return (
        f"{head}model_ids = {ids!r}\nsubtasks = {lists['subtasks']!r}\n"
        f"access_lists = {lists['access_lists']!r}\nThat is the plan."
    )


def as_json(workflow: Workflow, *, fenced: bool) -> str:
    body = json.dumps(workflow.to_lists(), indent=2)
    return f"Plan:\n```json\n{body}\n```\n" if fenced else body


@given(workflows(), st.booleans(), st.booleans(), st.booleans())
def test_rendered_workflows_parse_back_to_the_same_workflow(
    workflow: Workflow, integer_ids: bool, think: bool, fenced: bool
) -> None:
    python_text = as_python_lists(workflow, integer_ids=integer_ids, think=think)
    for text in (python_text, as_json(workflow, fenced=fenced)):
        raw = parse_planner_output(text, POOL)
        assert parse_workflow(raw, agents=POOL, max_steps=5) == workflow


def test_think_tags_inside_a_subtask_are_text() -> None:
    # only a <think> opening a line is reasoning: a task about reasoning tags keeps its words
    real = {"model_ids": ["gpt-5", "claude-sonnet-4"],
            "subtasks": ["Write strip(text) that removes every <think>...</think> block.", "Explain </think>."],
            "access_lists": [[], "all"]}
    assert parse(json.dumps(real)) == real


def test_a_json_example_inside_a_python_list_subtask_is_not_the_workflow() -> None:
    example = '{"model_ids": [2], "subtasks": ["x"], "access_lists": [[]]}'
    text = (f"<think>plan</think>\nmodel_ids = [0, 1]\nsubtasks = ['Write a validator for JSON such as {example}', "
            "'Test it']\naccess_lists = [[], [0]]")
    raw = parse(text)
    assert raw["model_ids"] == ["gpt-5", "claude-sonnet-4"] and raw["subtasks"][1] == "Test it"


def test_the_same_list_given_by_numbers_and_by_names_is_one_list() -> None:
    text = ("model_ids = [0, 1]\nsubtasks = ['a', 'b']\naccess_lists = [[], [0]]\n\n"
            "So: model_ids = ['gpt-5', 'claude-sonnet-4']")
    assert parse(text)["model_ids"] == ["gpt-5", "claude-sonnet-4"]


def test_a_complete_workflow_before_a_cut_off_reasoning_block_is_the_answer() -> None:
    text = "model_ids = [0]\nsubtasks = ['a']\naccess_lists = [[]]\n<think>double-check: maybe model_ids = [1]"
    assert parse(text)["model_ids"] == ["gpt-5"]


def test_a_closing_think_tag_inside_a_subtask_is_text_too() -> None:
    real = {"model_ids": ["gpt-5"], "subtasks": ["Explain what </think> ends."], "access_lists": [[]]}
    assert parse(json.dumps(real)) == real
