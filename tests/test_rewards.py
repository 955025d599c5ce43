"""Reward functions of the recipes, and how recipes resolve them."""

import pytest

from trl_grpo_ext.rewards import (
    REWARD_FUNCS,
    exact_match,
    extract_final_number,
    gsm8k_accuracy,
    gsm8k_solution,
    numbers_equal,
    resolve_reward_funcs,
    think_answer_format,
)

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_exact_match_strips_whitespace_and_reads_chat_completions():
    completions = ["cba", " cba\n", "abc", [{"role": "assistant", "content": "cba"}]]
    assert exact_match(completions, solution=["cba"] * 4) == [1.0, 1.0, 0.0, 1.0]


def test_gsm8k_solution_is_the_number_after_the_hashes():
    assert gsm8k_solution(GSM8K_ANSWER) == "72"
    assert gsm8k_solution("... #### 1,234") == "1234"
    with pytest.raises(ValueError, match="No final number"):
        gsm8k_solution("#### none")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>48/2 = 24, 48 + 24 = 72</think>\n<answer>72</answer>", "72"),
        ("<think>so 3 + 4</think><answer> $1,250.50 </answer>", "1250.50"),
        ("We add them: 12 + 30 = 42. The answer is 42.", "42"),
        ("The total is \\boxed{18} dollars.", "18"),
        ("Step 1: 5 apples. Step 2: 3 more. #### 8", "8"),
        ("She has -3 degrees, then 7 degrees", "7"),
        ("Half of it: 3/4", "3/4"),
        ("no digits here", None),
        ("<answer>seventy-two</answer> but 70 was close", "70"),
    ],
)
def test_final_number_extraction_on_realistic_completions(completion, expected):
    assert extract_final_number(completion) == expected


@pytest.mark.parametrize(
    ("left", "right", "equal"),
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("1,000", "1000", True),
        ("6/2", "3", True),
        ("5", "6", False),
        (None, "3", False),
    ],
)
def test_numbers_equal(left, right, equal):
    assert numbers_equal(left, right) is equal


def test_gsm8k_accuracy_compares_numbers():
    completions = [
        "<think>48/2 = 24; 48 + 24 = 72</think><answer>72</answer>",
        "<think>48 + 48 = 96</think><answer>96</answer>",
        "I think it's 72.00",
        [{"role": "assistant", "content": "<answer>72</answer>"}],
        "",
    ]
    assert gsm8k_accuracy(completions, solution=["72"] * 5) == [1.0, 0.0, 1.0, 1.0, 0.0]


def test_think_answer_format():
    completions = [
        "<think>a</think><answer>1</answer>",
        "<think>a</think>\n<answer>1</answer>\n",
        "<answer>1</answer>",
        "<think>a</think><answer>1</answer> trailing text",
    ]
    assert think_answer_format(completions) == [1.0, 1.0, 0.0, 0.0]


def test_resolve_registry_names_and_import_paths(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(completions, **kw):\n    return [len(c) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    funcs = resolve_reward_funcs(["exact_match", "my_rewards.length", "my_rewards:length"])
    assert funcs[0] is REWARD_FUNCS["exact_match"]
    assert funcs[1](["ab", "c"]) == [2, 1] and funcs[2] is funcs[1]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ([], "No reward function"),
        (["nope"], "Unknown reward function 'nope'"),
        (["missing_module.func"], "Cannot import"),
        (["trl_grpo_ext.rewards.nothing"], "Cannot import"),
        (["trl_grpo_ext.rewards.REWARD_FUNCS"], "not callable"),
    ],
)
def test_resolve_errors_name_the_function(names, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward_funcs(names)
