"""Selective rollouts (`GRPOConfigExt.selective_rollouts`), experimental: skip, before generation, the prompts that
had no reward spread on their last visits (GRESO's idea, arXiv 2506.02177).

Each training prompt carries a streak: its most recent visits in a row without spread. A prompt whose streak reaches
`history` is predicted flat and generated for only with probability `p ** (streak - history + 1)`; a skipped prompt is
replaced in its place by the next fresh prompt of the stream (`plan.PromptStream`), judged the same way. After
scoring, the groups update the streaks and `p` moves towards the target share of groups without spread. Decisions
are taken alike on every process (gathered prompts and rewards, seeded draws) and checked.

Measured limits: on two small tasks it did not pay alone, nor on prompts visited once (nothing recurs to predict);
with dynamic sampling it saved generation but ended below dynamic sampling alone in accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import option
from ..metrics import (
    SELECTIVE_ROLLOUTS_EXPLORATION_PROBABILITY,
    SELECTIVE_ROLLOUTS_PRECISION,
    SELECTIVE_ROLLOUTS_PREDICTED_FLAT,
    SELECTIVE_ROLLOUTS_SKIPPED_PROMPTS,
    SELECTIVE_ROLLOUTS_ZERO_SPREAD,
)
from .plan import PromptKeys, PromptStream, gathered, group_spread, position_checksum

__all__ = ["INDEX_COLUMN", "SelectiveRollouts", "Selection", "selective_options", "strip_index"]

#: The training-set column that holds each row's index while selective rollouts are on.
INDEX_COLUMN = "_trl_grpo_ext_prompt_index"


def selective_options(args) -> dict:
    """`SelectiveRollouts`' options from the configuration's `selective_rollouts_*` fields."""
    options = {
        name: option(args, f"selective_rollouts_{name}") for name in ("history", "target_zero_spread", "exploration")
    }
    low, high, step = option(args, "selective_rollouts_exploration_schedule")
    return {**options, "exploration_min": low, "exploration_max": high, "exploration_step": step}


def strip_index(rows: list[dict]) -> list[dict]:
    """`rows` without `INDEX_COLUMN`: what TRL's generation and the reward functions receive."""
    return [{key: value for key, value in row.items() if key != INDEX_COLUMN} for row in rows]


@dataclass
class Selection:
    """The prompts of one generation round, per group, alike on every process: their training-set indices
    (`prompts`), and whether each was predicted flat and generated for anyway (`explored`)."""

    prompts: list[int]
    explored: list[bool] = field(default_factory=list)


class SelectiveRollouts:
    """Selective rollouts for a `GRPOTrainer` (see the module docstring).

    Args:
        trainer (`GRPOTrainer`): its training set gets `INDEX_COLUMN`; its options, accelerator and metrics are read.
        history (`int`): visits without spread in a row after which a prompt is predicted flat (>= 1).
        target_zero_spread (`float`): the share of generated groups without spread that `p` steers towards.
        exploration, exploration_min, exploration_max (`float`): the initial exploration probability `p`, its bounds.
        exploration_step (`float`): how far `p` moves after each generation batch.
        stream (`PromptStream`, *optional*): the stream replacements are drawn from; default: a new one.

    Raises:
        ValueError: for a training set that is not a map-style `datasets.Dataset`.
    """

    # Kept apart from the seeds of TRL's sampler and of the prompt stream.
    SEED_OFFSET = 0x5E1EC7

    def __init__(
        self,
        trainer,
        *,
        history: int = 1,
        target_zero_spread: float = 0.25,
        exploration: float = 0.5,
        exploration_min: float = 0.05,
        exploration_max: float = 1.0,
        exploration_step: float = 0.01,
        stream: PromptStream | None = None,
    ):
        from datasets import Dataset

        dataset = trainer.train_dataset
        if not isinstance(dataset, Dataset):
            raise ValueError(
                "selective_rollouts identifies prompts by their index in the training set: it needs a map-style "
                "`train_dataset` (a datasets.Dataset), not an IterableDataset or another kind. Load the dataset "
                "without `streaming=True`, or set selective_rollouts=False."
            )
        if INDEX_COLUMN in dataset.column_names:
            raise ValueError(f"The training set has a column named {INDEX_COLUMN!r}, which selective_rollouts uses.")
        trainer.train_dataset = dataset.add_column(INDEX_COLUMN, list(range(len(dataset))))
        # With remove_unused_columns=True, Trainer keeps only the signature columns: keep the index too.
        trainer._set_signature_columns_if_needed()
        trainer._signature_columns = [*trainer._signature_columns, INDEX_COLUMN]
        self.trainer = trainer
        self.history, self.target = history, target_zero_spread
        self.exploration_min, self.exploration_max, self.step = exploration_min, exploration_max, exploration_step
        self.stream = stream or PromptStream(len(dataset), trainer.args.seed, shuffle=trainer.shuffle_dataset)
        #: What makes two training prompts the same (a replacement never repeats a prompt of its batch).
        self.prompt_keys = PromptKeys(dataset)
        #: Per training prompt, its most recent visits without reward spread in a row (resumable).
        self.streak = torch.zeros(len(dataset), dtype=torch.int32)
        self.exploration = float(exploration)
        self.decisions = 0  # decisions taken so far: the seed of the next one's draws
        self._rows = None
        self._batch = _BatchCounts()
        self._visits: dict[int, tuple[int, bool]] = {}  # prompt -> (streak before this batch, spread in this batch)

    # Deciding

    def _judge(self, prompts: list[int]) -> tuple[list[bool], list[bool]]:
        """Per prompt: (generate it, it was predicted flat). Draws from the generator of this decision."""
        generator = torch.Generator().manual_seed(self.trainer.args.seed + self.SEED_OFFSET + self.decisions)
        self.decisions += 1
        streaks = self.streak[torch.tensor(prompts, dtype=torch.long)]
        draws = torch.rand(len(prompts), generator=generator, dtype=torch.float64)
        flat = streaks >= self.history
        chance = torch.where(flat, self.exploration ** (streaks - self.history + 1).double(), 1.0)
        keep = draws < chance
        self._batch.considered += len(prompts)
        self._batch.predicted_flat += int(flat.sum())
        return keep.tolist(), flat.tolist()

    def _replace(self, prompts: list[int], taken: set) -> Selection:
        """`prompts` with each skipped one replaced by the next accepted prompt of the stream, in its place; the
        stream passes over the prompts whose key is in `taken` (those of the batch), and adds those it draws."""
        keep, flat = self._judge(prompts)
        selection = Selection(list(prompts), [f and k for f, k in zip(flat, keep, strict=True)])
        empty = [place for place, kept in enumerate(keep) if not kept]
        self._batch.skipped += len(empty)
        drawn, limit = 0, len(self.streak)  # at most one pass over the training set per call
        while empty:
            candidates = self.stream.draw(len(empty), taken, self.prompt_keys)
            drawn += len(candidates)
            forced = drawn >= limit  # every prompt predicted flat: take the candidates as they are
            keep, flat = self._judge(candidates)
            rest = []
            for place, candidate, kept, predicted in zip(empty, candidates, keep, flat, strict=True):
                if kept or forced:
                    selection.prompts[place], selection.explored[place] = candidate, predicted
                else:
                    self._batch.skipped += 1
                    rest.append(place)
            empty = rest
        self._check_processes_agree(selection)
        return selection

    def _check_processes_agree(self, selection: Selection) -> None:
        """Raise, on every process alike, if the processes decided for different prompts (one gather of two numbers
        per round; nothing with one process)."""
        if self.trainer.accelerator.num_processes == 1:
            return
        checksum = position_checksum(torch.tensor(selection.prompts, dtype=torch.float64))
        table = gathered(self.trainer.accelerator, self.decisions, checksum)
        if not torch.equal(table, table[:1].expand_as(table)):
            raise RuntimeError(
                "selective_rollouts: the processes decided for different prompts (decision counts and checksums "
                f"{table.tolist()}); their prompt histories differ (a process resumed from another checkpoint, or a "
                "reward that is not deterministic across processes)."
            )

    def prepare(self, inputs: list[dict]) -> tuple[Selection, list[dict]]:
        """The prompts of the generation batch TRL's sampler handed out (`inputs`: this process's rows), each
        predicted-flat one skipped and replaced; returns them and this process's rows (without `INDEX_COLUMN`)."""
        trainer = self.trainer
        num_generations = trainer.num_generations
        local = torch.tensor([row[INDEX_COLUMN] for row in inputs], dtype=torch.long)
        indices = trainer.accelerator.gather(local.to(trainer.accelerator.device)).cpu()
        groups = indices.view(-1, num_generations)
        if not torch.equal(groups, groups[:, :1].expand_as(groups)):
            raise RuntimeError(
                "selective_rollouts: TRL's sampler handed out rows whose groups of num_generations do not share one "
                "prompt; the rows of a generation batch must be laid out prompt by prompt."
            )
        prompts = groups[:, 0].tolist()
        selection = self._replace(prompts, {self.prompt_keys(prompt) for prompt in prompts})
        if selection.prompts == prompts:
            return selection, strip_index(inputs)  # nothing skipped: TRL's rows as they are
        start = trainer.accelerator.process_index * len(inputs)
        return selection, self.rows(selection, start, len(inputs))

    def draw(self, count: int, taken: set) -> Selection:
        """`count` fresh prompts from the stream, predicted-flat ones skipped (for dynamic sampling's extra rounds),
        none whose key is in `taken` (the prompts of the batch; those drawn are added)."""
        return self._replace(self.stream.draw(count, taken, self.prompt_keys), taken)

    def rows(self, selection: Selection, start: int, count: int) -> list[dict]:
        """Rows `start .. start + count` of the round `selection` (each prompt `num_generations` times in a row, as
        TRL's sampler lays them out), as the data loader hands them out, without `INDEX_COLUMN`."""
        if self._rows is None:
            self._rows = self.trainer._remove_unused_columns(self.trainer.train_dataset, description="training")
        num_generations = self.trainer.num_generations
        indices = [prompt for prompt in selection.prompts for _ in range(num_generations)][start : start + count]
        return strip_index([self._rows[index] for index in indices])

    # Learning from what was generated

    def observe(self, selection: Selection, informative: torch.Tensor) -> None:
        """Update the streaks of a generated round's prompts from `informative`, `(K,)` bool per group: a generation
        batch is one visit of each of its prompts, with spread when one of the prompt's groups had spread."""
        for prompt, ok, explored in zip(selection.prompts, informative.tolist(), selection.explored, strict=True):
            before, spread = self._visits.get(prompt, (int(self.streak[prompt]), False))
            self._visits[prompt] = (before, spread or ok)
            self.streak[prompt] = 0 if spread or ok else before + 1
            self._batch.generated += 1
            self._batch.flat += not ok
            if explored:
                self._batch.explored += 1
                self._batch.explored_flat += not ok

    def finish(self, metrics: dict[str, list]) -> None:
        """After a generation batch's last round: log its metrics and move the exploration probability."""
        batch, self._batch = self._batch, _BatchCounts()
        self._visits = {}
        metrics[SELECTIVE_ROLLOUTS_SKIPPED_PROMPTS].append(float(batch.skipped))
        metrics[SELECTIVE_ROLLOUTS_EXPLORATION_PROBABILITY].append(self.exploration)
        if batch.considered:
            metrics[SELECTIVE_ROLLOUTS_PREDICTED_FLAT].append(batch.predicted_flat / batch.considered)
        if batch.explored:
            metrics[SELECTIVE_ROLLOUTS_PRECISION].append(batch.explored_flat / batch.explored)
        if batch.generated:
            zero_spread = batch.flat / batch.generated
            metrics[SELECTIVE_ROLLOUTS_ZERO_SPREAD].append(zero_spread)
            step = -self.step if zero_spread > self.target else self.step
            self.exploration = min(self.exploration_max, max(self.exploration_min, self.exploration + step))

    def generate(self, inputs: list[dict], generate_and_score: Callable) -> tuple[dict[str, Any], Any]:
        """Without dynamic sampling: the selected prompts generated and scored.

        Args:
            inputs: this process's rows of the generation batch (TRL's sampler's).
            generate_and_score (`Callable[[list[dict]], tuple[dict, ScoredBatch]]`): TRL's generation and scoring of
                a generation batch, with what it scored (`GRPOTrainerExt._generate_and_score`).
        """
        selection, rows = self.prepare(inputs)
        output, scored = generate_and_score(rows)
        self.observe(selection, group_spread(self.trainer, scored.rewards_per_func)[0])
        self.finish(self.trainer._metrics["train"])
        return output, scored

    # Resume

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak.clone(), "exploration": self.exploration, "decisions": self.decisions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = state["streak"].clone().to(torch.int32)
        self.exploration, self.decisions = float(state["exploration"]), int(state["decisions"])
        self._batch, self._visits = _BatchCounts(), {}


@dataclass
class _BatchCounts:
    """What one generation batch's decisions and outcomes add up to (for its metrics)."""

    considered: int = 0
    predicted_flat: int = 0
    skipped: int = 0
    generated: int = 0
    flat: int = 0
    explored: int = 0
    explored_flat: int = 0
