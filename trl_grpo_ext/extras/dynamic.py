"""Dynamic sampling (DAPO's, `GRPOConfigExt.dynamic_sampling`): train on groups whose rewards differ.

A group whose completions all get the same reward has advantage 0: it gives no policy gradient (only the KL term).
`DynamicSampler.generate` (called by `GRPOTrainerExt._generate_and_score_completions`) lets TRL generate and score
its generation batch as usual, drops the groups without reward spread (`plan.informative_groups`), and generates and
scores, with TRL's own code path, extra rounds of fresh training prompts (`plan.PromptStream`), at most
`dynamic_sampling_max_rounds` of them, until every dropped group has been replaced by an informative one. Each extra
round generates only what the batch still lacks: `dynamic_sampling_round_margin` times the missing groups divided by
the share of groups kept so far (`KeepRate`: this batch's rounds and, decayed, the batches before), rounded up to a
round layout (`plan.extra_round_rows`), at most a whole generation batch. The advantages are then computed on the
assembled batch as TRL computes them on a batch (`plan.trl_advantages`: group, batch or no scaling, either
multi-objective aggregation), and `num_items_in_batch` is recounted.

A batch that stays short after the last round keeps, in the places not filled, the zero-spread groups TRL sampled
first: the batch keeps its shape, so every process still trains the same number of rows and micro-batches, and
`steps_per_generation`, gradient accumulation and the loss normalisations stay those of the configuration; those
groups add only the KL term (nothing when `beta == 0`; `skip_zero_advantage_rows` then leaves them out of the
forward), where shrinking the batch would make micro-batches uneven across processes and change every denominator.

Several processes. TRL's sampler lays a generation batch out group by group over the processes, and a group can span
two. An extra round of `r` rows per process is laid out the same way (global row `i` on process `i // r`, the same
`r` on every process: TRL's reward gathering and vLLM's generation are collectives over equal shares). A group only
takes the place of one with the same placement (the same processes, as many rows on each: `plan.fill_slots`), so no
row moves between processes and each keeps its number of rows; the round size is the smallest whose placements hold
enough groups for every placement with empty places (when the rows per process are a multiple of
`num_generations`, whole groups per process: any group of a process fills any place of that process). The keep/drop
decisions and the round sizes are taken on the rewards gathered from every process, identically everywhere, and then
checked: one small gather per round compares them, and rows per process, across processes, and a difference raises
an error naming it rather than leaving the processes waiting for each other.

Prompts of different rounds were padded to different widths: the assembled batch pads them again (prompts on the
left, completions on the right). The log-probs TRL computed for a round (sampling, reference) stay those of that
round's padding: with rotary position embeddings (Llama, Qwen, Mistral, ...) extra left padding changes a forward
only to float rounding; models with absolute position embeddings see their prompts shifted.

With selective rollouts (`sampling.selective`), round 0's prompts are those TRL's sampler handed out with the
predicted-flat ones replaced, the extra rounds' prompts are drawn through the same judgement (from the same stream),
and every round's groups update the prompts' histories.

Metrics (once per generation batch): `dynamic_sampling/kept_fraction` (informative groups / generated groups),
`dynamic_sampling/rounds` (extra rounds), `dynamic_sampling/generated_groups` (every round's groups),
`dynamic_sampling/frac_reward_zero_std_generated` (TRL's `frac_reward_zero_std` over every generated group), and
`dynamic_sampling/trained_mean_length` and `trained_clipped_ratio` (TRL's `completions/mean_length` and
`completions/clipped_ratio` of the batch that trains, which the alarms read beside its reward). TRL's
reward metrics (`reward`, `reward_std`, `frac_reward_zero_std`, `rewards/<name>/*`), this package's
`reward_std/group_*` and the completions table describe the batch that trains; `num_tokens` and TRL's other metrics
of each generation call (`completions/*`, `tools/*`, vLLM's `sampling/*`, what reward functions log with
`log_metric`) count everything generated, one value per generation batch with the rounds weighted by their rows
(`plan.combine_round_metrics`).

Fresh prompts: an extra round passes over the prompts the generation batch holds already (those of its earlier
rounds, compared by value), so that no prompt is weighed twice, also where the stream and TRL's sampler visit the
training set in the same order (`shuffle_dataset=False`).

Resume: the prompt stream and the keep-rate counts are registered with the checkpoints (`Checkpoints.register(...,
rewind=True)`): saved with every checkpoint, and rewound to the start of the step for the checkpoint a non-finite stop
writes, so that a resumed run draws the same prompts in rounds of the same sizes.
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
    group_placement,
    group_spread,
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
    """One generation batch TRL generated and scored: its local output, its rewards, its table rows."""

    output: dict[str, Any]
    scored: Any  # `trainer.ScoredBatch`
    informative: torch.Tensor  # (K,) bool
    frac_reward_zero_std: float
    logs: dict[str, Any]
    local_rows: int = 0  # rows per process
    placements: list[tuple] | None = None  # `group_placement` of the round
    truncated: torch.Tensor | None = None  # (n,) bool: this process's completions cut at max_completion_length
    selection: Any = None  # with selective rollouts: its prompts (`selective.Selection`)
    metrics: dict[str, list[float]] | None = None  # the values TRL's call appended to `_metrics` (per-call metrics)


class KeepRate:
    """The share of generated groups that were informative, the estimate an extra round is sized with: the counts of
    the current generation batch's rounds plus those of the batches before, decayed by `decay` per batch (recent
    batches count most: the share drifts as the policy learns).

    Its state is two floats, identical on every process (they come from gathered rewards).
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
        trainer (`GRPOTrainer`): its data, options, accelerator and TRL's logs are read; `_metrics` and `_logs` are
            rewritten for the assembled batch.
        max_rounds (`int`): the most extra rounds per generation batch (>= 1: the configuration checks it).
        margin (`float`): an extra round generates this many times the groups it is expected to need (> 0: the
            configuration checks it).
        selective (`selective.SelectiveRollouts`, *optional*): selective rollouts, whose stream this sampler then
            draws from.

    Raises:
        ValueError: for an `IterableDataset` (fresh prompts are drawn by index).
    """

    def __init__(
        self,
        trainer,
        max_rounds: int,
        margin: float = 1.1,
        selective=None,
    ):
        dataset = trainer.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                "dynamic_sampling draws fresh prompts by index: it needs a map-style `train_dataset` (a "
                "datasets.Dataset), not an IterableDataset. Load the dataset without `streaming=True`, or set "
                "dynamic_sampling=False."
            )
        self.trainer, self.max_rounds = trainer, max_rounds
        self.margin, self.selective = margin, selective
        #: The fresh prompts of the extra rounds (resumable: `Checkpoints.register`).
        if selective is not None:
            self.stream = selective.stream
        else:
            self.stream = PromptStream(len(dataset), trainer.args.seed, shuffle=trainer.shuffle_dataset)
        #: The share of informative groups, that extra rounds are sized with (resumable).
        self.keep_rate = KeepRate()
        self._sampling_dataset = None
        self._prompt_keys = selective.prompt_keys if selective is not None else PromptKeys(dataset)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        # What ends a completion that was not cut at max_completion_length (TRL's `completions/clipped_ratio`).
        self._completion_ends = torch.tensor([*eos_token_ids(trainer.model, tokenizer), tokenizer.pad_token_id])

    def generate(self, inputs: list[dict], generate_and_score: Callable) -> tuple[dict[str, Any], Any]:
        """The batch that trains and its rewards.

        Args:
            inputs: this process's rows of the generation batch (TRL's sampler's).
            generate_and_score (`Callable[[list[dict]], tuple[dict, ScoredBatch]]`): TRL's generation and scoring of
                one generation batch, with what it scored (`GRPOTrainerExt._generate_and_score`).

        Returns:
            `(output, scored)`: TRL's batch dict for this process, each dropped group replaced where an informative
            one was found, with the advantages of the assembled batch; and that batch's rewards and lengths.
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
        total_rows = rounds[0].scored.rewards_per_func.size(0)
        placements = rounds[0].placements
        assignment, short = fill_slots([r.informative for r in rounds], placements)
        self._check_processes_agree(local_rows, total_rows, rounds[-1].informative, short)
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
            round_groups = num_processes * rows // num_generations
            fresh, selection = self._fresh_inputs(round_groups, rows, taken)
            rounds.append(self._scored_round(fresh, generate_and_score, rows, selection))
            round_total = rounds[-1].scored.rewards_per_func.size(0)
            assignment, short = fill_slots([r.informative for r in rounds], placements, [r.placements for r in rounds])
            self._check_processes_agree(rows, round_total, rounds[-1].informative, short)
        kept = sum(int(r.informative.sum()) for r in rounds)
        generated = sum(r.informative.numel() for r in rounds)
        self.keep_rate.update(kept, generated)
        if self.selective is not None:
            self.selective.finish(metrics)

        sources = [
            (round_index, group * num_generations + offset)
            for round_index, group in assignment
            for offset in range(num_generations)
        ]  # per global row of the batch that trains: (round, global row in that round)
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
        if len(rounds) == 1:
            output = rounds[0].output  # nothing replaced: TRL's batch as it is
        else:
            output = self._assemble(rounds, local_sources)
        output["advantages"] = advantages[start : start + local_rows]
        lengths = torch.stack([rounds[r].scored.lengths[row] for r, row in local_sources])
        truncated = torch.stack([rounds[r].truncated[row] for r, row in local_sources])

        # TRL's reward metrics of the batch that trains, in place of those of each round; its other metrics of each
        # call (completions/*, ...) as one value for everything generated, the rounds weighted by their rows
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
        # TRL's `completions/*` count every round: these, the batch that trains
        local = torch.stack([lengths.to(torch.float64), truncated.to(torch.float64)], dim=1)
        trained = trainer.accelerator.gather(local.to(trainer.accelerator.device)).cpu()
        metrics[DYNAMIC_SAMPLING_TRAINED_MEAN_LENGTH].append(trained[:, 0].mean().item())
        metrics[DYNAMIC_SAMPLING_TRAINED_CLIPPED_RATIO].append(trained[:, 1].mean().item())
        self._rewrite_completions_table(rounds, sources, advantages)
        return output, replace(rounds[0].scored, rewards_per_func=rewards_per_func, lengths=lengths, first_row=start)

    def _scored_round(self, inputs: list[dict], generate_and_score, local_rows: int, selection=None) -> _Round:
        """`inputs` generated and scored (`local_rows` rows on each process), with what the plan needs of it; with
        selective rollouts, its groups update their prompts' histories."""
        trainer = self.trainer
        # Emptied, so that what the call leaves in TRL's table (one generation batch long) is this round's rows; the
        # table of the batch that trains is written once every round is in (`_rewrite_completions_table`).
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
        num_groups = scored.rewards_per_func.size(0) // trainer.num_generations
        # A completion is cut where its last token (`lengths` counts them) ends nothing
        last = output["completion_ids"].gather(1, (scored.lengths - 1).clamp(min=0)[:, None])[:, 0]
        ends = self._completion_ends.to(last.device)
        return _Round(
            output=output,
            scored=scored,
            truncated=(scored.lengths == 0) | ~torch.isin(last, ends),
            informative=informative,
            frac_reward_zero_std=is_std_zero.float().mean().item(),
            logs=logs,
            local_rows=local_rows,
            placements=group_placement(num_groups, trainer.num_generations, local_rows),
            selection=selection,
            metrics=appended,
        )

    def _fresh_inputs(self, num_groups: int, local_rows: int, taken: set) -> tuple[list[dict], Any]:
        """This process's rows of a round of `num_groups` fresh prompts, laid out as TRL's sampler lays out a
        generation batch (each prompt `num_generations` times in a row, `local_rows` rows per process in order), and
        the round's selection (`None` without selective rollouts). Prompts whose key is in `taken` (those the batch
        holds already) are passed over; the round's own are added to it."""
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

    def _check_processes_agree(self, local_rows: int, total_rows: int, informative: torch.Tensor, short: int) -> None:
        """Raise, on every process alike, if the processes hold different numbers of rows or took different
        decisions (one gather of three numbers)."""
        flags = informative.double()
        checksum = (flags * torch.arange(1, flags.numel() + 1, dtype=torch.float64, device=flags.device)).sum()
        mine = torch.stack([torch.tensor(float(local_rows), dtype=torch.float64, device=flags.device), checksum])
        mine = torch.cat([mine, torch.tensor([float(short)], dtype=torch.float64, device=flags.device)])
        table = self.trainer.accelerator.gather(mine[None].to(self.trainer.accelerator.device)).view(-1, 3).cpu()
        if not torch.equal(table[:, 0], torch.full_like(table[:, 0], table[0, 0].item())):
            raise RuntimeError(
                f"dynamic_sampling: the processes hold different numbers of rows ({table[:, 0].long().tolist()}) in "
                "a generation batch; it needs the same number on every process (TRL's sampler with a map-style "
                "dataset gives that)."
            )
        if total_rows != local_rows * self.trainer.accelerator.num_processes:
            raise RuntimeError(
                f"dynamic_sampling: {total_rows} rewards were gathered for {self.trainer.accelerator.num_processes} "
                f"processes of {local_rows} rows each."
            )
        if not torch.equal(table, table[:1].expand_as(table)):
            raise RuntimeError(
                "dynamic_sampling: the processes took different keep/drop decisions on the same gathered rewards "
                f"(checksums and places left {table[:, 1:].tolist()}); a reward or device that is not deterministic "
                "across processes can cause this."
            )

    def _assemble(self, rounds: list[_Round], local_sources: list[tuple[int, int]]) -> dict[str, Any]:
        """This process's batch: row `i` is row `local_sources[i][1]` of round `local_sources[i][0]`, padded again."""
        output = {}
        pad_id = getattr(
            self.trainer.processing_class, "tokenizer", self.trainer.processing_class
        ).pad_token_id  # TRL's pad token
        for key, value in rounds[0].output.items():
            if key in _RECOMPUTED or value is None:
                continue
            side, padding = _ROW_TENSORS[key]
            rows = [rounds[r].output[key][row] for r, row in local_sources]
            output[key] = pad(
                rows,
                padding_value=pad_id if padding == "pad" else padding,
                padding_side=side,
                pad_to_multiple_of=self.trainer.pad_to_multiple_of,
            )
        loss_mask = output["completion_mask"]
        if "tool_mask" in output:
            loss_mask = loss_mask * output["tool_mask"]
        output["num_items_in_batch"] = self.trainer.accelerator.gather(loss_mask.sum()).sum()  # as TRL counts it
        return output

    def _rewrite_completions_table(self, rounds: list[_Round], sources, advantages: torch.Tensor) -> None:
        """TRL's completions table (`_logs`, one generation batch) holds the rows that train."""
        size = len(sources)
        self.trainer._logs["prompt"] = deque((rounds[r].logs["prompt"][row] for r, row in sources), maxlen=size)
        self.trainer._logs["completion"] = deque(
            (rounds[r].logs["completion"][row] for r, row in sources), maxlen=size
        )
        for name in self.trainer._logs["rewards"]:
            column = self.trainer._logs["rewards"][name]
            column.clear()
            column.extend(rounds[r].logs["rewards"][name][row] for r, row in sources)
        self.trainer._logs["advantages"] = deque(advantages.tolist(), maxlen=size)
        self.trainer._logs["extra"].clear()
        columns = sorted({name for r in rounds for name in r.logs["extra"]})
        for name in columns:
            values = [rounds[r].logs["extra"].get(name) for r, _ in sources]
            self.trainer._logs["extra"][name].extend(
                None if column is None else column[row] for column, (_, row) in zip(values, sources, strict=True)
            )
