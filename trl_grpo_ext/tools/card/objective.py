"""The model card's objective: the formula of the loss type and options that trained the model."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from ...config import option
from ...ops.loss_types import loss_type_record, vllm_correction_line


def format_value(value) -> str:
    """A value as a user writes it in a config: `constant` for `SchedulerType.CONSTANT`, `0.001` for 1e-3."""
    if isinstance(value, enum.Enum):  # str(SchedulerType.CONSTANT) is "SchedulerType.CONSTANT"
        value = value.value
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(format_value(item) for item in value)
    return str(value)


OBJECTIVE_FIELDS = (
    "loss_type",
    "beta",
    "use_bias_correction_kl",
    "importance_sampling_level",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "scale_rewards",
    "multi_objective_aggregation",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "entropy_coef",
    "use_adaptive_entropy",
)

#: DeepSeekMath's GRPO objective: the formula block of `GRPOConfigExt`'s defaults.
OBJECTIVE = r"""```
r_it = exp(logp_it - old_logp_it)
S_it = min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
K_it = exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1
loss = -(1/G) * sum_i (1/|o_i|) * sum_t (S_it - beta * K_it),   A_i = (R_i - mean_group R) / (std_group R + 1e-4)
```"""

_KL_ESTIMATOR = "exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1"
_ADVANTAGES = {
    "group": "A_i = (R_i - mean_group R) / (std_group R + 1e-4)",
    "batch": "A_i = (R_i - mean_group R) / (std_batch R + 1e-4)",
    "none": "A_i = R_i - mean_group R",
}


def resolve_options(options: Mapping | None) -> dict:
    """Every `OBJECTIVE_FIELDS` entry: those of `options`, `GRPOConfigExt`'s for the rest."""
    given = {key: value for key, value in (options or {}).items() if key in OBJECTIVE_FIELDS}
    return {**objective_options(None), **given}


def objective_options(args) -> dict:
    """The `OBJECTIVE_FIELDS` of a configuration (`trl.GRPOConfig` or `GRPOConfigExt`; `None`: `GRPOConfigExt`'s
    defaults); a field that `args` lacks takes `GRPOConfigExt`'s default."""
    return {name: option(args, name) for name in OBJECTIVE_FIELDS}


def _vllm_correction(options: Mapping) -> bool:
    return bool(options["use_vllm"] and options["vllm_importance_sampling_correction"])


def _token_weight_lines(policy_term: str, options: Mapping) -> list[str]:
    """`w_it`, the product of the per-token weights TRL multiplies the policy term by; empty without any."""
    factors, lines = [], []
    if options["off_policy_mask_threshold"] is not None:
        factors.append("m_i")
        lines.append(
            "m_i = 0 if A_i < 0 and (1/|o_i|) * sum_t (sampling_logp_it - logp_it) > "
            f"{format_value(options['off_policy_mask_threshold'])} (off_policy_mask_threshold), else 1;   "
            "sampling_logp: the sampler's log-probs (vLLM's, else old_logp)"
        )
    if options["top_entropy_quantile"] < 1.0:
        factors.append("h_it")
        lines.append(
            "h_it = 1 for the tokens whose entropy is in the top "
            f"{format_value(options['top_entropy_quantile'])} fraction of the micro-batch's completion tokens "
            "(over all processes; top_entropy_quantile), else 0"
        )
    if _vllm_correction(options) and policy_term != "vespo":  # VESPO folds it into phi_i
        factors.append("rho_it")
        lines.append(vllm_correction_line("rho_it", "token t", options))
    if not factors:
        return []
    return [f"w_it = {' * '.join(factors)}", *lines]


def _entropy_lines(options: Mapping) -> tuple[str, list[str]]:
    """The entropy bonus `- c * H` of the loss and its definition; `("", [])` without one."""
    if not (options["entropy_coef"] != 0.0 or options["use_adaptive_entropy"]):
        return "", []
    tokens = "the tokens with h_it = 1" if options["top_entropy_quantile"] < 1.0 else "the completion tokens"
    lines = [f"H = mean entropy of the policy over {tokens}"]
    if options["use_adaptive_entropy"]:
        lines.append(
            f"c = entropy_coef (from {format_value(options['entropy_coef'])}, adapted each optimizer step towards "
            "entropy_target; 0 while the entropy is above it)"
        )
    else:
        lines.append(f"c = entropy_coef = {format_value(options['entropy_coef'])}")
    return " - c * H", lines


def _advantage_lines(options: Mapping) -> tuple[str, list[str]]:
    """`A_i` as TRL computes it from the rewards, and any definition it needs."""
    if options["multi_objective_aggregation"] == "normalize_then_sum":
        return "A_i = (R'_i - mean_batch R') / (std_batch R' + 1e-4)", [
            "R'_i = sum_k reward_weight_k * (R_ik - mean_group R_k) / (std_group R_k + 1e-4)   (k: reward function)"
        ]
    scale = options["scale_rewards"]
    if isinstance(scale, bool):  # as `GRPOConfig.__post_init__` reads it
        scale = "group" if scale else "none"
    if scale not in _ADVANTAGES:
        raise ValueError(f"No formula for scale_rewards={scale!r}.")
    return _ADVANTAGES[scale], []


def objective_formula(options: Mapping | None = None) -> str:
    """The objective a run trains, as a fenced block (`OBJECTIVE` for `GRPOConfigExt`'s defaults), from the loss
    type's record and `options` (`objective_options(args)`; a missing one takes `GRPOConfigExt`'s default)."""
    options = resolve_options(options)
    record = loss_type_record(options["loss_type"])
    kl = options["beta"] > 0
    bias_corrected = kl and options["use_bias_correction_kl"]
    lines = []
    if record.policy_term != "vespo" or bias_corrected:  # VESPO's term does not use r_it
        if options["importance_sampling_level"] == "sequence":
            lines.append(
                "r_it = exp((1/|o_i|) * sum_s (logp_is - old_logp_is))   (one ratio per completion: "
                "importance_sampling_level='sequence')"
            )
        else:
            lines.append("r_it = exp(logp_it - old_logp_it)")
    lines += record.policy_formula(options)
    if kl:
        lines.append(f"K_it = ({_KL_ESTIMATOR}) * r_it" if bias_corrected else f"K_it = {_KL_ESTIMATOR}")
    weights = _token_weight_lines(record.policy_term, options)
    term = "w_it * S_it" if weights else "S_it"
    summand = f"({term} - beta * K_it)" if kl else (f"({term})" if weights else term)
    bonus, entropy = _entropy_lines(options)
    advantage, advantage_defs = _advantage_lines(options)
    lines.append(f"loss = -{record.aggregation_formula} {summand}{bonus},   {advantage}")
    if record.divisor_formula is not None:
        lines.append(record.divisor_formula)
    lines += weights + entropy + advantage_defs
    return "\n".join(["```", *lines, "```"])
