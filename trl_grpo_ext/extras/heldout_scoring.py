"""The held-out prompts sampled and scored, independently of the reward: per-prompt counts, pooled into

    heldout/<metric>/mean@<n>    mean score over the scored completions (None or NaN scores left out)
    heldout/<metric>/pass@<k>    mean over prompts of 1 - C(n - c, k) / C(n, k), c the completions scoring >= threshold
    heldout/<metric>/scored@<n>  the completions mean@<n> averages

Metric functions have the reward-function signature and are called as TRL calls reward functions. The prompts are
split over the processes in chunks, each sampled under its own seed (`seed + chunk index`), and the counts are pooled
in prompt order: one process and several give the same numbers. Through vLLM in server mode (or tensor parallel),
every process samples equal-sized chunks, as many times.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable

import torch
from trl.trainer.utils import get_callable_name

from ..guardrails.reward_errors import check_rewards
from ..metrics import heldout_metric
from .generation import SamplingSettings, preserved_rng, sample_batch, sampling_model, vllm_sample_batch

__all__ = ["call_metric", "heldout_records", "pass_at_k", "pool_heldout_records"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from `n` samples of which `c` pass, `1 - C(n - c, k) / C(n, k)`, computed as
    `1 - prod_{i = n - c + 1}^{n} (1 - k / i)` (no large binomials); `1 <= k <= n`, `0 <= c <= n`."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def call_metric(
    func: Callable, prompts: list, completions: list, completion_ids: list, columns: dict[str, list], **extras
) -> list:
    """Call a reward-style function (plain or async) as TRL calls reward functions, with the dataset's other
    `columns` (one entry per completion) and `extras` (`trainer_state` defaults to `None`); `log_extra` and
    `log_metric` do nothing. Returns one score per completion, `None` for a `None` or NaN score.

    Raises:
        RewardFunctionError: for no list of one score per completion, or an infinite score.
    """
    kwargs = {"trainer_state": None, "log_extra": lambda *args: None, "log_metric": lambda *args: None}
    kwargs.update(extras)
    scores = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **kwargs)
    scores = asyncio.run(scores) if inspect.isawaitable(scores) else scores
    check_rewards(get_callable_name(func), scores, {"prompts": prompts, "completions": completions}, "Held-out metric")
    return [None if _unscored(score) else score for score in scores]


def _unscored(score) -> bool:
    return score is None or (isinstance(score, float) and math.isnan(score))


def _chunks(num_prompts: int, num_generations: int, batch_size: int) -> list[range]:
    """The prompt ranges sampled in one `generate` call each: `batch_size // num_generations` prompts (at least 1)."""
    per_chunk = max(1, batch_size // num_generations)
    return [range(start, min(start + per_chunk, num_prompts)) for start in range(0, num_prompts, per_chunk)]


def heldout_records(
    model,
    tokenizer,
    dataset,
    metrics: dict[str, Callable],
    settings: SamplingSettings,
    *,
    num_generations: int,
    threshold: float,
    batch_size: int = 256,
    seed: int = 0,
    process_index: int = 0,
    num_processes: int = 1,
    synced_gpus: bool = False,
    metric_kwargs: dict | None = None,
    prompt_options: dict | None = None,
    vllm_generation=None,
    equal_chunks: bool = False,
) -> torch.Tensor:
    """This process's per-prompt counts, `(R, 1 + 3 * M)` float64: per prompt it sampled, its index, then per metric
    the score sum, the scored and the passing completions; padded with rows of index -1 to as many rows on every
    process.

    Args:
        model: the policy (`None` with `vllm_generation`), sampled in eval mode.
        dataset (`datasets.Dataset`): held-out rows with a `prompt` and the columns the metrics read.
        metrics (`dict`): name -> metric function.
        num_generations (`int`): completions per prompt (`n`); `threshold`: a completion passes at a score >= it.
        batch_size (`int`): completions per `generate` call; chunk `i` is sampled under seed `seed + i` by process
            `i % num_processes`.
        synced_gpus (`bool`): every process makes as many `generate` calls, each stepping until all are done (sharded
            weights gathered in the forward).
        metric_kwargs, prompt_options (`dict`): more keyword arguments of the metrics; the trainer's `tools` and
            `chat_template` (`heldout.prompt_options`).
        vllm_generation: the trainer's vLLM backend, to sample with instead of `generate`.
        equal_chunks (`bool`): every process samples chunks of as many prompts, as many times (TRL's server mode).
    """
    chunks = _chunks(len(dataset), num_generations, batch_size)
    mine = list(range(process_index, len(chunks), num_processes))
    calls = math.ceil(len(chunks) / num_processes) if synced_gpus or equal_chunks else len(mine)
    max_rows = max(sum(len(chunks[i]) for i in range(p, len(chunks), num_processes)) for p in range(num_processes))
    rows = []
    with sampling_model(model) if model is not None else preserved_rng():
        for call in range(calls):
            index = mine[call] if call < len(mine) else 0  # a repeat that keeps the processes in step
            chunk = list(chunks[index])
            padding = len(chunks[0]) - len(chunk) if equal_chunks else 0
            batch = dataset[chunk + [chunk[0]] * padding]
            prompts = [prompt for prompt in batch["prompt"] for _ in range(num_generations)]
            torch.manual_seed(seed + index)
            if vllm_generation is not None:
                completions, completion_ids = vllm_sample_batch(
                    vllm_generation, tokenizer, prompts, settings, num_generations, **(prompt_options or {})
                )
            else:
                completions, completion_ids = sample_batch(
                    model, tokenizer, prompts, settings, synced_gpus=synced_gpus, **(prompt_options or {})
                )
            if call >= len(mine):
                continue
            kept = len(chunk) * num_generations  # without the padding
            batch = {key: values[: len(chunk)] for key, values in batch.items()}
            prompts, completions, completion_ids = prompts[:kept], completions[:kept], completion_ids[:kept]
            columns = {
                key: [value for value in values for _ in range(num_generations)]
                for key, values in batch.items()
                if key not in ("prompt", "completion")
            }
            scores = {
                name: call_metric(func, prompts, completions, completion_ids, columns, **(metric_kwargs or {}))
                for name, func in metrics.items()
            }
            for offset, prompt_index in enumerate(chunk):
                row = [float(prompt_index)]
                for name in metrics:
                    group = scores[name][offset * num_generations : (offset + 1) * num_generations]
                    scored = [float(score) for score in group if score is not None]
                    row += [sum(scored), float(len(scored)), float(sum(score >= threshold for score in scored))]
                rows.append(row)
    width = 1 + 3 * len(metrics)
    rows += [[-1.0] + [0.0] * (width - 1)] * (max(max_rows, 1) - len(rows))
    return torch.tensor(rows, dtype=torch.float64)


def pool_heldout_records(
    records: torch.Tensor, names: list[str], num_generations: int, pass_at: list[int]
) -> dict[str, float]:
    """The held-out metrics (module docstring) from every process's `heldout_records`, stacked, summed in prompt
    order; `mean@<n>` is NaN where no completion was scored."""
    records = records.to(torch.float64).cpu()
    records = records[records[:, 0] >= 0]
    records = records[records[:, 0].argsort()].tolist()
    values = {}
    for position, name in enumerate(names):
        score_sum = scored = 0.0
        passes = dict.fromkeys(pass_at, 0.0)
        for row in records:
            total, count, passing = row[1 + 3 * position : 4 + 3 * position]
            score_sum, scored = score_sum + total, scored + count
            for k in pass_at:
                passes[k] += pass_at_k(num_generations, round(passing), k)
        values[heldout_metric(name, "mean", num_generations)] = score_sum / scored if scored else math.nan
        for k in pass_at:
            values[heldout_metric(name, "pass", k)] = passes[k] / len(records) if records else math.nan
        values[heldout_metric(name, "scored", num_generations)] = scored
    return values
