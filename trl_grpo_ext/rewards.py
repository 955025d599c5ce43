"""Reward functions for the recipes, and how a recipe finds one by name or import path.

Every function follows TRL's reward-function contract: keyword arguments `prompts`, `completions` and one list per
extra dataset column (`solution` here), returning one float per completion.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from fractions import Fraction

__all__ = [
    "REWARD_FUNCS",
    "completion_text",
    "exact_match",
    "extract_final_number",
    "gsm8k_accuracy",
    "gsm8k_solution",
    "numbers_equal",
    "resolve_reward_funcs",
    "think_answer_format",
]


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


_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)


def _clean_number(text: str) -> str | None:
    match = re.search(_NUMBER, text)
    if match is None:
        return None
    number = match.group(0).replace(",", "").replace("$", "")
    return number.rstrip(".") or None


def extract_final_number(text: str) -> str | None:
    """The final numeric answer of a math completion, as a string without commas or currency signs.

    Looks, in order, inside `<answer>...</answer>`, `\\boxed{...}`, after `####`, after "the answer is", and
    otherwise takes the last number in the text. Returns `None` when there is no number.
    """
    for pattern in (_ANSWER_TAG, _BOXED):
        found = pattern.findall(text)
        if found:
            number = _clean_number(found[-1])
            if number is not None:
                return number
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return _clean_number(found[-1])
    numbers = re.findall(_NUMBER, text)
    return _clean_number(numbers[-1]) if numbers else None


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
        float(numbers_equal(extract_final_number(completion_text(completion)), str(answer)))
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


def resolve_reward_funcs(names: list[str]) -> list[Callable]:
    """Reward functions from registry names (`REWARD_FUNCS`) or import paths (`my_pkg.rewards.func` or
    `my_pkg.rewards:func`; the working directory is importable, as for TRL's own scripts).

    Raises:
        ValueError: for an empty list, or a name that is neither registered nor importable.
    """
    if not names:
        raise ValueError(f"No reward function given; name one of {sorted(REWARD_FUNCS)} or an import path.")
    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
            continue
        module_path, separator, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
        if not separator or not module_path:
            raise ValueError(f"Unknown reward function {name!r}: use one of {sorted(REWARD_FUNCS)} or an import path.")
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
