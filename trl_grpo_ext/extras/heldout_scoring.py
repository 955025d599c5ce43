"""Sampling and scoring the held-out prompts, independently of the reward: per-prompt counts, pass@k, their pooling.

Metric functions have the reward-function signature, `f(prompts, completions, **columns) -> list[float | None]`
(called as TRL calls reward functions, with `completion_ids`, the dataset's other columns and `trainer_state`). For
each held-out prompt, `n` completions are sampled exactly as training samples (`generation.py`: the same prompt tokens
and chat template, the config's sampling fields and `generation_kwargs`, the same stops; in eval mode, with the
random state of training left untouched). Pooled, per metric:

    heldout/<metric>/mean@<n>   mean score over all scored completions (None or NaN scores are left out)
    heldout/<metric>/pass@<k>   mean over prompts of the unbiased estimator 1 - C(n - c, k) / C(n, k)
    heldout/<metric>/scored@<n> the number of completions mean@<n> averages: its sample size, from which the alarm
                                `reward_vs_heldout` allows for the evaluation's own noise

where `c` counts a prompt's completions with score >= `heldout_pass_threshold` (an unscored completion counts as
not passing). Under DDP, FSDP2 and ZeRO the prompts are split over the processes, in chunks each sampled under its
own seed (`seed + chunk index`), so that a completion does not depend on how many processes share the work; the
per-prompt counts are pooled with one gather and summed in prompt order, so one process and several give the same
numbers.

With a vLLM engine, the completions come through TRL's own `vllm_generation.generate` with the training sampling
parameters. The chunk seeds then reach only an engine that draws from this process's torch generator (colocate mode);
a server samples with its own (see docs/vllm.md). In server mode (and with `vllm_tensor_parallel_size > 1`) TRL
gathers the prompts of every process into one request and slices the completions back assuming as many rows on each:
every process then samples equal-sized chunks, as many times (a short chunk is padded with its first prompt, and the
padding dropped).

The trainer's side (the checks, the schedule, the weight sync, `evaluate()`) is `heldout.py`'s.
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
    """The unbiased estimator of pass@k from `n` samples of which `c` pass: `1 - C(n - c, k) / C(n, k)`.

    The chance that `k` samples drawn without replacement from the `n` include at least one that passes. Computed
    as `1 - prod_{i = n - c + 1}^{n} (1 - k / i)`, which needs no large binomials.

    Args:
        n (`int`): samples of the prompt, >= 1.
        c (`int`): passing samples, in `[0, n]`.
        k (`int`): in `[1, n]`.

    Returns:
        `float` in `[0, 1]`; 1 when fewer than `k` samples fail.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def call_metric(
    func: Callable, prompts: list, completions: list, completion_ids: list, columns: dict[str, list], **extras
) -> list:
    """Call a reward-style function as TRL calls reward functions; `log_extra` and `log_metric` do nothing here.

    Args:
        func: `f(prompts, completions, **kwargs)`, plain or async.
        prompts, completions, completion_ids: one entry per completion.
        columns: the dataset's other columns, one list per column, one entry per completion.
        extras: more keyword arguments (`trainer_state` defaults to `None`).

    Returns:
        `list`: one score (or `None` for an unscored completion: a `None` or NaN score) per completion.

    Raises:
        RewardFunctionError: for a function that returns no list of one score per completion, or an infinite
            score (`guardrails.reward_errors.check_rewards`).
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
    """This process's per-prompt counts: one row per prompt it sampled, `(prompt index, then per metric: score sum,
    scored completions, passing completions)`, float64, padded with rows of index -1 to the same number of rows on
    every process.

    Args:
        model: the policy, whole or gathering its shards in the forward (then `synced_gpus=True`); put in eval mode
            while sampling. May be `None` with `vllm_generation`.
        tokenizer: the processing class of the run.
        dataset (`datasets.Dataset`): held-out rows with a `prompt` and the columns the metrics read.
        metrics: name -> metric function.
        settings: the sampling fields (`SamplingSettings.from_config(training_args)`).
        num_generations: completions per prompt (`n`).
        threshold: a completion passes when its score is >= this.
        batch_size: completions per `generate` call.
        seed: chunk `i` is sampled under seed `seed + i`.
        process_index, num_processes: this process and how many share the prompts (chunk `i` goes to process
            `i % num_processes`).
        synced_gpus: every process makes the same number of `generate` calls (a process with fewer chunks samples
            one again and drops it), each stepping until all processes are done: needed when the forward gathers
            sharded weights.
        metric_kwargs: more keyword arguments for the metrics (e.g. `trainer_state`).
        prompt_options: how conversational prompts are rendered, as the trainer renders them (`prompt_options`:
            its `tools` and `chat_template`).
        vllm_generation: the trainer's `vllm_generation` (TRL's vLLM backend), to sample with instead of `model`'s
            `generate` (`generation.vllm_sample_batch`); its engine must hold the current weights.
        equal_chunks: every process samples chunks of the same number of prompts (a short one padded with its first
            prompt, the padding dropped), the same number of times: TRL's server mode needs it.
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
    """The held-out metrics from the gathered per-prompt rows of every process (`heldout_records`, stacked).

    Rows are put in prompt order and summed in that order, so the result does not depend on the number of processes.

    Returns:
        `dict`: `heldout/<name>/mean@<n>` (NaN when no completion was scored), `heldout/<name>/pass@<k>` for each
        `k` of `pass_at`, and `heldout/<name>/scored@<n>` (the number of completions scored).
    """
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
