"""The spread task: the demo's string reversal over lengths 1-9, prompts of many difficulties for the demo model.

The demo task (`trl_grpo_ext/tools/recipes/tiny/data`: lengths 3-6) gives the warmed-up demo model prompts of one
difficulty, so whether a prompt's group of completions has reward spread is close to a coin toss at every visit.
Real RLVR data is not like that for a given model: some prompts are solved, some stay out of reach for the whole run,
and a learnable middle moves. This task builds that from the demo's own task and model, with no download: reversal of
strings of 1 to 9 letters from a-j. For the demo model (sampled at temperature 1, 8 completions per prompt, before
any GRPO step; `python -m benchmarks.spread`) the lengths fall into three bands:

- length 1 (10 words, 2% of the prompts): easy, about 0.6 of the completions right from the start;
- lengths 3-6 (the warm-up's lengths, about 64%): the learnable middle, 0.08-0.30 of the completions right;
- lengths 2 and 7-9 (never seen in the warm-up, about 34%): out of reach, 0.01 of the completions right or none;
  0.95 of their groups of 8 completions and more are all wrong.

No prompt is solved 8 times out of 8 at the start; some become so in training.

`make_spread_splits` draws the rows, deterministic given the seed; `starting_difficulty` (`python -m
benchmarks.spread`) measures the bands above; `flatness_statistics` measures what GRESO
(arXiv 2506.02177) measures on a run: the share of groups without reward spread over training, and how well one
visit of a prompt predicts the next.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping

from .reversal import ALPHABET, SEPARATOR

__all__ = ["BANDS", "LENGTH_WEIGHTS", "band_of", "flatness_statistics", "make_spread_splits", "starting_difficulty"]

#: Relative weight of each string length when a row is drawn (length 1 has only 10 distinct words, so it is capped).
LENGTH_WEIGHTS: Mapping[int, int] = {1: 1, 2: 2, 3: 3, 4: 3, 5: 3, 6: 3, 7: 2, 8: 2, 9: 2}
#: The difficulty band of each length for the demo model, measured before training (see the module docstring).
BANDS: Mapping[str, tuple[int, ...]] = {"easy": (1,), "learnable": (3, 4, 5, 6), "out_of_reach": (2, 7, 8, 9)}


def band_of(prompt: str) -> str:
    """The difficulty band of a spread-task prompt (`"abc="`): `easy`, `learnable` or `out_of_reach`."""
    length = len(prompt.rstrip(SEPARATOR))
    return next(band for band, lengths in BANDS.items() if length in lengths)


def make_spread_splits(num_train: int, num_test: int, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and test rows `{"prompt": "abc=", "solution": "cba"}` whose lengths follow `LENGTH_WEIGHTS`,
    the same for the same seed.

    Rows are drawn one at a time (a length by its weight, then its letters) and a word already drawn is drawn again,
    so the 10 one-letter words appear at most once across both splits.

    Raises:
        ValueError: if more rows are asked for than the lengths hold.
    """
    lengths = list(LENGTH_WEIGHTS)
    weights = [LENGTH_WEIGHTS[length] for length in lengths]
    if num_train + num_test > sum(len(ALPHABET) ** length for length in lengths) // 2:
        raise ValueError(f"{num_train + num_test} rows are too many for the spread task.")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < num_train + num_test:
        length = rng.choices(lengths, weights)[0]
        word = "".join(rng.choice(ALPHABET) for _ in range(length))
        if word in seen:
            continue
        seen.add(word)
        rows.append({"prompt": word + SEPARATOR, "solution": word[::-1]})
    return rows[:num_train], rows[num_train:]


def flatness_statistics(visits: Iterable[tuple[int, str, float]], steps: int, parts: int = 4) -> dict:
    """How flat the groups of a run were and how predictable that was, from its visits.

    Args:
        visits (`Iterable[tuple[int, str, float]]`): one per group generated in training, in order: the training step
            it was generated at, its prompt, and the mean reward of its completions when they all got the same reward
            (0.0 all wrong, 1.0 all right for exact match), NaN when they differ.
        steps (`int`): the run's training steps (for the parts of training).
        parts (`int`): how many equal parts of training `zero_spread_by_part` has.

    Returns:
        `dict` with `groups`; `zero_spread` (the share of groups without spread) and `zero_spread_by_part` (the same
        per part of training, first to last); `all_wrong` and `all_right` (the shares of groups flat at 0 and at 1);
        for consecutive visits of one prompt: `pairs`, `flat_after_flat` (the probability that a prompt flat at one
        visit is flat at the next; None without such pairs) and `flat_after_spread` (the same after a visit with
        spread); and `revisited` (the share of groups whose prompt had a visit before).
    """
    visits = list(visits)
    flat = [value == value for _, _, value in visits]  # NaN != NaN: a group with spread
    by_part: list[list[bool]] = [[] for _ in range(parts)]
    for (step, _, _), is_flat in zip(visits, flat, strict=True):
        by_part[min(parts - 1, step * parts // max(steps, 1))].append(is_flat)
    last: dict[str, bool] = {}
    after: dict[bool, list[bool]] = {True: [], False: []}
    for (_, prompt, _), is_flat in zip(visits, flat, strict=True):
        if prompt in last:
            after[last[prompt]].append(is_flat)
        last[prompt] = is_flat

    def share(values: list[bool]) -> float | None:
        return statistics.mean(values) if values else None

    return {
        "groups": len(visits),
        "zero_spread": share(flat),
        "zero_spread_by_part": [share(part) for part in by_part],
        "all_wrong": share([value == 0.0 for _, _, value in visits]),
        "all_right": share([value == 1.0 for _, _, value in visits]),
        "pairs": len(after[True]) + len(after[False]),
        "flat_after_flat": share(after[True]),
        "flat_after_spread": share(after[False]),
        "revisited": (len(after[True]) + len(after[False])) / len(visits) if visits else None,
    }


def starting_difficulty(prompts: int = 500, generations: int = 8, seed: int = 0) -> dict[int, dict]:
    """The demo model's difficulty of each length before training, on the first `prompts` training prompts.

    Each prompt gets `generations` completions, sampled as the demo trains (temperature 1, up to 10 tokens).

    Returns:
        `dict` length -> `{"prompts", "accuracy", "all_wrong", "all_right"}`: the prompts of that length, the share of
        their completions that are right, and the shares of their groups all wrong and all right.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.extras.generation import SamplingSettings, generate_completions
    from trl_grpo_ext.tools.recipes.demo import DEMO_MODEL

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    rows, _ = make_spread_splits(prompts, 0)
    repeated = [row["prompt"] for row in rows for _ in range(generations)]
    completions = generate_completions(
        model, tokenizer, repeated, SamplingSettings(max_completion_length=10), seed=seed
    )
    right = [completion.strip() == prompt[:-1][::-1] for completion, prompt in zip(completions, repeated, strict=True)]
    groups: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(len(row["solution"]), []).append(sum(right[index * generations : (index + 1) * generations]))
    return {
        length: {
            "prompts": len(counts),
            "accuracy": sum(counts) / (len(counts) * generations),
            "all_wrong": statistics.mean(count == 0 for count in counts),
            "all_right": statistics.mean(count == generations for count in counts),
        }
        for length, counts in sorted(groups.items())
    }


if __name__ == "__main__":  # python -m benchmarks.spread: the bands of the module docstring
    from .common import format_table

    table = starting_difficulty()
    headers = ["length", "band", "prompts", "completions right", "groups all wrong", "groups all right"]
    print(
        format_table(
            headers,
            [
                [length, band_of("a" * length), row["prompts"], f"{row['accuracy']:.2f}", f"{row['all_wrong']:.2f}",
                 f"{row['all_right']:.2f}"]
                for length, row in table.items()
            ],
        )
    )  # fmt: skip
