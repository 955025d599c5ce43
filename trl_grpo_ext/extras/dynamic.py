"""Dynamic sampling (DAPO's, `GRPOConfigExt.dynamic_sampling`): the groups without reward spread of a generation batch
replaced by informative groups generated for fresh prompts.

`DynamicSampler.generate` lets TRL generate and score the batch, drops the groups without spread
(`plan.informative_groups`), and has TRL generate and score extra rounds of fresh prompts (`plan.PromptStream`), at
most `dynamic_sampling_max_rounds`, each sized to what the batch still lacks (`plan.extra_round_rows`, `KeepRate`). A
group takes only the place of one with the same placement over the processes (`plan.fill_slots`): no row moves
between processes. Places left empty keep the groups TRL sampled first, so the batch keeps its shape. The advantages
of the assembled batch are TRL's (`plan.trl_advantages`); its rows are padded again; TRL's metrics and completions
table describe it. Every decision is taken on gathered rewards, alike on every process, and checked.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from trl.trainer.utils import pad

from ..metrics import (
    DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED,
    DYNAMIC_SAMPLING_GENERATED_GROUPS,
    DYNAMIC_SAMPLING_KEPT_FRACTION,
    DYNAMIC_SAMPLING_ROUNDS,
    DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO,
    DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH,
)
from .generation import eos_token_ids
from .plan import (
    RUNNING_TOTALS,
    PromptKeys,
    PromptStream,
    combine_round_metrics,
    extra_round_rows,
    fill_slots,
    gathered,
    group_placement,
    group_spread,
    position_checksum,
    trl_advantages,
    trl_reward_metrics,
)

__all__ = ["DynamicSampler", "KeepRate"]

# Per-row tensors of TRL's generation batch: the side they are padded on and the padding value ("pad": the token).
_ROW_TENSORS = {
    "prompt_ids": ("left", "pad"),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", "pad"),
    "completion_mask": ("right", 0),
    "tool_mask": ("right", 1),
    "old_per_token_logps": ("right", 0.0),
    "ref_per_token_logps": ("right", 0.0),
    "sampling_per_token_logps": ("right", 0.0),
    "importance_sampling_ratio": ("right", 1.0),
}
_RECOMPUTED = ("advantages", "num_items_in_batch")


@dataclass
class _Round:
    """One generation batch TRL generated and scored."""

    output: dict[str, Any]  # TRL's batch, this process's rows
    scored: Any  # its `trainer.ScoredBatch`
    informative: torch.Tensor  # (K,) bool, per group
    frac_reward_zero_std: float
    logs: dict[str, Any]  # its rows of TRL's completions table (every process's)
    local_rows: int  # rows per process
    placements: list[tuple]  # `plan.group_placement` of the round
    truncated: torch.Tensor  # (n,) bool: this process's completions cut at max_completion_length
    metrics: dict[str, list[float]]  # the values TRL's call appended to `_metrics`


class KeepRate:
    """The share of generated groups that were informative, which extra rounds are sized with: the current generation
    batch's counts plus those of the batches before, decayed by `decay` per batch. Two floats, alike on every process.
    """

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.kept = self.generated = 0.0

    def estimate(self, kept: int, generated: int) -> float:
        """The share, with the current batch's `kept` of `generated` groups so far (0 when nothing was generated)."""
        total = self.generated + generated
        return (self.kept + kept) / total if total else 0.0

    def update(self, kept: int, generated: int) -> None:
        """Fold a finished generation batch in."""
        self.kept = self.decay * self.kept + kept
        self.generated = self.decay * self.generated + generated

    def state_dict(self) -> dict[str, float]:
        return {"kept": self.kept, "generated": self.generated}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.kept, self.generated = float(state["kept"]), float(state["generated"])


class DynamicSampler:
    """Dynamic sampling for a `GRPOTrainer` (see the module docstring).

    Args:
        trainer (`GRPOTrainer`): its data, options and accelerator are read; TRL's `_metrics` and `_logs` are
            rewritten for the batch that trains.
        max_rounds (`int`): the most extra rounds per generation batch.
        margin (`float`): an extra round generates this many times the groups it is expected to need.
        selective (`selective.SelectiveRollouts`, *optional*): selective rollouts, whose prompt stream this draws from.

    Raises:
        ValueError: for a training set that is not map-style (fresh prompts are drawn by index).
    """

    def __init__(self, trainer, max_rounds: int, margin: float = 1.1, selective=None):
        dataset = trainer.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                "dynamic_sampling draws fresh prompts by index: it needs a map-style `train_dataset` (a "
                "datasets.Dataset), not an IterableDataset. Load the dataset without `streaming=True`, or set "
                "dynamic_sampling=False."
            )
        self.trainer, self.max_rounds = trainer, max_rounds
        self.margin, self.selective = margin, selective
        #: The fresh prompts of the extra rounds, and the share of informative groups (both resumable).
        if selective is not None:
            self.stream = selective.stream
        else:
            self.stream = PromptStream(len(dataset), trainer.args.seed, shuffle=trainer.shuffle_dataset)
        self.keep_rate = KeepRate()
        self._sampling_dataset = None
        self._prompt_keys = selective.prompt_keys if selective is not None else PromptKeys(dataset)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        # What ends a completion that was not cut at max_completion_length (TRL's `completions/clipped_ratio`).
        self._completion_ends = torch.tensor([*eos_token_ids(trainer.model, tokenizer), tokenizer.pad_token_id])

    def generate(self, inputs: list[dict], generate_and_score: Callable) -> tuple[dict[str, Any], Any]:
        """The batch that trains and its rewards.

        Args:
            inputs (`list[dict]`): this process's rows of the generation batch (TRL's sampler's).
            generate_and_score (`Callable[[list[dict]], tuple[dict, ScoredBatch]]`): TRL's generation and scoring of
                one generation batch, with what it scored (`GRPOTrainerExt._generate_and_score`).

        Returns:
            `(output, scored)`: TRL's batch for this process with each dropped group replaced where an informative one
            was found and the assembled batch's advantages, and that batch's `ScoredBatch`.
        """
        trainer = self.trainer
        num_generations = trainer.num_generations
        num_processes = trainer.accelerator.num_processes
        metrics = trainer._metrics["train"]
        lengths_before = {name: len(values) for name, values in metrics.items()}
        local_rows = len(inputs)
        selection = None
        if self.selective is not None:
            selection, inputs = self.selective.prepare(inputs)
        rounds = [self._scored_round(inputs, generate_and_score, local_rows, selection)]
        # The prompts the batch holds (every process's); TRL's table has them also without selective rollouts
        if selection is not None:
            taken = {self._prompt_keys(prompt) for prompt in selection.prompts}
        else:
            taken = self._prompt_keys.of(rounds[0].logs["prompt"])
        placements = rounds[0].placements
        assignment, short = fill_slots([r.informative for r in rounds], placements)
        self._check_processes_agree(rounds[-1], short)
        while short and len(rounds) <= self.max_rounds:
            kept = sum(int(r.informative.sum()) for r in rounds)
            generated = sum(r.informative.numel() for r in rounds)
            lacking = Counter(
                placements[group]
                for round_index, group in assignment
                if round_index == 0 and not rounds[0].informative[group]
            )
            rows = extra_round_rows(
                lacking,
                self.keep_rate.estimate(kept, generated),
                self.margin,
                local_rows,
                num_processes,
                num_generations,
            )
            fresh, selection = self._fresh_inputs(num_processes * rows // num_generations, rows, taken)
            rounds.append(self._scored_round(fresh, generate_and_score, rows, selection))
            assignment, short = fill_slots([r.informative for r in rounds], placements, [r.placements for r in rounds])
            self._check_processes_agree(rounds[-1], short)
        kept = sum(int(r.informative.sum()) for r in rounds)
        generated = sum(r.informative.numel() for r in rounds)
        self.keep_rate.update(kept, generated)
        if self.selective is not None:
            self.selective.finish(metrics)

        # Per global row of the batch that trains: (round, global row in that round)
        sources = [(r, group * num_generations + row) for r, group in assignment for row in range(num_generations)]
        rewards_per_func = torch.stack([rounds[r].scored.rewards_per_func[row] for r, row in sources])
        advantages, is_std_zero, _ = trl_advantages(
            rewards_per_func,
            trainer.reward_weights,
            num_generations,
            trainer.scale_rewards,
            trainer.multi_objective_aggregation,
        )
        process = trainer.accelerator.process_index
        start = process * local_rows
        local_sources = [(r, row - process * rounds[r].local_rows) for r, row in sources[start : start + local_rows]]
        output = rounds[0].output if len(rounds) == 1 else self._assemble(rounds, local_sources)
        output["advantages"] = advantages[start : start + local_rows]
        lengths = torch.stack([rounds[r].scored.lengths[row] for r, row in local_sources])
        truncated = torch.stack([rounds[r].truncated[row] for r, row in local_sources])

        # TRL's reward metrics of the batch that trains, in place of each round's; its other metrics of each call
        # (completions/*, ...) as one value for everything generated
        trained = trl_reward_metrics(rewards_per_func, trainer.reward_weights, trainer.reward_func_names, is_std_zero)
        per_call = [{k: v for k, v in r.metrics.items() if k not in trained} for r in rounds]
        generated_rows = [r.scored.rewards_per_func.size(0) for r in rounds]
        for name, value in {**combine_round_metrics(per_call, generated_rows), **trained}.items():
            del metrics[name][lengths_before.get(name, 0) :]
            metrics[name].append(value)
        metrics[DYNAMIC_SAMPLING_KEPT_FRACTION].append(kept / generated)
        metrics[DYNAMIC_SAMPLING_ROUNDS].append(float(len(rounds) - 1))
        metrics[DYNAMIC_SAMPLING_GENERATED_GROUPS].append(float(generated))
        zero_std = sum(r.frac_reward_zero_std * r.informative.numel() for r in rounds) / generated
        metrics[DYNAMIC_SAMPLING_FRAC_REWARD_ZERO_STD_GENERATED].append(zero_std)
        local = torch.stack([lengths.to(torch.float64), truncated.to(torch.float64)], dim=1)
        trained = trainer.accelerator.gather(local.to(trainer.accelerator.device)).cpu()
        metrics[DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH].append(trained[:, 0].mean().item())
        metrics[DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO].append(trained[:, 1].mean().item())
        self._rewrite_completions_table(rounds, sources, advantages)
        return output, replace(rounds[0].scored, rewards_per_func=rewards_per_func, lengths=lengths, first_row=start)

    def _scored_round(self, inputs: list[dict], generate_and_score, local_rows: int, selection=None) -> _Round:
        """`inputs` generated and scored (`local_rows` rows on each process); with selective rollouts, its groups
        update their prompts' histories."""
        trainer = self.trainer
        # Emptied, so that what the call leaves in TRL's table is this round's rows; the table of the batch that
        # trains is written once every round is in (`_rewrite_completions_table`).
        for name in ("prompt", "completion", "advantages"):
            trainer._logs[name].clear()
        for column in (*trainer._logs["rewards"].values(), *trainer._logs["extra"].values()):
            column.clear()
        trainer._logs["extra"].clear()
        metrics = trainer._metrics["train"]
        before = {name: len(values) for name, values in metrics.items()}
        output, scored = generate_and_score(inputs)
        appended = {
            name: list(values[before.get(name, 0) :])
            for name, values in metrics.items()
            if name not in RUNNING_TOTALS and len(values) > before.get(name, 0)
        }
        unknown = sorted(set(output) - set(_ROW_TENSORS) - set(_RECOMPUTED))
        if unknown:  # the same keys on every process: all of them raise
            raise ValueError(
                f"dynamic_sampling cannot assemble a batch that holds {unknown} (multimodal inputs): their tensors "
                "are not one row per completion. Set dynamic_sampling=False for this model."
            )
        informative, is_std_zero = group_spread(trainer, scored.rewards_per_func)
        logs = {
            "prompt": list(trainer._logs["prompt"]),
            "completion": list(trainer._logs["completion"]),
            "rewards": {name: list(values) for name, values in trainer._logs["rewards"].items()},
            "extra": {name: list(values) for name, values in trainer._logs["extra"].items()},
        }
        if selection is not None:
            self.selective.observe(selection, informative)
        # A completion is cut where its last token (`lengths` counts them) ends nothing
        last = output["completion_ids"].gather(1, (scored.lengths - 1).clamp(min=0)[:, None])[:, 0]
        truncated = (scored.lengths == 0) | ~torch.isin(last, self._completion_ends.to(last.device))
        return _Round(
            output=output,
            scored=scored,
            informative=informative,
            frac_reward_zero_std=is_std_zero.float().mean().item(),
            logs=logs,
            local_rows=local_rows,
            placements=group_placement(informative.numel(), trainer.num_generations, local_rows),
            truncated=truncated,
            metrics=appended,
        )

    def _fresh_inputs(self, num_groups: int, local_rows: int, taken: set) -> tuple[list[dict], Any]:
        """This process's rows of a round of `num_groups` fresh prompts, laid out as TRL's sampler lays out a
        generation batch, and the round's selection (`None` without selective rollouts). Prompts whose key is in
        `taken` are passed over; the round's own are added to it."""
        start = self.trainer.accelerator.process_index * local_rows
        if self.selective is not None:
            selection = self.selective.draw(num_groups, taken)  # the same on every process
            return self.selective.rows(selection, start, local_rows), selection
        if self._sampling_dataset is None:  # the columns the data loader hands out
            self._sampling_dataset = self.trainer._remove_unused_columns(
                self.trainer.train_dataset, description="training"
            )
        prompts = self.stream.draw(num_groups, taken, self._prompt_keys)  # the same on every process
        indices = [index for index in prompts for _ in range(self.trainer.num_generations)]
        return [self._sampling_dataset[index] for index in indices[start : start + local_rows]], None

    def _check_processes_agree(self, last: _Round, short: int) -> None:
        """Raise, on every process alike, if the processes hold different numbers of rows or took different
        decisions (one gather of three numbers)."""
        num_processes = self.trainer.accelerator.num_processes
        table = gathered(self.trainer.accelerator, last.local_rows, position_checksum(last.informative), short)
        if not torch.equal(table[:, 0], torch.full_like(table[:, 0], table[0, 0].item())):
            raise RuntimeError(
                f"dynamic_sampling: the processes hold different numbers of rows ({table[:, 0].long().tolist()}) in "
                "a generation batch; it needs the same number on every process (TRL's sampler with a map-style "
                "dataset gives that)."
            )
        total_rows = last.scored.rewards_per_func.size(0)
        if total_rows != last.local_rows * num_processes:
            raise RuntimeError(
                f"dynamic_sampling: {total_rows} rewards were gathered for {num_processes} processes of "
                f"{last.local_rows} rows each."
            )
        if not torch.equal(table, table[:1].expand_as(table)):
            raise RuntimeError(
                "dynamic_sampling: the processes took different keep/drop decisions on the same gathered rewards "
                f"(checksums and places left {table[:, 1:].tolist()}); a reward or device that is not deterministic "
                "across processes can cause this."
            )

    def _assemble(self, rounds: list[_Round], local_sources: list[tuple[int, int]]) -> dict[str, Any]:
        """This process's batch: row `i` is row `local_sources[i][1]` of round `local_sources[i][0]`, padded again."""
        trainer = self.trainer
        pad_id = getattr(trainer.processing_class, "tokenizer", trainer.processing_class).pad_token_id
        output = {}
        for key, value in rounds[0].output.items():
            if key in _RECOMPUTED or value is None:
                continue
            side, padding = _ROW_TENSORS[key]
            output[key] = pad(
                [rounds[r].output[key][row] for r, row in local_sources],
                padding_value=pad_id if padding == "pad" else padding,
                padding_side=side,
                pad_to_multiple_of=trainer.pad_to_multiple_of,
            )
        loss_mask = output["completion_mask"]
        if "tool_mask" in output:
            loss_mask = loss_mask * output["tool_mask"]
        output["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()  # as TRL counts it
        return output

    def _rewrite_completions_table(self, rounds: list[_Round], sources, advantages: torch.Tensor) -> None:
        """TRL's completions table (`_logs`, one generation batch) holds the rows that train."""
        logs, size = self.trainer._logs, len(sources)
        logs["prompt"] = deque((rounds[r].logs["prompt"][row] for r, row in sources), maxlen=size)
        logs["completion"] = deque((rounds[r].logs["completion"][row] for r, row in sources), maxlen=size)
        for name, column in logs["rewards"].items():
            column.clear()
            column.extend(rounds[r].logs["rewards"][name][row] for r, row in sources)
        logs["advantages"] = deque(advantages.tolist(), maxlen=size)
        logs["extra"].clear()
        for name in sorted({name for r in rounds for name in r.logs["extra"]}):
            values = [rounds[r].logs["extra"].get(name) for r, _ in sources]
            logs["extra"][name].extend(
                None if column is None else column[row] for column, (_, row) in zip(values, sources, strict=True)
            )
