"""The GRPO objective of the DeepSeekMath paper, as pure tensor code.

For one prompt with G sampled completions o_1..o_G (token t of completion i):

    r_it = exp(logp_it - old_logp_it)                              importance ratio
    S_it = min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
    D_it = ref_logp_it - logp_it
    K_it = exp(D_it) - D_it - 1                                    "k3" KL estimator, >= 0
    J    = (1/G) * sum_i (1/|o_i|) * sum_t (S_it - beta * K_it)
    loss = -J

`_token_terms` and `_reference_loss` below are this block, line by line. `grpo_loss` computes it either that way,
with autograd (`implementation="reference"`), or with the same terms and their analytic gradient fused into fewer
passes over memory (`"fused"`, the default, and `"compiled"`: the same kernel through `torch.compile`; see
`fused.py`). Nothing here imports TRL: the functions work on any device and dtype and can be copied into another
training loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .fused import fused_grpo_loss
from .numerics import EXP_LINEAR_ABOVE, exp_linear_above, kl_estimator

__all__ = [
    "EXP_LINEAR_ABOVE",
    "GRPOLossOutput",
    "IMPLEMENTATIONS",
    "grpo_loss",
    "group_relative_advantages",
    "hyperparameter_problems",
]

IMPLEMENTATIONS = ("fused", "reference", "compiled")


def _token_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
) -> dict[str, torch.Tensor]:
    """The per-token quantities of the objective, `(N, T)` each. Inputs are already 0 at masked positions."""
    # r_it = exp(logp_it - old_logp_it)
    log_ratio = logp - old_logp
    ratio = exp_linear_above(log_ratio)
    # S_it = min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
    clipped_ratio = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    # D_it = ref_logp_it - logp_it ;  K_it = exp(D_it) - D_it - 1
    per_token_kl = kl_estimator(ref_logp - logp) if ref_logp is not None else torch.zeros_like(logp)
    return {
        "log_ratio": log_ratio,
        "ratio": ratio,
        "surrogate": surrogate,
        "per_token_kl": per_token_kl,
        # the flat, zero-gradient parts of the surrogate (TRL's clip_ratio definitions)
        "is_low_clipped": (ratio < 1.0 - epsilon) & (advantages < 0),
        "is_high_clipped": (ratio > 1.0 + epsilon_high) & (advantages > 0),
    }


def _per_sequence_mean(per_token: torch.Tensor, tokens_per_row: torch.Tensor) -> torch.Tensor:
    """`(1/N) sum_i (1/|o_i|) sum_t x_it`; `per_token` is 0 at masked positions, a row without tokens adds 0."""
    return (per_token.sum(dim=-1) / tokens_per_row.clamp(min=1)).mean()


class _LossInputs(NamedTuple):
    """What `GRPOLossOutput` derives its per-token values from, on first access."""

    logps: torch.Tensor  # detached
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor  # (N, 1) or (N, T)
    completion_mask: torch.Tensor
    dtype: torch.dtype  # the computation dtype


class GRPOLossOutput:
    """What `grpo_loss` returns.

    Scalars are 0-dim tensors; per-row values are `(N,)`; per-token values are `(N, T)`, detached, in the
    computation dtype (float32 or wider), and 0 (or `False`) at masked positions.

    Attributes:
        loss: `-J`, differentiable with respect to `logps`. Equals `policy_loss + beta * kl`.
        policy_loss: `-(1/N) sum_i (1/|o_i|) sum_t S_it`, detached.
        kl: `(1/N) sum_i (1/|o_i|) sum_t K_it`, detached (0 when `beta == 0` and no `ref_logps` were given).
        kl_penalty: `beta * kl`, detached.
        beta, epsilon, epsilon_high: the hyper-parameters used.
        tokens_per_row: completion tokens of each row, `(N,)`.
        kl_per_row: `sum_t K_it` of each row, `(N,)`.
        low_clipped_per_row, high_clipped_per_row: tokens of each row in the flat region, `(N,)`.
        clip_units_per_row: what the two above count per row, `(N,)`: its completion tokens (or, for sequence-level
            importance weights in `objectives.policy_objective`, 1).

    Per-token properties, computed on first access from the detached inputs and then kept (so that a caller who
    needs none of them pays for none): `mask`, `advantages`, `log_ratio`, `ratio`, `per_token_kl`,
    `is_low_clipped`, `is_high_clipped`, `is_region_clipped`.
    """

    def __init__(self, *, loss, policy_loss, kl, beta, epsilon, epsilon_high, rows, inputs, cache=None):
        self.loss = loss
        self.policy_loss = policy_loss
        self.kl = kl
        self.beta = float(beta)
        self.kl_penalty = self.beta * kl
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.tokens_per_row = rows["tokens"]
        self.kl_per_row = rows["kl"]
        self.low_clipped_per_row = rows["low"]
        self.high_clipped_per_row = rows["high"]
        self.clip_units_per_row = rows.get("clip_units", rows["tokens"])
        self._inputs: _LossInputs = inputs
        self._cache = dict(cache or {})

    def _mask(self) -> torch.Tensor:
        if "mask" not in self._cache:
            completion_mask = self._inputs.completion_mask
            self._cache["mask"] = completion_mask if completion_mask.dtype == torch.bool else completion_mask != 0
        return self._cache["mask"]

    def _selected(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.where(self._mask(), tensor.detach().to(self._inputs.dtype), 0.0)

    def _get(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache[name]
        logps, old_logps, ref_logps, advantages = self._inputs[:4]
        with torch.no_grad():
            if name in ("log_ratio", "ratio"):  # what the ratio diagnostics need, without the rest
                logp = self._selected(logps)
                log_ratio = logp - (logp if old_logps is None else self._selected(old_logps))
                self._cache.update(log_ratio=log_ratio, ratio=exp_linear_above(log_ratio))
            else:
                logp = self._selected(logps)
                old_logp = logp if old_logps is None else self._selected(old_logps)
                ref_logp = None if ref_logps is None else self._selected(ref_logps)
                adv = self._selected(advantages.expand(logps.shape))
                terms = _token_terms(logp, old_logp, ref_logp, adv, self.epsilon, self.epsilon_high)
                self._cache.update(terms, advantages=adv)
        return self._cache[name]

    @property
    def mask(self) -> torch.Tensor:
        return self._mask()

    @property
    def advantages(self) -> torch.Tensor:
        return self._get("advantages")

    @property
    def log_ratio(self) -> torch.Tensor:
        return self._get("log_ratio")

    @property
    def ratio(self) -> torch.Tensor:
        return self._get("ratio")

    @property
    def per_token_kl(self) -> torch.Tensor:
        return self._get("per_token_kl")

    @property
    def is_low_clipped(self) -> torch.Tensor:
        return self._get("is_low_clipped") & self.mask

    @property
    def is_high_clipped(self) -> torch.Tensor:
        return self._get("is_high_clipped") & self.mask

    @property
    def is_region_clipped(self) -> torch.Tensor:
        """Tokens whose surrogate is in either flat (zero-gradient) region, `(N, T)` bool."""
        return self.is_low_clipped | self.is_high_clipped


def hyperparameter_problems(epsilon: float, epsilon_high: float | None, beta: float) -> list[str]:
    """What is wrong with the objective's hyper-parameters, one message per problem (empty when they are valid).

    The one place these rules live: `grpo_loss` raises with these messages, and `GRPOConfigExt` and
    `GRPOTrainerExt` check a configuration with them before any model is loaded.

    Args:
        epsilon (`float`): lower clipping width, finite and > 0.
        epsilon_high (`float` or `None`): upper clipping width, finite and >= 0; `None` means `epsilon`.
        beta (`float`): KL coefficient, finite and >= 0.

    Returns:
        `list[str]`: messages naming the offending argument and its value.
    """

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    problems = []
    if not (number(epsilon) and epsilon > 0):
        problems.append(f"`epsilon` must be a finite number > 0, got {epsilon!r}.")
    if epsilon_high is not None and not (number(epsilon_high) and epsilon_high >= 0):
        problems.append(f"`epsilon_high` must be a finite number >= 0 (or None for `epsilon`), got {epsilon_high!r}.")
    if not (number(beta) and beta >= 0):
        problems.append(f"`beta` must be a finite number >= 0, got {beta!r}.")
    return problems


def _check_tensor(name: str, tensor: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.shape != shape:
        raise ValueError(f"`{name}` has shape {tuple(tensor.shape)}, expected {tuple(shape)} (the shape of `logps`).")
    if tensor.device != device:
        raise ValueError(f"`{name}` is on {tensor.device}, but `logps` is on {device}; move it to the same device.")


def _check_advantages(advantages: torch.Tensor, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """`advantages` as `(N, 1)` or `(N, T)`."""
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"`advantages` must be a torch.Tensor, got {type(advantages).__name__}.")
    if advantages.device != device:
        raise ValueError(
            f"`advantages` is on {advantages.device}, but `logps` is on {device}; move it to the same device."
        )
    num_rows, num_tokens = shape
    if advantages.shape == (num_rows,):
        return advantages.unsqueeze(-1)
    if advantages.shape in ((num_rows, 1), (num_rows, num_tokens)):
        return advantages
    raise ValueError(
        f"`advantages` has shape {tuple(advantages.shape)}; expected ({num_rows},), ({num_rows}, 1) or "
        f"({num_rows}, {num_tokens}) for `logps` of shape {tuple(shape)}."
    )


def _reference_loss(logps, old_logps, ref_logps, advantages, mask, epsilon, epsilon_high, beta, dtype):
    """The objective with autograd, straight from `_token_terms`. Returns `(loss, policy_loss, kl, rows, per-token
    values)`."""

    def select(x: torch.Tensor) -> torch.Tensor:
        # torch.where, not x * mask: NaN * 0 is NaN, and its gradient would be NaN too.
        return torch.where(mask, x.to(dtype), 0.0)

    logp = select(logps)
    old_logp = logp.detach() if old_logps is None else select(old_logps.detach())
    ref_logp = None if ref_logps is None else select(ref_logps.detach())
    adv = select(advantages.detach().expand(mask.shape))
    terms = _token_terms(logp, old_logp, ref_logp, adv, epsilon, epsilon_high)
    tokens = mask.sum(dim=-1)

    # J = (1/G) * sum_i (1/|o_i|) * sum_t (S_it - beta * K_it) ;  loss = -J
    loss = -_per_sequence_mean(terms["surrogate"] - beta * terms["per_token_kl"], tokens)

    per_token = {key: value.detach() for key, value in terms.items()}
    rows = {
        "tokens": tokens,
        "kl": per_token["per_token_kl"].sum(dim=-1),
        "low": (per_token["is_low_clipped"] & mask).sum(dim=-1),
        "high": (per_token["is_high_clipped"] & mask).sum(dim=-1),
    }
    policy_loss = -_per_sequence_mean(per_token["surrogate"], tokens)
    kl = _per_sequence_mean(per_token["per_token_kl"], tokens)
    return loss, policy_loss, kl, rows, {**per_token, "mask": mask, "advantages": adv}


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.04,
    implementation: str = "fused",
) -> GRPOLossOutput:
    """The GRPO loss `-J` with per-sequence length normalisation and the `exp(d) - d - 1` KL estimator.

    Args:
        logps (`torch.Tensor` of shape `(N, T)`):
            Log-probabilities of the sampled completion tokens under the policy being trained. The gradient flows
            into this tensor only. `N = B * G` rows, ordered so that the G completions of a prompt are consecutive.
        old_logps (`torch.Tensor` of shape `(N, T)` or `None`):
            Log-probabilities under the policy that sampled the completions. `None` means on-policy
            (`logps.detach()`, every ratio is exactly 1).
        ref_logps (`torch.Tensor` of shape `(N, T)` or `None`):
            Log-probabilities under the reference policy. May be `None` only when `beta == 0`.
        advantages (`torch.Tensor` of shape `(N,)`, `(N, 1)` or `(N, T)`):
            Advantage of each completion (or token), e.g. from `group_relative_advantages`.
        completion_mask (`torch.Tensor` of shape `(N, T)`, bool, int or float):
            Non-zero at the completion tokens that count. Everything at the other positions is ignored, even NaN or
            infinity (padding, prompt tokens): those values are selected away before any arithmetic.
        epsilon (`float`, defaults to `0.2`):
            Lower clipping width: ratios below `1 - epsilon` with a negative advantage are clipped. Must be > 0.
        epsilon_high (`float`, *optional*):
            Upper clipping width; `None` means `epsilon`. Must be >= 0.
        beta (`float`, defaults to `0.04`):
            KL coefficient. Must be >= 0.
        implementation (`str`, defaults to `"fused"`):
            `"fused"`: the terms and their analytic gradient in few passes over memory, with little extra memory;
            `"reference"`: the formula above with autograd; `"compiled"`: the fused kernel through `torch.compile`
            (falls back to `"fused"`, with a warning, where compilation fails). All three agree to rounding.

    Returns:
        [`GRPOLossOutput`]: `loss` (0-dim, differentiable), `policy_loss` and `kl` (0-dim, detached, with
        `loss == policy_loss + beta * kl`), per-row sums, and per-token ratios, KL terms and clip masks.

    `old_logps`, `ref_logps` and `advantages` are treated as constants: no gradient flows into them. All arithmetic is
    done in float32 (or in the inputs' dtype if it is wider), whatever the input dtype; the gradient comes back in
    the dtype of `logps`. Exponentials are exact for log differences up to `EXP_LINEAR_ABOVE` (20) and continue
    linearly above it, so extreme ratios give a large but finite loss and gradient instead of `inf`/NaN. Non-finite
    values at unmasked positions are bad input and make the loss non-finite.

    Raises:
        ValueError: naming the offending argument, for a shape or device mismatch, an empty batch, `epsilon <= 0`,
            `epsilon_high < 0`, `beta < 0`, `ref_logps=None` with `beta > 0`, or an unknown `implementation`.
    """
    problems = hyperparameter_problems(epsilon, epsilon_high, beta)
    if problems:
        raise ValueError(" ".join(problems))
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"`implementation` must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
    if not isinstance(logps, torch.Tensor) or logps.dim() != 2:
        shape = tuple(logps.shape) if isinstance(logps, torch.Tensor) else type(logps).__name__
        raise ValueError(f"`logps` must be a 2-dim (N, T) tensor, got {shape}.")
    if not logps.is_floating_point():
        raise ValueError(f"`logps` must be a floating-point tensor, got {logps.dtype}.")
    if logps.numel() == 0:
        raise ValueError(f"`logps` is empty (shape {tuple(logps.shape)}): a batch needs at least one row and token.")
    shape, device = logps.shape, logps.device
    _check_tensor("completion_mask", completion_mask, shape, device)
    if old_logps is not None:
        _check_tensor("old_logps", old_logps, shape, device)
    if ref_logps is None and beta > 0:
        raise ValueError(f"`ref_logps` is None but `beta` is {beta}; pass reference log-probs or set beta=0.")
    if ref_logps is not None:
        _check_tensor("ref_logps", ref_logps, shape, device)
    advantages = _check_advantages(advantages, shape, device)
    dtype = torch.promote_types(logps.dtype, torch.float32)

    if implementation == "reference":
        mask = completion_mask if completion_mask.dtype == torch.bool else completion_mask != 0
        loss, policy_loss, kl, rows, cache = _reference_loss(
            logps, old_logps, ref_logps, advantages, mask, epsilon, epsilon_high, beta, dtype
        )
    else:
        loss, policy_loss, kl, rows = fused_grpo_loss(
            logps,
            old_logps,
            ref_logps,
            advantages,
            completion_mask,
            epsilon,
            epsilon_high,
            beta,
            dtype,
            compiled=implementation == "compiled",
        )
        cache = None
    inputs = _LossInputs(logps.detach(), old_logps, ref_logps, advantages, completion_mask, dtype)
    return GRPOLossOutput(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        rows=rows,
        inputs=inputs,
        cache=cache,
    )


def group_relative_advantages(
    rewards: torch.Tensor, num_generations: int, *, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages `A_i = (R_i - mean_group(R)) / (std_group(R) + eps)`.

    Args:
        rewards (`torch.Tensor` of shape `(N,)`):
            One reward per completion, ordered group-contiguously: rows `g*G .. g*G + G - 1` share a prompt. NaN
            marks a completion that could not be scored (a reward function returned `None`, as in TRL): it is left
            out of its group's mean and std, and gets advantage 0.
        num_generations (`int`):
            G, the number of completions per prompt; at least 2, and it must divide N.
        scale (`bool`, defaults to `True`):
            Divide by the group's standard deviation (unbiased, torch's default). `False` only centres the rewards.
        eps (`float`, defaults to `1e-4`):
            Added to the standard deviation. A group whose rewards are all equal gets advantage 0.

    Returns:
        `torch.Tensor` of shape `(N,)`, float32 or wider.

    Raises:
        ValueError: for a `rewards` tensor that is not 1-dim or is empty, `num_generations < 2`, `num_generations`
            not dividing the number of rewards, or `eps < 0`.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"`rewards` must be a 1-dim (N,) tensor, got {shape}.")
    if rewards.numel() == 0:
        raise ValueError("`rewards` is empty.")
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"`num_generations` must be an int >= 2 (a group needs a baseline), got {num_generations!r}.")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"`num_generations` ({num_generations}) does not divide the number of rewards ({rewards.numel()}); "
            "rewards must come in whole groups."
        )
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"`eps` must be a finite number >= 0, got {eps!r}.")

    dtype = torch.promote_types(rewards.dtype, torch.float32) if rewards.is_floating_point() else torch.float32
    grouped = rewards.detach().to(dtype).reshape(-1, num_generations)  # (B, G)
    scored = ~torch.isnan(grouped)
    count = scored.sum(dim=1, keepdim=True)
    # Averaging around a value of the group itself makes a group of equal rewards centre to exactly 0.
    shift = torch.where(scored, grouped, -math.inf).amax(dim=1, keepdim=True)
    shift = torch.where(count > 0, shift, 0.0)
    offsets = torch.where(scored, grouped - shift, 0.0)
    mean = shift + offsets.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(scored, grouped - mean, 0.0)
    if not scale:
        return centred.reshape(-1)
    # Unbiased variance over the scored completions; a group with fewer than 2 scored completions has no spread.
    variance = centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, variance.sqrt(), 0.0)
    denominator = std + eps
    advantages = torch.where(denominator > 0, centred / denominator, 0.0)
    return advantages.reshape(-1)
