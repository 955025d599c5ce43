"""Sampling as TRL's GRPO training samples (its transformers path): the same prompt tokens and chat template, the
`GenerationConfig` of the config's sampling fields and `generation_kwargs`, the same stops, the same decoded
completions; or through the trainer's vLLM engine. Held-out scores measure the policy training sees, and reward
functions written for TRL run unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational
from trl.trainer.utils import pad

__all__ = [
    "SamplingSettings",
    "eos_token_ids",
    "generate_completions",
    "preserved_rng",
    "sample_batch",
    "sampling_model",
    "tokenize_prompts",
    "vllm_sample_batch",
]


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling fields of a GRPO config, with `trl.GRPOConfig`'s names and defaults (`generation_kwargs` override
    the others, as in TRL; `chat_template_kwargs` are extra variables of the chat template)."""

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
    """Every id that ends a completion in TRL's GRPO: the tokenizer's EOS, then the model's generation config's."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    chat_template_kwargs: dict | None = None,
    *,
    tools: list | None = None,
    chat_template: str | None = None,
) -> list[list[int]]:
    """Prompt token ids, unpadded, one list per prompt, as `trl.GRPOTrainer` makes them: strings with the
    tokenizer's special tokens, conversations through the chat template (with `tools` and the `chat_template` TRL
    trains with, if any) and a generation prompt."""
    if is_conversational({"prompt": prompts[0]}):
        return tokenizer.apply_chat_template(
            conversation=prompts,
            tools=tools or None,  # as TRL: some templates render tool boilerplate for an empty list
            chat_template=chat_template,
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


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the random state (CPU and every CUDA device) after the block."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextmanager
def sampling_model(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """`model` in eval mode, with gradients off and the random state preserved; its mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), preserved_rng():
            yield model
    finally:
        model.train(was_training)


def sample_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    settings: SamplingSettings,
    *,
    synced_gpus: bool | None = None,
    tools: list | None = None,
    chat_template: str | None = None,
) -> tuple[list, list[list[int]]]:
    """One `generate` call: a completion for each prompt (strings or conversations), with the current random state.

    Args:
        synced_gpus (`bool`, *optional*): `generate`'s; `True` where sharded weights are gathered in the forward.
        tools, chat_template: see `tokenize_prompts`.

    Returns:
        `(completions, completion_ids)`: the decoded completions (strings, or lists holding one assistant message)
        and their token ids through the first EOS.
    """
    chat = is_conversational({"prompt": prompts[0]})
    pad_id = _pad_token_id(tokenizer)
    prompt_ids = tokenize_prompts(
        tokenizer, prompts, settings.chat_template_kwargs, tools=tools, chat_template=chat_template
    )
    rows = [torch.tensor(ids) for ids in prompt_ids]
    padding = {"padding_side": "left", "pad_to_multiple_of": settings.pad_to_multiple_of}
    input_ids = pad(rows, padding_value=pad_id, **padding)
    attention_mask = pad([torch.ones_like(row) for row in rows], padding_value=0, **padding)
    output = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        generation_config=settings.generation_config(model, tokenizer),
        synced_gpus=synced_gpus,
    )
    completion_ids = _through_first_eos(output[:, input_ids.shape[1] :], eos_token_ids(model, tokenizer))
    return _decode(tokenizer, completion_ids, prompt_ids, chat), completion_ids


def vllm_sample_batch(
    vllm_generation,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    settings: SamplingSettings,
    num_generations: int,
    *,
    tools: list | None = None,
    chat_template: str | None = None,
) -> tuple[list, list[list[int]]]:
    """`sample_batch` through a trainer's vLLM engine (TRL's `vllm_generation.generate`, with the training sampling
    parameters; the engine must hold the current weights): `prompts` each repeated `num_generations` times in a row.
    """
    chat = is_conversational({"prompt": prompts[0]})
    prompt_ids = tokenize_prompts(
        tokenizer, prompts, settings.chat_template_kwargs, tools=tools, chat_template=chat_template
    )
    _, completion_ids, _, _ = vllm_generation.generate(
        prompts=prompt_ids, images=None, num_generations=num_generations
    )
    completion_ids = [list(ids) for ids in completion_ids]
    return _decode(tokenizer, completion_ids, prompt_ids, chat), completion_ids


def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    settings: SamplingSettings | None = None,
    *,
    batch_size: int = 256,
    seed: int = 0,
    return_ids: bool = False,
) -> list | tuple[list, list[list[int]]]:
    """One completion per prompt, sampled as GRPO training samples.

    Args:
        model: the policy (a PEFT model too), sampled in eval mode.
        prompts (`list`): strings, or conversations (lists of messages).
        settings (`SamplingSettings`, *optional*): `SamplingSettings.from_config(training_args)` for a run's own;
            default: TRL's defaults.
        batch_size (`int`): prompts per `generate` call.
        seed (`int`): seed of the sampling; the global random state is restored afterwards.
        return_ids (`bool`): also return the completions' token ids.

    Returns:
        `list`: strings, or lists holding one assistant message; with `return_ids`, `(completions, completion_ids)`.
    """
    if not prompts:
        raise ValueError("No prompts to sample from.")
    settings = settings or SamplingSettings()
    completions, all_ids = [], []
    with sampling_model(model):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            batch_completions, batch_ids = sample_batch(model, tokenizer, batch, settings)
            completions += batch_completions
            all_ids += batch_ids
    return (completions, all_ids) if return_ids else completions
