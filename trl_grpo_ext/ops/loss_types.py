"""One record per TRL `loss_type`: its policy term and aggregation (`terms.py`), the divisor the trainer computes,
its clip metrics, and its formula as text for the model card. The table of the records, with what "window" and
"micro-batch" normalisation mean: docs/objective.md ("Every TRL loss type").

A loss type of one's own is registered in one place, `register_loss_type` (with `register_policy_term` for a new
per-token term); `loss_type="<its name>"` then trains with `GRPOTrainerExt`, is logged by the diagnostics and
described by the card like the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .terms import AGGREGATIONS, POLICY_TERMS

__all__ = [
    "AGGREGATION_FORMULAS",
    "BUILTIN_LOSS_TYPES",
    "CLIP_METRICS",
    "DIVISORS",
    "LOSS_TYPES",
    "TERM_FORMULAS",
    "LossType",
    "loss_type_record",
    "register_loss_type",
    "register_policy_term",
    "vllm_correction_line",
]

#: Which clip metrics a loss type logs, under TRL's names: "clip_ratio" (`clip_ratio/low_mean`, ... of the clipped
#: surrogate), "cispo" (`cispo_clip_ratio`), or "none".
CLIP_METRICS = ("clip_ratio", "cispo", "none")
#: How the trainer computes `D` of `sum_over_denominator`: "window_tokens" (the completion tokens of one accumulation
#: window, from TRL's `num_items_in_batch`) or "rows_times_max_length" (`N * max_completion_length`).
DIVISORS = ("window_tokens", "rows_times_max_length")


def _value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def vllm_correction_line(symbol: str, of: str, options: Mapping) -> str:
    """The definition of vLLM's importance-sampling correction `symbol` (of a token or of a completion)."""
    return (
        f"{symbol} = pi_old / pi_vllm of {of}, truncated or masked: vLLM's importance-sampling correction "
        f"(vllm_importance_sampling_mode={options['vllm_importance_sampling_mode']!r})"
    )


def _clipped_formula(options: Mapping) -> list[str]:
    unclipped = "r_it * A_i" if options["delta"] is None else "min(r_it, delta) * A_i"
    line = f"S_it = min({unclipped}, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)"
    if options["delta"] is not None:
        line += f",   delta = {_value(options['delta'])} (two-sided clipping)"
    return [line]


def _cispo_formula(options: Mapping) -> list[str]:
    return ["S_it = sg(min(r_it, eps_high)) * A_i * logp_it,   sg: stop-gradient (CISPO)"]


def _sapo_formula(options: Mapping) -> list[str]:
    return [
        "S_it = (4 / tau_i) * sigmoid(tau_i * (r_it - 1)) * A_i,   "
        f"tau_i = {_value(options['sapo_temperature_pos'])} if A_i > 0 else "
        f"{_value(options['sapo_temperature_neg'])} (SAPO)"
    ]


def _vespo_formula(options: Mapping) -> list[str]:
    corrected = bool(options["use_vllm"] and options["vllm_importance_sampling_correction"])
    correction = " * rho_i" if corrected else ""  # TRL's gamma weights take the correction
    lines = [
        "S_it = sg(phi_i) * A_i * logp_it,   sg: stop-gradient (VESPO)",
        "phi_i = exp(lambda + k * log(w_i) - lambda * w_i),   w_i = exp(sum_t (logp_it - old_logp_it))"
        + correction
        + ",   (k, lambda) = (vespo_k_pos, vespo_lambda_pos) if A_i >= 0 else (vespo_k_neg, vespo_lambda_neg)",
    ]
    return lines + ([vllm_correction_line("rho_i", "the completion", options)] if corrected else [])


#: policy term -> its `S_it` (the term the objective maximises, `-P` of `terms`) as text, from the run's options
#: (the values of `card.objective.OBJECTIVE_FIELDS`).
TERM_FORMULAS: dict[str, Callable[[Mapping], list[str]]] = {
    "clipped": _clipped_formula,
    "cispo": _cispo_formula,
    "sapo": _sapo_formula,
    "vespo": _vespo_formula,
}
#: policy term -> the clipping fields of the configuration it uses (CISPO caps the ratio at `epsilon_high`, which
#: TRL sets to `epsilon` when unset; SAPO and VESPO do not clip).
TERM_CLIP_FIELDS: dict[str, tuple[str, ...]] = {
    "clipped": ("epsilon", "epsilon_high"),
    "cispo": ("epsilon_high",),
    "sapo": (),
    "vespo": (),
}
#: aggregation -> `sum_i c_i * sum_t X_it` as text, before the sign.
AGGREGATION_FORMULAS = {
    "sequence_mean": "(1/G) * sum_i (1/|o_i|) * sum_t",
    "token_mean": "(1/T) * sum_i sum_t",
    "sum_over_denominator": "(1/D) * sum_i sum_t",
    "sequence_sum": "(1/G) * sum_i sum_t",
}
#: divisor -> its definition, and `T` of `token_mean`.
DIVISOR_FORMULAS = {
    "window_tokens": "D = sum_i |o_i| over the gradient-accumulation window (i: every completion of the window)",
    "rows_times_max_length": "D = G * max_completion_length",
    "token_mean": "T = sum_i |o_i| over the micro-batch",
}


@dataclass(frozen=True)
class LossType:
    """What a `loss_type` is made of.

    Attributes:
        name (`str`): TRL's name.
        policy_term (`str`): a key of `terms.POLICY_TERMS`.
        aggregation (`str`): a key of `terms.AGGREGATIONS`.
        divisor (`str` or `None`): a key of `DIVISORS` for `sum_over_denominator`, else `None`.
        clip_metrics (`str`): one of `CLIP_METRICS`.
        needs_sequence_weights (`bool`): the term takes per-sequence weights (VESPO's gamma weights).
        extra_metrics (`tuple[str, ...]`): metrics TRL logs for this loss type only.
        formula (`Callable`, *optional*): `options -> lines` of its `S_it`; default: its policy term's
            (`TERM_FORMULAS`).
        clip_fields (`tuple[str, ...]`, *optional*): the clipping fields it uses; default: its policy term's.
    """

    name: str
    policy_term: str
    aggregation: str
    divisor: str | None = None
    clip_metrics: str = "clip_ratio"
    needs_sequence_weights: bool = False
    extra_metrics: tuple[str, ...] = ()
    formula: Callable[[Mapping], list[str]] | None = field(default=None, compare=False, repr=False)
    clip_fields: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.policy_term not in POLICY_TERMS or self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"{self.name}: unknown policy term {self.policy_term!r} or aggregation {self.aggregation!r} (policy "
                f"terms: {sorted(POLICY_TERMS)}, register one with register_policy_term; aggregations: "
                f"{sorted(AGGREGATIONS)})."
            )
        if self.formula is None:
            object.__setattr__(self, "formula", TERM_FORMULAS[self.policy_term])
        if self.clip_fields is None:
            object.__setattr__(self, "clip_fields", TERM_CLIP_FIELDS[self.policy_term])
        if (self.aggregation == "sum_over_denominator") != (self.divisor in DIVISORS):
            raise ValueError(f"{self.name}: `sum_over_denominator` needs a divisor, and only it has one.")
        if self.clip_metrics not in CLIP_METRICS:
            raise ValueError(f"{self.name}: `clip_metrics` must be one of {CLIP_METRICS}.")

    def policy_formula(self, options: Mapping) -> list[str]:
        """The lines of `S_it` for a run with `options` (the values of `card.objective.OBJECTIVE_FIELDS`)."""
        return self.formula(options)

    @property
    def aggregation_formula(self) -> str:
        """`sum_i c_i * sum_t` of its aggregation, as text."""
        return AGGREGATION_FORMULAS[self.aggregation]

    @property
    def divisor_formula(self) -> str | None:
        """The definition of its divisor (`D`, or `T` of `token_mean`), `None` without one."""
        return DIVISOR_FORMULAS.get(self.divisor or self.aggregation)

    @property
    def window_normalised(self) -> bool:
        """Whether the loss is divided by a count of the whole accumulation window (then not again by its steps)."""
        return self.divisor == "window_tokens"


LOSS_TYPES: dict[str, LossType] = {
    record.name: record
    for record in (
        LossType("grpo", "clipped", "sequence_mean"),
        LossType("bnpo", "clipped", "token_mean"),
        LossType("dr_grpo", "clipped", "sum_over_denominator", divisor="rows_times_max_length"),
        LossType("dapo", "clipped", "sum_over_denominator", divisor="window_tokens"),
        LossType("luspo", "clipped", "sequence_sum"),
        LossType("cispo", "cispo", "sum_over_denominator", divisor="window_tokens", clip_metrics="cispo"),
        LossType("sapo", "sapo", "sequence_mean", clip_metrics="none"),
        LossType(
            "vespo",
            "vespo",
            "sum_over_denominator",
            divisor="window_tokens",
            clip_metrics="none",
            needs_sequence_weights=True,
            extra_metrics=("vespo/phi_seq_mean",),
        ),
    )
}
#: The loss types this package defines (TRL's), in their order; `register_loss_type` adds to `LOSS_TYPES` only.
BUILTIN_LOSS_TYPES: tuple[str, ...] = tuple(LOSS_TYPES)


def loss_type_record(name: str) -> LossType:
    """The record of `name`; `ValueError` naming the known ones for any other."""
    if name not in LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {tuple(LOSS_TYPES)}, got {name!r}.")
    return LOSS_TYPES[name]


def register_policy_term(
    name: str,
    term: Callable,
    formula: Callable[[Mapping], list[str]] | str,
    clip_fields: tuple[str, ...] = (),
) -> None:
    """Add a per-token policy term to the catalogue (`terms.POLICY_TERMS`), for `register_loss_type`.

    Args:
        name (`str`): its name, a new one.
        term (`Callable`): `term(ratio, advantages, logp, *, epsilon_low, epsilon_high, delta, sapo_temperature_pos,
            sapo_temperature_neg, sequence_weights, **_) -> (P, low_clipped, high_clipped)`: the per-token loss `P`
            `(N, T)` (minimised; `-S` of the objective) and boolean `(N, T)` indicators of its flat region (`None`
            for a term without one, with `clip_metrics="none"` in its loss type). `ratio`, `advantages` and `logp`
            are `(N, T)`; positions outside the completion mask are dropped afterwards.
        formula: the lines of its `S_it` for the model card: a string, or `options -> list[str]`.
        clip_fields: the configuration fields it clips with (`"epsilon"`, `"epsilon_high"`), shown on the card.
    """
    if name in POLICY_TERMS:
        raise ValueError(f"A policy term named {name!r} exists already.")
    if not callable(term):
        raise ValueError(f"The policy term {name!r} must be callable, got {type(term).__name__}.")
    POLICY_TERMS[name] = term
    TERM_FORMULAS[name] = (lambda options: [formula]) if isinstance(formula, str) else formula
    TERM_CLIP_FIELDS[name] = tuple(clip_fields)


def register_loss_type(record: LossType) -> LossType:
    """Make `loss_type=record.name` available to `policy_objective`, `GRPOTrainerExt`, its diagnostics and its card.

    Args:
        record (`LossType`): its policy term (a built-in one or one of `register_policy_term`), aggregation, divisor
            and clip metrics.

    Returns:
        `LossType`: `record`.

    Raises:
        ValueError: for a name that is taken (the built-in loss types are TRL's and cannot be replaced).
    """
    if record.name in LOSS_TYPES:
        raise ValueError(f"A loss type named {record.name!r} exists already.")
    LOSS_TYPES[record.name] = record
    return record
