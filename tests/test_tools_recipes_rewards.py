"""Reward functions of the recipes, and how recipes resolve them."""

import pytest

from trl_grpo_ext.tools.recipes.rewards import (
    REWARD_FUNCS,
    TRL_REWARD_FUNCS,
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


# Completions whose solution is 18 (9 eggs at $2 each), in the formats models write; the comment says what a reader
# that takes the first number of a span, stops at a brace or needs "answer is" without a colon would read.
EIGHTEEN = [
    "<answer>9 * 2 = 18</answer>",  # 9
    "So the total is \\boxed{2 \\times 9 = 18}.",  # 2
    "$\\boxed{\\text{18 dollars}}$",
    "The answer is: 18 (she sells 9 eggs at $2 each)",  # 2: the colon was not matched
    "The answer is: **18** dollars.",
    "**Answer:** 18",
    "The final answer is\n\n18",
    "She earns 9 * 2 = 18 dollars a day. The answer is 18. Check: 2 * 9 = 18 and 1 more egg is left.",
    "<answer>\n18\n</answer>",
]


@pytest.mark.parametrize("completion", EIGHTEEN)
def test_the_final_answer_is_read_where_the_model_marks_it(completion):
    assert extract_final_number(completion) == "18"
    conversational = [{"role": "assistant", "content": completion}]
    assert extract_final_number(conversational) == "18"
    assert gsm8k_accuracy([completion, conversational], solution=["18", "18"]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("It takes 10-15 minutes", "15"),  # a range, not -15
        ("from 3 - 5 hours", "5"),
        ("page 12-3", "3"),
        ("COVID-19 closed it", "19"),
        ("(3 + 4)-2", "2"),
        ("It is -3 degrees outside", "-3"),
        ("x = -7.5", "-7.5"),
        ("The loss is \u22124 dollars", "-4"),  # the typeset minus sign
        ("<answer>-12</answer>", "-12"),
    ],
)
def test_a_minus_is_a_sign_only_where_it_is_not_a_hyphen(completion, expected):
    assert extract_final_number(completion) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("It takes .5 hours", "0.5"),  # not 5
        ("She saves $1,234,567.25 in all.", "1234567.25"),
        ("The answer is 1,000.", "1000"),
        ("The numbers are 1,2,3", "3"),  # a list, not the thousands of "123"
        ("He ran 12,5 km", "5"),  # a decimal comma is not a thousands separator
        ("\\boxed{\\frac{3}{4}}", "3/4"),
        ("\\boxed{1{,}250}", "1250"),
    ],
)
def test_thousands_separators_decimals_and_fractions(completion, expected):
    assert extract_final_number(completion) == expected
    assert numbers_equal(extract_final_number(completion), expected)


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
        (["nope"], "Unknown reward function 'nope': use one of \\['exact_match', 'gsm8k_accuracy', "),
        (["missing_module.func"], "Cannot import"),
        (["trl_grpo_ext.tools.recipes.rewards.nothing"], "Cannot import"),
        (["trl_grpo_ext.tools.recipes.rewards.REWARD_FUNCS"], "not callable"),
    ],
)
def test_resolve_errors_name_the_function(names, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward_funcs(names)


@pytest.mark.parametrize(("name", "closest"), [("exact_mach", "exact_match"), ("think_format", "think_format_reward")])
def test_a_misspelled_name_is_told_the_closest_known_one(name, closest):
    with pytest.raises(
        ValueError, match=f"Unknown reward function '{name}' \\(did you mean '{closest}'\\?\\): use one of"
    ):
        resolve_reward_funcs([name])


def test_a_name_close_to_none_gets_no_suggestion():
    with pytest.raises(ValueError) as error:
        resolve_reward_funcs(["bleu"])
    assert "did you mean" not in str(error.value)


def test_unknown_names_list_this_packages_and_trls_rewards():
    with pytest.raises(ValueError) as error:
        resolve_reward_funcs(["accuracy"])
    for name in [*REWARD_FUNCS, *TRL_REWARD_FUNCS]:
        assert name in str(error.value), name


def test_trl_rewards_by_name_keep_their_names_and_read_plain_and_chat_completions():
    (think,) = resolve_reward_funcs(["think_format_reward"])
    assert think.__name__ == "think_format_reward"  # TRL logs rewards/<name>/mean
    completions = ["<think>9 * 2</think>18", "18", [{"role": "assistant", "content": "<think>a</think>b"}]]
    assert think(completions) == [1.0, 0.0, 1.0]


def test_the_soft_overlong_punishment_uses_the_runs_completion_limit():
    (punish,) = resolve_reward_funcs(["get_soft_overlong_punishment"], max_completion_length=10)
    # L_max = 10, L_cache = 10 // 5 = 2: 0 up to 8 tokens, then linear to -1 at 10, -1 beyond.
    assert punish(completion_ids=[[0] * 8, [0] * 9, [0] * 10, [0] * 11]) == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="max_completion_length"):
        resolve_reward_funcs(["get_soft_overlong_punishment"])


def test_trls_math_verify_rewards_without_math_verify_name_the_extra(monkeypatch):
    import importlib

    # `trl` is a lazy module: its attribute `import_utils` is not the submodule.
    monkeypatch.setattr(importlib.import_module("trl.import_utils"), "is_math_verify_available", lambda: False)
    for name in ("accuracy_reward", "reasoning_accuracy_reward"):
        with pytest.raises(
            ValueError, match=r'math-verify, which is not installed: pip install "trl-grpo-ext\[math\]"'
        ):
            resolve_reward_funcs([name])


# The same answers read by TRL's `accuracy_reward` (math-verify; LaTeX only: `\boxed{}` or `$...$`) and by
# `gsm8k_accuracy`: (completion, solution, TRL's reward, gsm8k_accuracy's). docs/recipes.md shows this table.
SAME_ANSWERS = [
    ("<think>9 * 2 = 18</think><answer>18</answer>", "18", 0.0, 1.0),
    ("<answer>9 * 2 = 18</answer>", "18", 0.0, 1.0),
    ("The answer is 18.", "18", 0.0, 1.0),
    ("#### 18", "18", 0.0, 1.0),
    ("<answer>1,250</answer>", "1250", 0.0, 1.0),
    ("<think>...</think><answer>\\boxed{18}</answer>", "18", 1.0, 1.0),
    ("So she makes $\\boxed{18}$ dollars.", "18", 1.0, 1.0),
    ("The answer is $18$.", "18", 1.0, 1.0),
    ("\\boxed{2 \\times 9 = 18}", "18", 1.0, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("\\boxed{1.5 \\text{ hours}}", "1.5", 1.0, 1.0),
    ("\\boxed{3 \\cdot 4}", "12", 1.0, 0.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0, 0.0),
    ("$18$ eggs... no, 20 eggs", "20", 0.0, 1.0),
    ("\\boxed{90 \\text{ minutes}}", "1.5", 0.0, 0.0),
]


@pytest.mark.parametrize(("completion", "solution", "trl", "ours"), SAME_ANSWERS)
def test_trl_accuracy_reward_and_gsm8k_accuracy_on_the_same_answers(completion, solution, trl, ours):
    pytest.importorskip("math_verify")
    (accuracy,) = resolve_reward_funcs(["accuracy_reward"])
    assert accuracy.__name__ == "accuracy_reward"
    assert accuracy([completion], solution=[solution]) == [trl]
    assert gsm8k_accuracy([completion], solution=[solution]) == [ours]
