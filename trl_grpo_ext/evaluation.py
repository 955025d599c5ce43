"""Held-out evaluation by sampling: mean reward of one sampled completion per prompt, before and after training."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["generate_completions", "sampled_reward_means"]


def _prompt_texts(tokenizer: PreTrainedTokenizerBase, prompts: list) -> list[str]:
    if prompts and not isinstance(prompts[0], str):  # conversational: render with the chat template
        return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return list(prompts)


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 256,
    seed: int = 0,
) -> list[str]:
    """Sample one completion per prompt with the sampling settings GRPO trains with (plain sampling by default).

    Args:
        model: the policy (a PEFT model works too).
        tokenizer: pads on the left.
        prompts: strings, or conversations (lists of messages) rendered with the tokenizer's chat template.
        max_new_tokens, temperature, top_p, top_k: sampling settings; `top_k=0` means no top-k cut.
        batch_size: prompts per `generate` call.
        seed: seed of the sampling; the global RNG state is restored afterwards.

    Returns:
        `list[str]`: the completions, decoded without special tokens.
    """
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=top_k or 0,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = _prompt_texts(tokenizer, prompts)
    was_training = model.training
    model.eval()
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    torch.manual_seed(seed)
    completions: list[str] = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(model.device)
            output = model.generate(**batch, generation_config=config)
            completions += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        model.train(was_training)
    return completions


def sampled_reward_means(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    reward_funcs: list[Callable],
    **generation_kwargs,
) -> dict[str, float]:
    """Mean of each reward function over one sampled completion per row.

    Args:
        rows: dataset rows with a `prompt` and the columns the reward functions read (e.g. `solution`).
        reward_funcs: TRL-style reward functions.
        **generation_kwargs: see `generate_completions`.

    Returns:
        `dict` reward function name -> mean reward (NaN rewards, i.e. `None`, are left out).
    """
    prompts = [row["prompt"] for row in rows]
    completions = generate_completions(model, tokenizer, prompts, **generation_kwargs)
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    means = {}
    for func in reward_funcs:
        rewards = [r for r in func(prompts=prompts, completions=completions, **columns) if r is not None]
        name = getattr(func, "__name__", type(func).__name__)
        means[name] = sum(rewards) / len(rewards) if rewards else float("nan")
    return means
