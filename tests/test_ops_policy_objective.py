"""`policy_objective`: every TRL loss variant, with the numerics of `grpo_loss`."""

import dataclasses
import math

import pytest
import torch

from trl_grpo_ext import grpo_loss
from trl_grpo_ext.ops import LOSS_TYPES, ObjectiveOptions, policy_objective
from trl_grpo_ext.ops.terms import AGGREGATIONS, POLICY_TERMS

OPTION_FIELDS = {field.name for field in dataclasses.fields(ObjectiveOptions)}


def objective(logps, *args, **kwargs):
    """`policy_objective` with the loss type's options given by name among the other keyword arguments."""
    options = ObjectiveOptions(**{name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_FIELDS})
    return policy_objective(logps, *args, options, **kwargs)


def batch(num_rows=8, num_tokens=12, *, seed=0, spread=0.4):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(num_rows, num_tokens, generator=generator) * 3
    old = logps + spread * torch.randn(num_rows, num_tokens, generator=generator)
    ref = logps + spread * torch.randn(num_rows, num_tokens, generator=generator)
    advantages = torch.randn(num_rows, generator=generator)
    lengths = torch.randint(1, num_tokens + 1, (num_rows, 1), generator=generator)
    lengths[-1] = 0  # a row without completion tokens
    mask = torch.arange(num_tokens)[None] < lengths
    return logps, old, ref, advantages, mask


def variant_kwargs(loss_type, rows, num_tokens=12):
    kwargs = {"loss_type": loss_type}
    if LOSS_TYPES[loss_type].aggregation == "sum_over_denominator":
        kwargs["denominator"] = float(rows * num_tokens)
    if loss_type == "vespo":
        kwargs["sequence_weights"] = torch.linspace(0.5, 1.5, rows)[:, None]
    if loss_type == "cispo":
        kwargs["epsilon_high"] = 1.2
    return kwargs


def run(logps, *args, **kwargs):
    leaf = logps.clone().requires_grad_(True)
    out = objective(leaf, *args, **kwargs)
    out.loss.backward()
    return out, leaf.grad


def test_the_catalogue_names_every_trl_loss_type():
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"}
    for name, record in LOSS_TYPES.items():
        assert record.name == name
        assert record.policy_term in POLICY_TERMS and record.aggregation in AGGREGATIONS
        assert (record.divisor is not None) == (record.aggregation == "sum_over_denominator")
    assert {name for name, record in LOSS_TYPES.items() if record.window_normalised} == {"dapo", "cispo", "vespo"}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
@pytest.mark.parametrize("implementation", ["fused", "compiled"])
def test_the_fused_kernel_computes_every_clipped_loss_type_as_the_reference(loss_type, implementation):
    logps, old, ref, advantages, mask = batch(seed=3)
    kwargs = dict(loss_type=loss_type, beta=0.04, epsilon_high=0.28, denominator=37.0, loss_scale=0.5)
    expected, expected_grad = run(logps, old, ref, advantages, mask, implementation="reference", **kwargs)
    out, grad = run(logps, old, ref, advantages, mask, implementation=implementation, **kwargs)
    for name in ("loss", "policy_loss", "kl", "ratio", "per_token_kl", "is_low_clipped", "is_high_clipped"):
        torch.testing.assert_close(getattr(out, name), getattr(expected, name), rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(loss_type="sapo"), "clipped surrogate only"),
        (dict(importance_sampling_level="sequence"), "token-level"),
        (dict(delta=1.5), "two-sided"),
        (dict(token_weights=torch.ones(8, 12)), "per-token weights"),
        (dict(use_bias_correction_kl=True), "multiplied by the ratio"),
    ],
)
@pytest.mark.parametrize("implementation", ["fused", "compiled"])
def test_the_kernel_outside_its_domain_is_refused_naming_the_reason_and_the_formula(options, reason, implementation):
    logps, old, ref, advantages, mask = batch(seed=4)
    with pytest.raises(ValueError, match=f"{reason}.*Use implementation='reference'"):
        objective(logps, old, ref, advantages, mask, implementation=implementation, **options)
    objective(logps, old, ref, advantages, mask, implementation="reference", **options)  # the formula computes it


def test_the_removed_auto_implementation_is_refused_naming_the_formula():
    logps, old, ref, advantages, mask = batch(seed=4)
    with pytest.raises(ValueError, match="'auto'` was removed.*implementation='reference', is the default"):
        policy_objective(logps, old, ref, advantages, mask, implementation="auto")


def test_the_formula_is_the_default_and_returns_detached_per_token_values():
    logps, old, ref, advantages, mask = batch(seed=5)
    leaf = logps.clone().requires_grad_(True)
    out = policy_objective(leaf, old, ref, advantages, mask)
    torch.testing.assert_close(out.loss, objective(logps, old, ref, advantages, mask, implementation="reference").loss)
    for name in ("log_ratio", "ratio", "per_token_kl", "is_low_clipped", "is_high_clipped"):
        value = getattr(out, name)
        assert value.shape == logps.shape and not value.requires_grad, name
        assert not value[~mask].any(), name  # 0 or False where masked
    out.loss.backward()
    assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_the_grpo_row_is_grpo_loss(beta):
    logps, old, ref, advantages, mask = batch(seed=1)
    ref = ref if beta else None
    out, grad = run(logps, old, ref, advantages, mask, beta=beta, epsilon_high=0.28)
    leaf = logps.clone().requires_grad_(True)
    expected = grpo_loss(leaf, old, ref, advantages, mask, beta=beta, epsilon_high=0.28)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(grad, leaf.grad)
    torch.testing.assert_close(out.kl, expected.kl)
    torch.testing.assert_close(out.low_clipped_per_row, expected.low_clipped_per_row)
    torch.testing.assert_close(out.high_clipped_per_row, expected.high_clipped_per_row)


def token_level_loop(loss_type, logps, old, ref, advantages, mask, beta, denominator, weights, epsilon_high=0.2):
    """Each variant written out per token in float64, for comparison."""
    rows, tokens = logps.shape
    per_token = torch.zeros(rows, tokens, dtype=torch.float64)
    for i in range(rows):
        for t in range(tokens):
            if not mask[i, t]:
                continue
            lp, r, a = float(logps[i, t]), math.exp(float(logps[i, t] - old[i, t])), float(advantages[i])
            if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
                term = -min(r * a, min(max(r, 0.8), 1.0 + epsilon_high) * a)
            elif loss_type == "cispo":
                term = -min(r, epsilon_high) * a * lp
            elif loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05
                term = -4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0))) * a
            else:  # vespo
                term = -float(weights[i]) * a * lp
            d = float(ref[i, t] - logps[i, t])
            per_token[i, t] = term + beta * (math.exp(d) - d - 1.0)
    counts = mask.sum(dim=-1).double()
    aggregation = LOSS_TYPES[loss_type].aggregation
    if aggregation == "sequence_mean":
        return (per_token.sum(-1) / counts.clamp(min=1)).mean()
    if aggregation == "token_mean":
        return per_token.sum() / counts.sum()
    if aggregation == "sequence_sum":
        return per_token.sum(-1).mean()
    return per_token.sum() / denominator


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_each_variant_matches_its_formula_token_by_token(loss_type):
    logps, old, ref, advantages, mask = batch(seed=2)
    kwargs = variant_kwargs(loss_type, logps.shape[0])
    out, _ = run(logps, old, ref, advantages, mask, beta=0.04, **kwargs)
    expected = token_level_loop(
        loss_type,
        logps.double(),
        old.double(),
        ref.double(),
        advantages.double(),
        mask,
        0.04,
        kwargs.get("denominator"),
        kwargs.get("sequence_weights", torch.ones(8, 1)).reshape(-1),
        epsilon_high=kwargs.get("epsilon_high", 0.2),
    )
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(out.loss, out.policy_loss + out.kl_penalty)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_values_at_masked_positions_change_nothing_and_extremes_stay_finite(loss_type, level):
    logps, old, ref, advantages, mask = batch(seed=3)
    kwargs = variant_kwargs(loss_type, logps.shape[0])
    clean, clean_grad = run(logps, old, ref, advantages, mask, importance_sampling_level=level, **kwargs)
    dirty = [t.clone().masked_fill_(~mask, math.nan) for t in (logps, old, ref)]
    weights = torch.ones_like(logps).masked_fill_(~mask, math.inf)
    out, grad = run(
        *dirty[:1], *dirty[1:], advantages, mask, importance_sampling_level=level, token_weights=weights, **kwargs
    )
    torch.testing.assert_close(out.loss, clean.loss)
    torch.testing.assert_close(grad, clean_grad)
    far = old.clone()
    far[0, 0] = logps[0, 0] - 80.0  # exp(80) overflows float32
    extreme, extreme_grad = run(logps, far, ref, advantages, mask, importance_sampling_level=level, **kwargs)
    assert math.isfinite(extreme.loss.item()) and torch.isfinite(extreme_grad).all()


def test_sequence_level_clip_indicators_count_rows():
    logps, old, ref, advantages, mask = batch(seed=4, spread=1.0)
    out = objective(logps, old, ref, advantages, mask, importance_sampling_level="sequence")
    assert torch.equal(out.clip_units_per_row, torch.ones(8, dtype=out.clip_units_per_row.dtype))
    assert set(out.low_clipped_per_row.tolist()) <= {0, 1} and set(out.high_clipped_per_row.tolist()) <= {0, 1}
    ratio = out.ratio
    for row in range(8):  # one ratio per completion, shared by its tokens
        values = ratio[row][mask[row]]
        assert values.numel() == 0 or torch.allclose(values, values[0].expand_as(values))


def test_bias_corrected_kl_is_weighted_by_the_ratio():
    logps, old, ref, advantages, mask = batch(seed=5)
    plain = objective(logps, old, ref, advantages, mask)
    corrected = objective(logps, old, ref, advantages, mask, use_bias_correction_kl=True)
    torch.testing.assert_close(corrected.per_token_kl, plain.per_token_kl * plain.ratio)


def test_delta_caps_the_unclipped_ratio():
    logps, old, ref, advantages, mask = batch(seed=6, spread=1.0)
    advantages = advantages.abs()  # positive advantages: the high side binds
    free = objective(logps, old, None, advantages, mask, beta=0.0, epsilon_high=10.0)
    capped = objective(logps, old, None, advantages, mask, beta=0.0, epsilon_high=10.0, delta=1.5)
    assert capped.loss > free.loss  # a smaller surrogate, a larger loss


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
        ({"loss_type": "dapo"}, "denominator"),
        ({"loss_type": "vespo", "denominator": 1.0}, "sequence_weights"),
        ({"delta": -1.0}, "delta"),
        ({"epsilon": 0.0}, "epsilon"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, message):
    logps, old, ref, advantages, mask = batch(seed=7)
    with pytest.raises(ValueError, match=message):
        objective(logps, old, ref, advantages, mask, **kwargs)


def test_total_loss_adds_the_entropy_bonus_and_the_router_loss_in_the_backward_loss_s_units():
    from trl_grpo_ext.ops import total_loss

    objective = torch.tensor(0.5, requires_grad=True)
    entropy = torch.tensor(2.0, requires_grad=True)
    router = torch.tensor(3.0, requires_grad=True)
    loss, terms = total_loss(objective, scale=0.25, entropy_bonus=(0.1, entropy), router=(0.01, router))
    assert loss.item() == pytest.approx(0.5 - 0.1 * 2.0 * 0.25 + 0.01 * 3.0 * 0.25)
    assert terms["entropy_bonus"].item() == pytest.approx(-0.05) and terms["router"].item() == pytest.approx(0.0075)
    assert not terms["entropy_bonus"].requires_grad and not terms["router"].requires_grad
    loss.backward()
    assert (objective.grad.item(), entropy.grad.item(), router.grad.item()) == pytest.approx((1.0, -0.025, 0.0025))
    alone, none = total_loss(objective, scale=0.25)
    assert alone is objective and none == {}
