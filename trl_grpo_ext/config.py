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

    # Diagnostics
    log_diagnostics: bool = field(
        default=True,
        metadata={
            "help": "Log the importance-ratio distribution (ratio/*), the reward spread inside each group "
            "(reward_std/group_*) and the loss split (loss/policy, loss/kl_penalty). TRL's own metrics (kl, "
            "entropy, clip_ratio/*) are logged either way."
        },
    )
    log_histograms: bool = field(
        default=True,
        metadata={
            "help": "With log_diagnostics, also write histograms of the importance ratio and of the per-group reward "
            "std at every logging step, to the loggers that draw histograms (TensorBoard). Others ignore them."
        },
    )
    ratio_quantiles: list[float] = field(
        default_factory=lambda: [0.05, 0.5, 0.95],
        metadata={
            "help": "Quantiles of the importance ratio to log, each in [0, 1]; 0.05 is logged as ratio/p05. "
            "Resolution: 2.5e-4 relative for ratios in [0.61, 1.65]."
        },
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = not self.fp16 and not self.use_cpu and is_torch_bf16_gpu_available()
        self.ratio_quantiles = [float(q) for q in self.ratio_quantiles]
        bad = [q for q in self.ratio_quantiles if not 0.0 <= q <= 1.0]
        if bad:
            raise ValueError(f"`ratio_quantiles` must lie in [0, 1], got {bad}.")
        super().__post_init__()
