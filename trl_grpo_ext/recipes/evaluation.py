"""Held-out evaluation by sampling: mean reward of one sampled completion per prompt, sampled as GRPO training does.

TRL's `GRPOTrainer` (its transformers generation path) tokenises a plain prompt with the tokenizer's special tokens
(e.g. BOS), renders a conversational prompt with the chat template and `chat_template_kwargs`, samples with a
`GenerationConfig` built from the config's sampling fields and `generation_kwargs`, stops at every EOS id of the
tokenizer and of the model's `generation_config`, and hands reward functions conversational completions
(`[{"role": "assistant", "content": ...}]`) for conversational prompts. This module does the same, so that a held-out
score measures the policy that training sees, and a reward function written for TRL runs unchanged.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational
from trl.trainer.utils import pad

__all__ = ["SamplingSettings", "eos_token_ids", "generate_completions", "sampled_reward_means", "tokenize_prompts"]


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling fields of a GRPO config (names and defaults as in `trl.GRPOConfig`).

    Args:
        max_completion_length: most tokens sampled per completion.
        temperature, top_p, top_k, min_p, repetition_penalty: the sampling distribution; `top_k=0` and
            `min_p=None` switch those cuts off.
        cache_implementation: the KV cache `generate` uses.
        generation_kwargs: more `GenerationConfig` fields; they override the ones above, as in TRL.
        chat_template_kwargs: extra variables of the chat template (e.g. `{"enable_thinking": False}`).
        pad_to_multiple_of: left-pad prompt batches to a multiple of this length.
    """

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    generation_kwargs: dict | None = None
    chat_template_kwargs: dict | None = None
    pad_to_multiple_of: int | None = None

    @classmethod
    def from_config(cls, args) -> SamplingSettings:
        """The settings of a `trl.GRPOConfig` (or `GRPOConfigExt`): every field of this class, read by name."""
        values = {}
        for field in fields(cls):
            if not hasattr(args, field.name):
                raise ValueError(f"{type(args).__name__} has no field {field.name!r}: pass a trl.GRPOConfig.")
            values[field.name] = getattr(args, field.name)
        return cls(**values)

    def generation_config(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
        """The `GenerationConfig` that `trl.GRPOTrainer.__init__` builds for these settings, model and tokenizer."""
        generation_kwargs = {
            "max_new_tokens": self.max_completion_length,
            "do_sample": True,
            "pad_token_id": _pad_token_id(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": eos_token_ids(model, tokenizer),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "cache_implementation": self.cache_implementation,
            **(self.generation_kwargs or {}),
        }
        return GenerationConfig(**generation_kwargs, disable_compile=True)


def _pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    # TRL sets a missing pad token to the EOS token; read it that way without changing the caller's tokenizer.
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion in TRL's GRPO: the tokenizer's EOS, then the model's `generation_config` ones
    (an end-of-turn token such as `<|im_end|>`, for instance)."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list, chat_template_kwargs: dict | None = None
) -> list[list[int]]:
    """Prompt token ids, unpadded, as `trl.GRPOTrainer` makes them.

    Args:
        tokenizer: the processing class of the run.
        prompts: strings, tokenised with the tokenizer's special tokens; or conversations (lists of messages),
            rendered with the chat template, a generation prompt and `chat_template_kwargs`.

    Returns:
        `list[list[int]]`: one list of ids per prompt.
    """
    if is_conversational({"prompt": prompts[0]}):
        return tokenizer.apply_chat_template(
            conversation=prompts,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(chat_template_kwargs or {}),
        )["input_ids"]
    return tokenizer(text=prompts)["input_ids"]


def _through_first_eos(ids: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """Each row of `ids` `(B, C)` up to and including its first EOS id (what TRL keeps of a completion)."""
    is_eos = torch.isin(ids, torch.tensor(eos_ids, device=ids.device))
    lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, ids.shape[1])
    return [row[:length].tolist() for row, length in zip(ids.cpu(), lengths.tolist(), strict=True)]


def _decode(tokenizer: PreTrainedTokenizerBase, completion_ids: list[list[int]], prompt_ids: list, chat: bool) -> list:
    """Completions as TRL hands them to reward functions: strings, or lists with one assistant message."""
    if not chat:
        return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        pairs = zip(completion_ids, prompt_ids, strict=True)
        return [[parse_response(tokenizer, ids, prefix=prompt)] for ids, prompt in pairs]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": text}] for text in texts]


@torch.no_grad()
def _sample(model, tokenizer, prompts, settings, batch_size, seed) -> tuple[list, list[list[int]]]:
    if not prompts:
        raise ValueError("No prompts to sample from.")
    chat = is_conversational({"prompt": prompts[0]})
    config = settings.generation_config(model, tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = _pad_token_id(tokenizer)
    was_training = model.training
    model.eval()
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    torch.manual_seed(seed)
    completions, all_ids = [], []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            prompt_ids = tokenize_prompts(tokenizer, batch, settings.chat_template_kwargs)
            rows = [torch.tensor(ids) for ids in prompt_ids]
            padding = {"padding_side": "left", "pad_to_multiple_of": settings.pad_to_multiple_of}
            input_ids = pad(rows, padding_value=pad_id, **padding)
            attention_mask = pad([torch.ones_like(row) for row in rows], padding_value=0, **padding)
            output = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                generation_config=config,
            )
            completion_ids = _through_first_eos(output[:, input_ids.shape[1] :], eos_ids)
            completions += _decode(tokenizer, completion_ids, prompt_ids, chat)
            all_ids += completion_ids
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        model.train(was_training)
    return completions, all_ids


def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    settings: SamplingSettings | None = None,
    *,
    batch_size: int = 256,
    seed: int = 0,
) -> list:
    """Sample one completion per prompt, as GRPO training samples (see the module docstring).

    Args:
        model: the policy (a PEFT model works too); sampled in eval mode, then put back in its previous mode.
        tokenizer: the processing class of the run.
        prompts: strings, or conversations (lists of messages).
        settings: the sampling fields; `SamplingSettings.from_config(training_args)` for a run's own. Defaults to
            TRL's defaults (plain sampling, temperature 1).
        batch_size: prompts per `generate` call.
        seed: seed of the sampling; the global RNG state is restored afterwards.

    Returns:
        `list`: strings for plain prompts; for conversational prompts, lists holding one assistant message.
    """
    return _sample(model, tokenizer, prompts, settings or SamplingSettings(), batch_size, seed)[0]


def _call_reward(func: Callable, **kwargs) -> list:
    rewards = func(**kwargs)
    return asyncio.run(rewards) if inspect.isawaitable(rewards) else rewards


def sampled_reward_means(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    reward_funcs: list[Callable],
    settings: SamplingSettings | None = None,
    *,
    batch_size: int = 256,
    seed: int = 0,
    reward_kwargs: dict | None = None,
) -> dict[str, float]:
    """Mean of each reward function over one sampled completion per row.

    Reward functions are called as TRL calls them: `prompts`, `completions`, `completion_ids`, one list per extra
    column, and `trainer_state`, `log_extra`, `log_metric` (the last two do nothing here: held-out rewards are not
    logged to the run).

    Args:
        rows: dataset rows with a `prompt` and the columns the reward functions read (e.g. `solution`).
        reward_funcs: TRL-style reward functions (async ones too).
        settings, batch_size, seed: see `generate_completions`.
        reward_kwargs: more keyword arguments for the reward functions, e.g. `{"trainer_state": trainer.state}`.

    Returns:
        `dict` reward function name -> mean reward (`None` rewards, i.e. unscored completions, are left out).
    """
    prompts = [row["prompt"] for row in rows]
    completions, completion_ids = _sample(model, tokenizer, prompts, settings or SamplingSettings(), batch_size, seed)
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    extras = {"trainer_state": None, "log_extra": lambda *args: None, "log_metric": lambda *args: None}
    extras.update(reward_kwargs or {})
    means = {}
    for func in reward_funcs:
        rewards = _call_reward(
            func, prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extras
        )
        scored = [reward for reward in rewards if reward is not None]
        means[getattr(func, "__name__", type(func).__name__)] = sum(scored) / len(scored) if scored else float("nan")
    return means
