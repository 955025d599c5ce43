"""`grpo_loss` and `group_relative_advantages` against independent references."""

import math

import pytest
import torch

from trl_grpo_ext import group_relative_advantages, grpo_loss
from trl_grpo_ext.ops import EXP_LINEAR_ABOVE


def reference_loss_float64(logps, old_logps, ref_logps, advantages, lengths, epsilon, epsilon_high, beta):
    """The objective written as loops over rows and tokens, in float64, straight from the formula."""
    row_objectives = []
    for i in range(logps.shape[0]):
        terms = []
        for t in range(int(lengths[i])):
            ratio = torch.exp(logps[i, t] - old_logps[i, t])
            clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
            surrogate = torch.minimum(ratio * advantages[i], clipped * advantages[i])
            d = ref_logps[i, t] - logps[i, t]
            kl = torch.exp(d) - d - 1
            terms.append(surrogate - beta * kl)
        row_objectives.append(torch.stack(terms).mean() if terms else logps.new_zeros(()))
    return -torch.stack(row_objectives).mean()


def random_batch(num_rows, num_tokens, *, seed, spread=0.3, empty_rows=()):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(num_rows, num_tokens, generator=generator, dtype=torch.float64) * 3
    old_logps = logps + spread * torch.randn(num_rows, num_tokens, generator=generator, dtype=torch.float64)
    ref_logps = logps + spread * torch.randn(num_rows, num_tokens, generator=generator, dtype=torch.float64)
    advantages = torch.randn(num_rows, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, num_tokens + 1, (num_rows,), generator=generator)
    for row in empty_rows:
        lengths[row] = 0
    mask = torch.arange(num_tokens)[None, :] < lengths[:, None]
    return logps, old_logps, ref_logps, advantages, lengths, mask


EAGER = ["fused", "reference"]


@pytest.mark.parametrize("implementation", EAGER)
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_loss_and_gradient_match_float64_reference_on_variable_lengths(seed, epsilon_high, implementation):
    logps, old_logps, ref_logps, advantages, lengths, mask = random_batch(12, 9, seed=seed, empty_rows=(3,))
    eps_high = 0.2 if epsilon_high is None else epsilon_high

    reference_input = logps.clone().requires_grad_(True)
    expected = reference_loss_float64(reference_input, old_logps, ref_logps, advantages, lengths, 0.2, eps_high, 0.04)
    expected.backward()

    policy_input = logps.float().requires_grad_(True)
    out = grpo_loss(
        policy_input,
        old_logps.float(),
        ref_logps.float(),
        advantages.float(),
        mask,
        epsilon_high=epsilon_high,
        implementation=implementation,
    )
    out.loss.backward()

    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(policy_input.grad.double(), reference_input.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("implementation", EAGER)
def test_float64_input_is_computed_in_float64_and_matches_reference_tightly(implementation):
    logps, old_logps, ref_logps, advantages, lengths, mask = random_batch(8, 7, seed=11)
    reference_input = logps.clone().requires_grad_(True)
    expected = reference_loss_float64(reference_input, old_logps, ref_logps, advantages, lengths, 0.2, 0.2, 0.04)
    expected.backward()
    policy_input = logps.clone().requires_grad_(True)
    out = grpo_loss(policy_input, old_logps, ref_logps, advantages, mask, implementation=implementation)
    out.loss.backward()
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(policy_input.grad, reference_input.grad, rtol=1e-10, atol=1e-14)


def test_loss_is_policy_loss_plus_beta_times_kl():
    logps, old_logps, ref_logps, advantages, _, mask = random_batch(6, 5, seed=3)
    out = grpo_loss(logps.float(), old_logps.float(), ref_logps.float(), advantages.float(), mask, beta=0.1)
    torch.testing.assert_close(out.loss.detach(), out.policy_loss + 0.1 * out.kl)
    torch.testing.assert_close(out.kl_penalty, 0.1 * out.kl)
    assert not out.policy_loss.requires_grad and not out.kl.requires_grad
    assert out.kl > 0


def test_advantage_shapes_n_n1_and_nt_give_the_same_loss():
    logps, old_logps, ref_logps, advantages, _, mask = random_batch(6, 5, seed=4)
    losses = [
        grpo_loss(logps, old_logps, ref_logps, adv, mask).loss
        for adv in (advantages, advantages[:, None], advantages[:, None].expand(6, 5).clone())
    ]
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(losses[0], losses[2])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long, torch.int32, torch.float32])
def test_completion_mask_dtypes_agree(mask_dtype):
    logps, old_logps, ref_logps, advantages, _, mask = random_batch(6, 5, seed=5)
    expected = grpo_loss(logps, old_logps, ref_logps, advantages, mask).loss
    got = grpo_loss(logps, old_logps, ref_logps, advantages, mask.to(mask_dtype)).loss
    torch.testing.assert_close(got, expected)


def test_old_logps_none_means_on_policy():
    logps, _, ref_logps, advantages, _, mask = random_batch(6, 5, seed=6)
    implicit = grpo_loss(logps, None, ref_logps, advantages, mask)
    explicit = grpo_loss(logps, logps.clone(), ref_logps, advantages, mask)
    torch.testing.assert_close(implicit.loss, explicit.loss)
    assert torch.all(implicit.ratio[mask] == 1.0)
    assert not implicit.is_low_clipped.any() and not implicit.is_high_clipped.any()


def test_no_gradient_flows_into_old_ref_or_advantages():
    logps, old_logps, ref_logps, advantages, _, mask = random_batch(6, 5, seed=7)
    tensors = [t.clone().requires_grad_(True) for t in (logps, old_logps, ref_logps, advantages)]
    grpo_loss(*tensors, mask).loss.backward()
    assert tensors[0].grad is not None and tensors[0].grad.abs().sum() > 0
    for constant in tensors[1:]:
        assert constant.grad is None


# Seed 001's minimal implementation: prompt tokens first, the same length for every completion, beta = 0.01.
def seed_001_loss(pi_logprob, pi_old_logprob, pi_ref_logprob, advantage, input_len, len_oi, epsilon=0.2, beta=0.01):
    bs, seq_len = pi_logprob.shape
    mask = torch.zeros(bs, seq_len)
    mask[:, input_len:] = 1
    ratio = torch.exp(pi_logprob - pi_old_logprob)
    ratio_clip = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    advantage = advantage.unsqueeze(dim=1)
    surrogate = torch.minimum(ratio * advantage, ratio_clip * advantage)
    kl = pi_ref_logprob.exp() / pi_logprob.exp() - (pi_ref_logprob - pi_logprob) - 1
    loss = (surrogate - beta * kl) * mask
    return ((-1 / bs) * (1 / len_oi) * loss).sum()


def test_seed_001_worked_example_gives_the_same_loss_and_gradient():
    torch.manual_seed(0)
    token_ids = torch.tensor([[11, 12, 13, 14, 15], [11, 12, 13, 15, 16], [11, 12, 13, 16, 17]])

    def gathered(logits):
        return torch.gather(torch.log_softmax(logits, dim=-1), -1, token_ids.unsqueeze(-1)).squeeze(-1)

    pi_logits = torch.randn(3, 5, 32, requires_grad=True)
    pi, pi_ref, pi_old = gathered(pi_logits), gathered(torch.randn(3, 5, 32)), gathered(torch.randn(3, 5, 32))
    advantage = torch.tensor([-1.0, 2.0, 1.0])

    expected = seed_001_loss(pi, pi_old, pi_ref, advantage, input_len=3, len_oi=2)
    (expected_grad,) = torch.autograd.grad(expected, pi_logits, retain_graph=True)

    completion_mask = torch.zeros(3, 5, dtype=torch.bool)
    completion_mask[:, 3:] = True
    out = grpo_loss(pi, pi_old, pi_ref, advantage, completion_mask, epsilon=0.2, beta=0.01)
    (grad,) = torch.autograd.grad(out.loss, pi_logits)

    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize(
    ("pi", "pi_ref", "seed_001_output"),
    [(0.5, 0.6, 0.0014), (0.4, 0.401, 0.0000), (0.1, 0.401, 0.1297)],
)
def test_seed_001_notebook_group_of_eight_leaves_only_the_kl(pi, pi_ref, seed_001_output):
    # One token per completion, the same probability for all eight, pi == pi_old: the centred advantages cancel in
    # the policy term and the summed loss is 8 * beta * K, the figure the notebook printed.
    rewards = torch.tensor([1.0, 1, 0, 0, 0, 0, 0, 0])
    advantages = group_relative_advantages(rewards, 8, eps=1e-5)
    logps = torch.full((8, 1), math.log(pi))
    out = grpo_loss(logps, logps, torch.full((8, 1), math.log(pi_ref)), advantages, torch.ones(8, 1), beta=0.01)
    assert abs(out.policy_loss.item()) < 1e-7
    assert round(8 * out.loss.item(), 4) == seed_001_output


def test_zero_loss_does_not_mean_zero_gradient():
    # Seed 001: on-policy, with centred advantages, the policy loss is 0 but its gradient is not.
    logits = torch.randn(4, 3, 10, requires_grad=True)
    tokens = torch.randint(0, 10, (4, 3))
    logps = torch.gather(torch.log_softmax(logits, -1), -1, tokens[..., None]).squeeze(-1)
    advantages = group_relative_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    out = grpo_loss(logps, None, None, advantages, torch.ones(4, 3), beta=0.0)
    out.loss.backward()
    assert abs(out.loss.item()) < 1e-6
    assert logits.grad.abs().max() > 1e-3


@pytest.mark.parametrize("implementation", EAGER)
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf"), 1e30])
def test_values_at_masked_positions_change_neither_loss_nor_gradient(garbage, implementation):
    logps, old_logps, ref_logps, advantages, _, mask = random_batch(6, 7, seed=8, empty_rows=(2,))
    advantages_nt = advantages[:, None].expand(6, 7).clone()
    clean_input = logps.float().requires_grad_(True)
    clean = grpo_loss(
        clean_input, old_logps.float(), ref_logps.float(), advantages_nt.float(), mask, implementation=implementation
    )
    clean.loss.backward()

    def dirty(tensor):
        return torch.where(mask, tensor.float(), garbage)

    dirty_input = dirty(logps).requires_grad_(True)
    out = grpo_loss(
        dirty_input, dirty(old_logps), dirty(ref_logps), dirty(advantages_nt), mask, implementation=implementation
    )
    out.loss.backward()

    torch.testing.assert_close(out.loss, clean.loss)
    torch.testing.assert_close(dirty_input.grad, clean_input.grad)
    assert torch.all(dirty_input.grad[~mask] == 0)
    for per_token in (out.ratio, out.per_token_kl, out.log_ratio):
        assert torch.isfinite(per_token).all()


@pytest.mark.parametrize("implementation", EAGER)
def test_rows_without_tokens_add_zero_but_count_in_the_row_mean(implementation):
    logps, old_logps, ref_logps, advantages, lengths, mask = random_batch(6, 5, seed=9, empty_rows=(0, 4))
    full = grpo_loss(logps, old_logps, ref_logps, advantages, mask, implementation=implementation)
    keep = lengths > 0
    only_non_empty = grpo_loss(logps[keep], old_logps[keep], ref_logps[keep], advantages[keep], mask[keep])
    torch.testing.assert_close(full.loss, only_non_empty.loss * keep.sum() / len(keep))


@pytest.mark.parametrize("implementation", EAGER)
def test_a_batch_without_completion_tokens_gives_zero_loss_and_zero_gradient(implementation):
    logps = torch.full((4, 3), float("nan"), requires_grad=True)
    out = grpo_loss(
        logps, logps.detach(), logps.detach(), torch.ones(4), torch.zeros(4, 3), implementation=implementation
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.kl.item() == 0.0 and out.policy_loss.item() == 0.0
    assert torch.all(logps.grad == 0)


@pytest.mark.parametrize("implementation", EAGER)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [20.0, 50.0, 100.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_log_differences_stay_finite(dtype, size, sign, implementation):
    logps = torch.full((4, 3), -30.0 if sign > 0 else -1.0)
    old_logps = logps - sign * size  # log ratio = sign * size
    ref_logps = logps + sign * size  # ref - logp = sign * size
    advantages = torch.tensor([1.0, -1.0, 0.0, 2.0])
    policy_input = logps.to(dtype).clone().requires_grad_(True)
    out = grpo_loss(
        policy_input,
        old_logps.to(dtype),
        ref_logps.to(dtype),
        advantages.to(dtype),
        torch.ones(4, 3),
        implementation=implementation,
    )
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss) and torch.isfinite(out.kl) and torch.isfinite(out.policy_loss)
    assert torch.isfinite(policy_input.grad.float()).all()
    assert (out.per_token_kl >= 0).all()
    if sign > 0:
        # logp far below ref: the KL gradient must push logp up (a negative gradient of the loss).
        kl_input = logps.clone().requires_grad_(True)
        grpo_loss(
            kl_input, logps, ref_logps, torch.zeros(4), torch.ones(4, 3), implementation=implementation
        ).loss.backward()
        assert (kl_input.grad < 0).all()


def test_log_differences_up_to_the_threshold_are_exact_in_float32():
    d = torch.linspace(-EXP_LINEAR_ABOVE, EXP_LINEAR_ABOVE, 41)
    logps = torch.full((41, 1), -25.0)
    out = grpo_loss(logps, logps - d[:, None], logps + d[:, None], torch.zeros(41), torch.ones(41, 1), beta=1.0)
    expected_kl = (d.double().exp() - d.double() - 1)[:, None]
    torch.testing.assert_close(out.per_token_kl.double(), expected_kl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.ratio.double(), d.double().exp()[:, None], rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("implementation", EAGER)
def test_above_the_threshold_exp_continues_linearly_with_a_bounded_positive_slope(implementation):
    d = torch.tensor([[EXP_LINEAR_ABOVE + 1.0], [EXP_LINEAR_ABOVE + 100.0]], dtype=torch.float64)
    logps = torch.zeros(2, 1, dtype=torch.float64, requires_grad=True)
    out = grpo_loss(
        logps,
        logps.detach() - d,
        None,
        torch.ones(2) * -1.0,
        torch.ones(2, 1),
        beta=0.0,
        implementation=implementation,
    )
    cap = math.exp(EXP_LINEAR_ABOVE)
    torch.testing.assert_close(out.ratio, cap * (1 + d - EXP_LINEAR_ABOVE))
    out.loss.backward()
    # loss = -(1/2) * sum(ratio * A) with A = -1: d loss / d logp = ratio' / 2 = cap / 2 above the threshold
    torch.testing.assert_close(logps.grad, torch.full((2, 1), cap / 2, dtype=torch.float64))


def test_bfloat16_inputs_are_computed_in_float32():
    logps, old_logps, ref_logps, advantages, _, mask = random_batch(8, 6, seed=10)
    bf16 = [t.to(torch.bfloat16) for t in (logps, old_logps, ref_logps, advantages)]
    policy_input = bf16[0].clone().requires_grad_(True)
    out = grpo_loss(policy_input, *bf16[1:], mask)
    out.loss.backward()
    expected = grpo_loss(*[t.float() for t in bf16], mask)
    assert out.loss.dtype == torch.float32 and out.ratio.dtype == torch.float32
    assert policy_input.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, expected.loss)


def test_clip_masks_follow_trl_definitions():
    logps = torch.log(torch.tensor([[0.5, 1.5, 0.9, 1.1]]))  # ratios against old_logps = 0
    old_logps = torch.zeros(1, 4)
    for advantage, low, high in ((-1.0, [True, False, False, False], [False] * 4), (1.0, [False] * 4, [0, 1, 0, 0])):
        out = grpo_loss(logps, old_logps, None, torch.tensor([advantage]), torch.ones(1, 4), beta=0.0)
        assert out.is_low_clipped.tolist() == [low]
        assert out.is_high_clipped.tolist() == [[bool(x) for x in high]]
        assert out.is_region_clipped.tolist() == [[a or b for a, b in zip(low, high, strict=True)]]


def test_clipped_tokens_get_no_policy_gradient():
    logps = torch.log(torch.tensor([[0.5, 1.5, 1.0]])).requires_grad_(True)
    for advantage, flat in ((-1.0, [True, False, False]), (1.0, [False, True, False])):
        logps.grad = None
        grpo_loss(
            logps, torch.zeros(1, 3), None, torch.tensor([advantage]), torch.ones(1, 3), beta=0.0
        ).loss.backward()
        assert [g == 0 for g in logps.grad[0].tolist()] == flat


class TestGrpoLossErrors:
    def batch(self):
        return torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4), torch.ones(4, 3)

    @pytest.mark.parametrize("name", ["old_logps", "ref_logps", "completion_mask"])
    def test_shape_mismatch_names_the_argument(self, name):
        logps, old, ref, adv, mask = self.batch()
        kwargs = dict(logps=logps, old_logps=old, ref_logps=ref, advantages=adv, completion_mask=mask)
        kwargs[name] = torch.zeros(4, 2)
        with pytest.raises(ValueError, match=f"`{name}` has shape"):
            grpo_loss(**kwargs)

    @pytest.mark.parametrize("shape", [(3,), (4, 2), (2, 4), (4, 3, 1)])
    def test_bad_advantages_shape(self, shape):
        logps, old, ref, _, mask = self.batch()
        with pytest.raises(ValueError, match="`advantages` has shape"):
            grpo_loss(logps, old, ref, torch.zeros(shape), mask)

    @pytest.mark.parametrize("shape", [(0, 3), (4, 0)])
    def test_empty_batch(self, shape):
        with pytest.raises(ValueError, match="`logps` is empty"):
            grpo_loss(torch.zeros(shape), None, None, torch.zeros(shape[0]), torch.ones(shape), beta=0.0)

    def test_logps_must_be_two_dimensional_floating_point(self):
        with pytest.raises(ValueError, match="`logps` must be a 2-dim"):
            grpo_loss(torch.zeros(4), None, None, torch.zeros(4), torch.ones(4), beta=0.0)
        with pytest.raises(ValueError, match="`logps` must be a floating-point"):
            grpo_loss(torch.zeros(4, 3, dtype=torch.long), None, None, torch.zeros(4), torch.ones(4, 3), beta=0.0)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            (dict(epsilon=0.0), "`epsilon`"),
            (dict(epsilon=-0.1), "`epsilon`"),
            (dict(epsilon=float("nan")), "`epsilon`"),
            (dict(epsilon_high=-0.01), "`epsilon_high`"),
            (dict(beta=-0.04), "`beta`"),
            (dict(beta=float("inf")), "`beta`"),
            (dict(implementation="triton"), "`implementation`"),
        ],
    )
    def test_bad_hyperparameters(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            grpo_loss(*self.batch(), **kwargs)

    def test_missing_ref_logps_with_positive_beta(self):
        logps, old, _, adv, mask = self.batch()
        with pytest.raises(ValueError, match="`ref_logps` is None but `beta`"):
            grpo_loss(logps, old, None, adv, mask, beta=0.04)
        assert grpo_loss(logps, old, None, adv, mask, beta=0.0).kl.item() == 0.0

    def test_device_mismatch_on_meta_device_names_the_argument(self):
        logps, old, ref, adv, mask = self.batch()
        with pytest.raises(ValueError, match="`ref_logps` is on meta"):
            grpo_loss(logps, old, ref.to("meta"), adv, mask)
        with pytest.raises(ValueError, match="`advantages` is on meta"):
            grpo_loss(logps, old, ref, adv.to("meta"), mask)


class TestGroupRelativeAdvantages:
    def test_matches_the_formula_with_unbiased_std(self):
        rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 3.0, 1.0, 0.0])
        expected = []
        for group in rewards.view(2, 4):
            expected.append((group - group.mean()) / (group.std() + 1e-4))
        torch.testing.assert_close(group_relative_advantages(rewards, 4), torch.cat(expected))

    def test_equal_rewards_give_exactly_zero(self):
        rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1 / 3, 1 / 3, 1 / 3])
        assert torch.all(group_relative_advantages(rewards, 3) == 0)

    def test_scale_false_only_centres(self):
        rewards = torch.tensor([1.0, 3.0, 10.0, 20.0])
        torch.testing.assert_close(group_relative_advantages(rewards, 2, scale=False), torch.tensor([-1.0, 1, -5, 5]))

    def test_invariant_to_shift_and_positive_scale(self):
        rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
        base = group_relative_advantages(rewards, 4, eps=0.0)
        torch.testing.assert_close(group_relative_advantages(rewards * 7 + 3, 4, eps=0.0), base)

    def test_matches_trl_advantages(self):
        from trl.trainer.utils import nanstd

        rewards = torch.randn(32, generator=torch.Generator().manual_seed(1))
        grouped = rewards.view(-1, 8)
        mean = grouped.mean(dim=1).repeat_interleave(8)
        std = nanstd(grouped, dim=1).repeat_interleave(8)
        torch.testing.assert_close(group_relative_advantages(rewards, 8), (rewards - mean) / (std + 1e-4))

    def test_unscored_completions_leave_the_baseline_and_get_zero(self):
        rewards = torch.tensor([1.0, float("nan"), 0.0, 2.0, float("nan"), float("nan"), float("nan"), 5.0])
        advantages = group_relative_advantages(rewards, 4)
        scored = torch.tensor([1.0, 0.0, 2.0])
        torch.testing.assert_close(advantages[[0, 2, 3]], (scored - 1.0) / (scored.std() + 1e-4))
        assert advantages[1] == 0 and torch.all(advantages[4:] == 0)
        assert torch.isfinite(advantages).all()

    @pytest.mark.parametrize(
        ("rewards", "num_generations", "message"),
        [
            (torch.zeros(6), 4, "does not divide"),
            (torch.zeros(6), 1, "`num_generations` must be an int >= 2"),
            (torch.zeros(6), 0, "`num_generations` must be an int >= 2"),
            (torch.zeros(6), 2.0, "`num_generations` must be an int >= 2"),
            (torch.zeros(2, 3), 3, "`rewards` must be a 1-dim"),
            (torch.zeros(0), 2, "`rewards` is empty"),
        ],
    )
    def test_errors(self, rewards, num_generations, message):
        with pytest.raises(ValueError, match=message):
            group_relative_advantages(rewards, num_generations)


def test_no_spread_is_defined_once_as_trl_s_zero_test():
    """`has_spread`: finite and above TRL's `torch.isclose(std, 0)` tolerance; what dynamic sampling keeps
    (`sampling.plan.informative_groups`) and the diagnostics count (`reward_std/frac_zero_groups`) both read it."""
    from trl_grpo_ext.extras.plan import informative_groups
    from trl_grpo_ext.ops import NO_SPREAD_STD, has_spread

    std = torch.tensor([0.0, NO_SPREAD_STD, 2 * NO_SPREAD_STD, 0.5, float("nan"), float("inf")])
    assert has_spread(std).tolist() == [False, False, True, True, False, False]
    assert torch.equal(~has_spread(std[:4]), torch.isclose(std[:4], torch.zeros(4)))  # TRL's test where it is defined
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, float("nan"), 0.2, 0.2 + 1e-9])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]
