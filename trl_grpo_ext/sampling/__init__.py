"""What is generated and trained, one module each:

- `generation`: sampling exactly as GRPO training samples (prompts, settings, stops, decoding);
- `heldout`: held-out evaluation during training, independent of the reward: its checks, schedule and `evaluate()`;
- `heldout_scoring`: the held-out prompts sampled and scored, per-prompt counts pooled into mean@n and pass@k;
- `dynamic`: dynamic sampling (DAPO's), replacing the groups without reward spread;
- `plan`: dynamic sampling's decisions, as functions of gathered tensors (alike on every process);
- `selective`: selective rollouts, skipping before generation the prompts predicted to give no reward spread;
- `skipping`: exact skipping of the rows that cannot move the loss;
- `sampler_cuts`: `match_sampler_truncation`, the trainer's log-probs of the distribution vLLM's top_k/top_p/min_p
  cuts leave, for the importance-sampling correction (the cut at `max_completion_length` is another matter: the
  `truncation` alarms).
"""

from .generation import (
    SamplingSettings,
    eos_token_ids,
    generate_completions,
    preserved_rng,
    sample_batch,
    sampling_model,
    tokenize_prompts,
)

__all__ = [
    "SamplingSettings",
    "eos_token_ids",
    "generate_completions",
    "preserved_rng",
    "sample_batch",
    "sampling_model",
    "tokenize_prompts",
]
