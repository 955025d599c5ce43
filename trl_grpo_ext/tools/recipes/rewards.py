"""The recipe's reward functions (TRL's contract: `completions` and a list per dataset column, one float per
completion), and how a recipe names one: this module's, TRL's by the names `trl grpo` takes, or an import path."""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import re
import sys
from collections.abc import Callable
from fractions import Fraction


def completion_text(completion) -> str:
    """The text of a completion, plain (`str`) or conversational (`[{"role": "assistant", "content": ...}]`)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        if isinstance(content, list):  # content blocks
            return "".join(block.get("text", "") for block in content if isinstance(block, dict))
        return content or ""
    raise TypeError(f"Cannot read a completion of type {type(completion).__name__}.")


def exact_match(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, equals the `solution` column, else 0.0."""
    return [
        float(completion_text(completion).strip() == str(answer).strip())
        for completion, answer in zip(completions, solution, strict=True)
    ]


# One number as people write it: "1,234" (thousands separators in groups of three), "0.5", ".5", "$12", "3/4", with
# an optional minus ("-", or the Unicode minus of typeset text). Whether the minus is a sign is decided by `_numbers`.
_NUMBER = re.compile(
    r"(?P<minus>[-\u2212])?\$?"
    r"(?P<value>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/(?P<denominator>\d+))?"
)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
# "#### 72" (GSM8K's own format), "The answer is 72", "The final answer is: 72", "Answer: 72".
_MARKER = re.compile(r"####|\banswer\s*(?:is\b\s*[:=]?|[:=])", re.IGNORECASE)
_PARENTHETICAL = re.compile(r"\([^()]*\)")
# The end of the clause that holds a marked answer: a sentence mark before a space, a comma before a space, a line end.
_CLAUSE_END = re.compile(r"[.!?;](?=\s|$)|,\s|\n")


def _numbers(text: str) -> list[str]:
    """Every number in `text`, in order, normalised: no thousands separators or currency sign, "0.5" for ".5"."""
    numbers = []
    for match in _NUMBER.finditer(text):
        value = match.group("value").replace(",", "")
        if value.startswith("."):
            value = "0" + value
        if match.group("denominator"):
            value += "/" + match.group("denominator")
        before = text[: match.start()]
        # "10-15 minutes", "5 - 3", "COVID-19", "(a+b)-2": a hyphen after a digit, a word or a bracket is not a sign.
        hyphen = before[-1:].isalnum() or before[-1:] in (")", "]", "}") or before.rstrip()[-1:].isdigit()
        if match.group("minus") and not hyphen:
            value = "-" + value
        numbers.append(value)
    return numbers


def _last_number(text: str) -> str | None:
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def _boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}`, braces nested inside it included (`\\boxed{\\frac{1}{2}}`)."""
    contents = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                contents.append(text[start:index])
                break
    return contents


def _marked_answer(text: str) -> str | None:
    """The last number of the clause after the last "####" or "answer is" that has a number in it."""
    for match in reversed(list(_MARKER.finditer(text))):
        clause = text[match.end() :].lstrip().replace("*", "")
        clause = _PARENTHETICAL.sub(" ", clause)  # "18 (she sells 9 eggs at $2 each)"
        end = _CLAUSE_END.search(clause)
        number = _last_number(clause[: end.start()] if end else clause)
        if number is not None:
            return number
    return None


def extract_final_number(completion: str | list[dict]) -> str | None:
    """The final numeric answer of a math completion (text, or messages: the last one), or `None`: the last number
    inside the last `<answer>...</answer>` that holds one, else inside `\\boxed{...}`, else in the clause after
    "####" or "the answer is", else the last number of the text (docs/recipes.md, "Reward functions by name")."""
    text = _LATEX_FRACTION.sub(r"\1/\2", completion_text(completion)).replace("{,}", ",")
    for contents in (_ANSWER_TAG.findall(text), _boxed_contents(text)):
        for content in reversed(contents):
            number = _last_number(content)
            if number is not None:
                return number
    marked = _marked_answer(text)
    return marked if marked is not None else _last_number(text)


def numbers_equal(left: str | None, right: str | None) -> bool:
    """Numeric equality of two extracted answers ("1,000" == "1000.0" == "2000/2"); `False` if either is missing."""
    if left is None or right is None:
        return False
    try:
        return Fraction(left.replace(",", "")) == Fraction(right.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return left.strip() == right.strip()


def gsm8k_solution(answer: str) -> str:
    """The final number of a GSM8K reference answer (the text after `####`)."""
    number = extract_final_number(answer.split("####")[-1])
    if number is None:
        raise ValueError(f"No final number in GSM8K answer: {answer[-80:]!r}")
    return number


def gsm8k_accuracy(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's final number equals the `solution` column numerically, else 0.0."""
    return [
        float(numbers_equal(extract_final_number(completion), str(answer)))
        for completion, answer in zip(completions, solution, strict=True)
    ]


_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def think_answer_format(completions: list, **kwargs) -> list[float]:
    """1.0 for completions of the form `<think>...</think><answer>...</answer>`, else 0.0."""
    return [float(bool(_THINK_ANSWER.match(completion_text(completion)))) for completion in completions]


REWARD_FUNCS: dict[str, Callable] = {
    "exact_match": exact_match,
    "gsm8k_accuracy": gsm8k_accuracy,
    "think_answer_format": think_answer_format,
}


#: TRL's reward functions, by the names `trl grpo` takes (`trl/scripts/grpo.py`); the first two need math-verify.
TRL_REWARD_FUNCS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)
_MATH_VERIFY_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward")


def _as_conversations(func: Callable) -> Callable:
    """`func` (one of TRL's rewards, which read `completion[0]["content"]`) for plain-text completions too: a string
    completion is passed as one assistant message. Keeps `func`'s name, under which TRL logs the reward."""

    @functools.wraps(func)
    def reward(completions: list, **kwargs) -> list:
        messages = [[{"role": "assistant", "content": c}] if isinstance(c, str) else c for c in completions]
        return func(messages, **kwargs)

    return reward


def trl_reward_func(name: str, max_completion_length: int | None = None) -> Callable:
    """One of TRL's reward functions (`TRL_REWARD_FUNCS`) for plain-text completions too;
    `get_soft_overlong_punishment` over this run's `max_completion_length` (`L_cache` a fifth of it). Raises
    `ValueError` without that length, or without math-verify for the rewards that need it."""
    from trl import rewards
    from trl.import_utils import is_math_verify_available

    if name == "get_soft_overlong_punishment":
        if not max_completion_length:
            raise ValueError("get_soft_overlong_punishment needs the run's max_completion_length.")
        return rewards.get_soft_overlong_punishment(
            max_completion_len=max_completion_length, soft_punish_cache=max(1, max_completion_length // 5)
        )
    if name in _MATH_VERIFY_REWARDS and not is_math_verify_available():
        raise ValueError(
            f"Reward function {name!r} (TRL's) verifies answers with math-verify, which is not installed: "
            'pip install "trl-grpo-ext[math]".'
        )
    return _as_conversations(getattr(rewards, name))


def resolve_reward_funcs(names: list[str], max_completion_length: int | None = None) -> list[Callable]:
    """Reward functions by this module's names (`REWARD_FUNCS`), TRL's (`TRL_REWARD_FUNCS`) or import paths
    (`my_pkg.rewards.func` or `my_pkg.rewards:func`, the working directory importable). Raises `ValueError` for an
    empty list or a name that is none of these (naming the closest)."""
    known = f"one of {sorted(REWARD_FUNCS)}, one of TRL's {list(TRL_REWARD_FUNCS)}, or an import path"
    if not names:
        raise ValueError(f"No reward function given; name {known}.")
    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
            continue
        if name in TRL_REWARD_FUNCS:
            funcs.append(trl_reward_func(name, max_completion_length))
            continue
        module_path, separator, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
        if not separator or not module_path:
            close = difflib.get_close_matches(name, [*REWARD_FUNCS, *TRL_REWARD_FUNCS], n=1)
            suggestion = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"Unknown reward function {name!r}{suggestion}: use {known} (my_module.my_reward).")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            func = getattr(importlib.import_module(module_path), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"Cannot import reward function {name!r}: {error}") from error
        if not callable(func):
            raise ValueError(f"Reward function {name!r} is not callable.")
        funcs.append(func)
    return funcs
