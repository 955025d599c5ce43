"""`GRPOConfigExt`: TRL's `GRPOConfig` with the source documents' defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.utils import is_torch_bf16_gpu_available
from trl import GRPOConfig

__all__ = ["GRPOConfigExt"]


@dataclass
class GRPOConfigExt(GRPOConfig):
    """Configuration for [`GRPOTrainerExt`]: a [`trl.GRPOConfig`] whose defaults give the documents' GRPO objective.

    Defaults that differ from TRL 1.16:

    - `beta=0.04` (TRL: 0.0): the KL penalty to the reference model is on, as in the DeepSeekMath paper.
    - `loss_type="grpo"` (TRL: "dapo"): per-sequence length normalisation, the only loss `GRPOTrainerExt` computes.
    - `use_bias_correction_kl=False` (TRL: True): the KL estimator is `exp(d) - d - 1`, not multiplied by the
      importance ratio.
    - `bf16=None` resolves to `True` only where a bf16-capable GPU is in use (TRL: always `True`, which fails on a
      CPU-only machine).

    Every other field is TRL's; see [`trl.GRPOConfig`].
    """

    beta: float = field(
        default=0.04,
        metadata={
            "help": "KL coefficient of the penalty `beta * (exp(d) - d - 1)`, d = ref_logp - logp. The documents and "
            "the DeepSeekMath paper use 0.04. 0.0 switches the penalty off and no reference model is loaded."
        },
    )
    epsilon: float = field(
        default=0.2,
        metadata={"help": "Clipping width: ratios are clipped to [1 - epsilon, 1 + epsilon_high]. Must be > 0."},
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "Loss aggregation. Only 'grpo' (average the tokens of each completion, then the completions) is "
            "implemented by GRPOTrainerExt; other values are refused at construction."
        },
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Multiply the per-token KL by the importance ratio (TRL's default). Not part of the documents' "
            "objective: GRPOTrainerExt refuses True."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Use bf16 mixed precision. When unset: True where a bf16-capable GPU is used (and fp16 is off), "
            "False on a CPU."
        },
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = not self.fp16 and not self.use_cpu and is_torch_bf16_gpu_available()
        super().__post_init__()
