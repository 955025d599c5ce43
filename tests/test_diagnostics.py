"""Diagnostics: each statistic against an independent recomputation, and what a training run logs."""

import math

import pytest
import torch
from helpers import run_alone, train_logs

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt, grpo_loss
from trl_grpo_ext.diagnostics import DiagnosticsAccumulator
from trl_grpo_ext.diagnostics.histogram import (
    CORE_BIN_WIDTH,
    CORE_LOG_RATIO,
    NUM_BINS,
    TAIL_LOG_RATIO,
    histogram_quantiles,
    log_ratio_bin_bounds,
    log_ratio_bins,
    quantile_metric_name,
)

QUANTILES = [0.0, 0.05, 0.25, 0.5, 0.95, 1.0]


def captured_batch(seed, num_rows=8, num_tokens=12, spread=0.15):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(num_rows, num_tokens, generator=generator) * 4
    old_logps = logps + spread * torch.randn(num_rows, num_tokens, generator=generator)
    ref_logps = logps + spread * torch.randn(num_rows, num_tokens, generator=generator)
    lengths = torch.randint(0, num_tokens + 1, (num_rows,), generator=generator)
    mask = torch.arange(num_tokens)[None] < lengths[:, None]
    advantages = torch.randn(num_rows, generator=generator)
    entropies = torch.rand(num_rows, num_tokens, generator=generator) * 3
    return grpo_loss(logps, old_logps, ref_logps, advantages, mask), entropies


def summarize(accumulators):
    """What the log step does, with `num_processes = len(accumulators)`."""
    gathered = torch.stack([accumulator.pack() for accumulator in accumulators])
    return accumulators[0].summarize(gathered)


def accumulate(batches, **kwargs):
    accumulator = DiagnosticsAccumulator(quantiles=QUANTILES, **kwargs)
    for out, entropies in batches:
        accumulator.add_loss_step(out, entropies)
    return accumulator


class TestAgainstRecomputation:
    @pytest.fixture
    def batches(self):
        return [captured_batch(seed) for seed in range(3)]

    def test_ratio_moments_and_extremes_are_exact(self, batches):
        summary = summarize([accumulate(batches)])
        ratios = torch.cat([out.ratio[out.mask] for out, _ in batches]).double()
        assert summary.scalars["ratio/mean"] == pytest.approx(ratios.mean().item(), rel=1e-12)
        assert summary.scalars["ratio/std"] == pytest.approx(ratios.std().item(), rel=1e-9)
        assert summary.scalars["ratio/min"] == ratios.min().item()
        assert summary.scalars["ratio/max"] == ratios.max().item()

    def test_quantiles_lie_within_one_bin_of_the_sample_quantiles(self, batches):
        summary = summarize([accumulate(batches)])
        log_ratios = torch.cat([out.log_ratio[out.mask] for out, _ in batches]).double()
        for quantile in QUANTILES:
            got = math.log(summary.scalars[quantile_metric_name(quantile)])
            lower = torch.quantile(log_ratios, quantile, interpolation="lower").item()
            higher = torch.quantile(log_ratios, quantile, interpolation="higher").item()
            assert lower - CORE_BIN_WIDTH - 1e-12 <= got <= higher + CORE_BIN_WIDTH + 1e-12, quantile
        assert summary.scalars["ratio/p00"] == summary.scalars["ratio/min"]
        assert summary.scalars["ratio/p100"] == summary.scalars["ratio/max"]

    def test_loss_split_is_the_mean_over_micro_batches(self, batches):
        summary = summarize([accumulate(batches)])
        assert summary.scalars["loss/policy"] == pytest.approx(
            sum(out.policy_loss.item() for out, _ in batches) / 3, rel=1e-6
        )
        assert summary.scalars["loss/kl_penalty"] == pytest.approx(
            sum(out.kl_penalty.item() for out, _ in batches) / 3, rel=1e-6
        )
        total = sum(out.loss.item() for out, _ in batches) / 3
        assert summary.scalars["loss/policy"] + summary.scalars["loss/kl_penalty"] == pytest.approx(total, rel=1e-6)

    def test_trl_metrics_per_micro_batch_use_trl_definitions(self, batches):
        summary = summarize([accumulate(batches)])
        for step, (out, entropies) in enumerate(batches):
            mask = out.mask
            tokens = mask.sum().item()

            def token_mean(values, mask=mask, tokens=tokens):
                return values[mask].double().sum().item() / tokens

            assert summary.per_step["kl"][step] == pytest.approx(token_mean(out.per_token_kl), rel=1e-6)
            assert summary.per_step["entropy"][step] == pytest.approx(token_mean(entropies), rel=1e-6)
            low, high = out.is_low_clipped.double(), out.is_high_clipped.double()
            assert summary.per_step["clip_ratio/low_mean"][step] == pytest.approx(token_mean(low))
            assert summary.per_step["clip_ratio/high_mean"][step] == pytest.approx(token_mean(high))
            assert summary.per_step["clip_ratio/region_mean"][step] == pytest.approx(token_mean(low + high))
            rows = mask.any(dim=1)
            low_rows = (low * mask).sum(1)[rows] / mask.sum(1)[rows]
            high_rows = (high * mask).sum(1)[rows] / mask.sum(1)[rows]
            assert summary.per_step["clip_ratio/low_min"][step] == pytest.approx(low_rows.min().item())
            assert summary.per_step["clip_ratio/high_max"][step] == pytest.approx(high_rows.max().item())

    def test_two_processes_report_the_statistics_of_their_pooled_tokens(self, batches):
        first, second = accumulate(batches[:2]), accumulate([batches[2], captured_batch(7)])
        pooled_batches = batches + [captured_batch(7)]
        split = summarize([first, second])
        ratios = torch.cat([out.ratio[out.mask] for out, _ in pooled_batches]).double()
        assert split.scalars["ratio/mean"] == pytest.approx(ratios.mean().item(), rel=1e-12)
        assert split.scalars["ratio/std"] == pytest.approx(ratios.std().item(), rel=1e-9)
        assert split.scalars["ratio/min"] == ratios.min().item()
        assert split.scalars["ratio/max"] == ratios.max().item()
        # Per micro-batch metrics pool the two processes' micro-batch k (TRL's global means).
        out_a, out_b = batches[0][0], batches[2][0]
        kl = (out_a.per_token_kl[out_a.mask].sum() + out_b.per_token_kl[out_b.mask].sum()).item()
        assert split.per_step["kl"][0] == pytest.approx(kl / (out_a.mask.sum() + out_b.mask.sum()).item(), rel=1e-6)

    def test_nan_ratios_are_counted_not_hidden(self):
        out, entropies = captured_batch(0)
        out.log_ratio[0, 0], out.ratio[0, 0], out.mask[0, 0] = math.nan, math.nan, True
        summary = summarize([accumulate([(out, entropies)])])
        assert summary.scalars["ratio/nan_count"] == 1

    def test_without_ratio_stats_only_trl_metrics_remain(self, batches):
        summary = summarize([accumulate(batches, ratio_stats=False)])
        assert not summary.scalars and not summary.histograms
        assert len(summary.per_step["kl"]) == 3


class TestRewardSpread:
    def test_group_std_statistics(self):
        accumulator = DiagnosticsAccumulator()
        accumulator.add_rewards(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0]), 4)
        accumulator.add_rewards(torch.tensor([0.0, 3.0, 1.0, 1.0]), 4)
        summary = accumulator.summarize(None)
        stds = [torch.tensor([1.0, 0, 0, 0]).std().item(), 0.0, torch.tensor([0.0, 3, 1, 1]).std().item()]
        assert summary.scalars["reward_std/group_mean"] == pytest.approx(sum(stds) / 3)
        assert summary.scalars["reward_std/group_min"] == 0.0
        assert summary.scalars["reward_std/group_max"] == pytest.approx(max(stds))
        assert summary.histograms["reward_std/group"][4] == 3  # number of groups

    def test_unscored_completions_are_left_out_of_their_group(self):
        accumulator = DiagnosticsAccumulator()
        accumulator.add_rewards(torch.tensor([1.0, math.nan, 3.0, math.nan, math.nan, math.nan]), 3)
        summary = accumulator.summarize(None)
        # The first group's std is that of [1, 3]; the second group has no scored completion and no spread.
        assert summary.scalars["reward_std/group_mean"] == pytest.approx(torch.tensor([1.0, 3.0]).std().item())

    def test_length_reward_correlation_is_pooled_inside_groups(self):
        accumulator = DiagnosticsAccumulator()
        rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 5.0, 1.0, 3.0, 3.0])
        lengths = torch.tensor([3, 5, 9, 1, 2, 8, 4, 4])
        accumulator.add_rewards(rewards, 4, lengths)
        summary = accumulator.summarize(None)
        expected = pooled_within_group_correlation(rewards, lengths, 4)
        assert summary.scalars["reward_length_corr/within_group"] == pytest.approx(expected)
        # Shifting one group's lengths (a longer prompt, say) changes nothing: only the spread inside groups counts.
        accumulator.add_rewards(rewards, 4, lengths + torch.tensor([0, 0, 0, 0, 100, 100, 100, 100]))
        assert accumulator.summarize(None).scalars["reward_length_corr/within_group"] == pytest.approx(expected)

    def test_two_processes_pool_their_completions_through_the_one_gather(self):
        rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 5.0, 1.0, 3.0, 3.0])
        lengths = torch.tensor([3, 5, 9, 1, 2, 8, 4, 4])
        out, entropies = captured_batch(0)
        processes = [DiagnosticsAccumulator(), DiagnosticsAccumulator()]
        for rank, accumulator in enumerate(processes):  # each holds its half: one whole group of 4
            accumulator.add_loss_step(out, entropies)
            accumulator.add_rewards(rewards, 4, lengths[4 * rank : 4 * rank + 4], first_row=4 * rank)
        pooled = summarize(processes).scalars["reward_length_corr/within_group"]
        assert pooled == pytest.approx(pooled_within_group_correlation(rewards, lengths, 4))
        # A group split over the processes is centred on the part each process holds.
        processes = [DiagnosticsAccumulator(), DiagnosticsAccumulator()]
        for rank, accumulator in enumerate(processes):
            accumulator.add_loss_step(out, entropies)
            accumulator.add_rewards(rewards, 8, lengths[4 * rank : 4 * rank + 4], first_row=4 * rank)
        split = summarize(processes).scalars["reward_length_corr/within_group"]
        assert split == pytest.approx(pooled_within_group_correlation(rewards, lengths, 4))

    def test_a_reward_equal_to_the_length_correlates_fully_and_equal_lengths_give_no_value(self):
        accumulator = DiagnosticsAccumulator()
        accumulator.add_rewards(torch.tensor([3.0, 5.0, 1.0, 1.0]), 4, torch.tensor([3, 5, 1, 1]))
        assert accumulator.summarize(None).scalars["reward_length_corr/within_group"] == pytest.approx(1.0)
        accumulator.add_rewards(torch.tensor([3.0, 5.0, 1.0, 1.0]), 4, torch.tensor([8, 8, 8, 8]))
        assert "reward_length_corr/within_group" not in accumulator.summarize(None).scalars
        accumulator.add_rewards(torch.tensor([0.1, 0.1, 0.1, 0.1]), 4, torch.tensor([1, 2, 3, 4]))  # no spread
        assert "reward_length_corr/within_group" not in accumulator.summarize(None).scalars

    def test_groups_without_reward_spread_leave_the_correlation_as_the_groups_with_spread_give_it(self):
        """They have advantage 0 and push no length either way: a reward equal to the length wherever rewards
        differ correlates fully, however many groups are flat."""
        accumulator = DiagnosticsAccumulator()
        rewards = torch.tensor([3.0, 5.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
        lengths = torch.tensor([3, 5, 1, 2, 1, 6, 9, 4, 2, 8, 3, 7])
        accumulator.add_rewards(rewards, 4, lengths)
        assert accumulator.summarize(None).scalars["reward_length_corr/within_group"] == pytest.approx(1.0)


def pooled_within_group_correlation(rewards, lengths, group_size) -> float:
    """Centre each group on its own means, then one Pearson correlation over every centred row."""
    r, length = rewards.double().reshape(-1, group_size), lengths.double().reshape(-1, group_size)
    r, length = (r - r.mean(dim=1, keepdim=True)).flatten(), (length - length.mean(dim=1, keepdim=True)).flatten()
    return ((r * length).sum() / (r.pow(2).sum() * length.pow(2).sum()).sqrt()).item()


@pytest.mark.parametrize("implementation", ["fused", "compiled"])
def test_the_kernel_s_outputs_log_what_the_formula_s_log(implementation):
    """The ratio statistics come from the log ratios the loss returns, whichever implementation computed them."""
    summaries = {}
    for side in ("reference", implementation):
        outs = []
        for seed in range(4):
            generator = torch.Generator().manual_seed(seed)
            logps = -torch.rand(6, 40, generator=generator) * 4
            old_logps = logps + 0.4 * torch.randn(6, 40, generator=generator)
            mask = torch.arange(40)[None] < torch.randint(0, 41, (6, 1), generator=generator)
            advantages = torch.randn(6, generator=generator)
            outs.append(grpo_loss(logps, old_logps, logps.detach(), advantages, mask, implementation=side))
        summaries[side] = summarize(
            [accumulate([(out, None) for out in outs[:2]]), accumulate([(out, None) for out in outs[2:]])]
        )
    formula, kernel = summaries["reference"], summaries[implementation]
    assert kernel.scalars.keys() == formula.scalars.keys()
    for name, value in formula.scalars.items():
        assert kernel.scalars[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name  # float32 sums, reordered
    assert kernel.histograms["ratio"][1] == formula.histograms["ratio"][1]


def test_the_ratio_statistics_read_nothing_on_the_host_from_their_first_call():
    """Their bin edges are made on the device (a tensor made from host data would be a blocking copy on a GPU)."""
    from benchmarks.syncs import SyncCounter
    from trl_grpo_ext.diagnostics import histogram

    out, _ = captured_batch(0)
    histogram._edges.cache_clear()
    histogram._edge_bounds.cache_clear()
    with SyncCounter("cpu") as counter:
        histogram.ratio_sums(out.log_ratio, out.mask, torch.float64, out.ratio)
    assert counter.total() == 0


class TestHistogram:
    def test_values_at_and_next_to_every_edge_land_in_the_bin_that_bounds_them(self):
        lower, upper = log_ratio_bin_bounds()
        edges = torch.cat([lower[1:], upper[:-1]]).to(torch.float32)
        edges = edges[torch.isfinite(edges)]
        values = torch.cat(
            [edges, torch.nextafter(edges, torch.full_like(edges, math.inf)), torch.nextafter(edges, -edges * 2)]
        )
        values = torch.cat([values, -values, torch.tensor([0.0, -0.0, 1e-42, -1e-42, 2.0**-136, 2.0**-126])])
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            wide = values.to(dtype).double()
            bins = log_ratio_bins(values.to(dtype))
            assert torch.all((lower[bins] <= wide) & (wide <= upper[bins])), dtype
            assert torch.all((wide < upper[bins]) | (upper[bins] == 0)), dtype  # upper bounds are open but x == 0's

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_the_bins_are_those_a_binary_search_over_the_edges_finds(self, dtype):
        from trl_grpo_ext.diagnostics.histogram import _edges

        generator = torch.Generator().manual_seed(3)
        values = torch.cat([torch.randn(50000, generator=generator, dtype=torch.float64) * s for s in (0.01, 1, 100)])
        edges = _edges().to(dtype)
        near = torch.cat([torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1), edges])
        values = torch.cat([values.to(dtype), near, torch.tensor([math.inf, -math.inf, 0.0], dtype=dtype)])
        expected = torch.bucketize(values, edges, right=True) + (values > 0)  # the x == 0 bin set apart
        assert torch.equal(log_ratio_bins(values), expected)

    def test_tail_bins_are_geometric(self):
        """Tail bins are 7.9% wider than the one before, their edges the float32 values nearest the design."""
        lower, upper = log_ratio_bin_bounds()
        positive_tail = (lower >= CORE_LOG_RATIO) & (upper <= TAIL_LOG_RATIO)
        edges = lower[positive_tail]
        designed = CORE_LOG_RATIO * (TAIL_LOG_RATIO / CORE_LOG_RATIO) ** (torch.arange(64, dtype=torch.float64) / 64)
        assert edges.numel() == 64
        assert ((edges - designed).abs() / designed).max().item() <= 2.0**-24
        negative_tail = (upper <= -CORE_LOG_RATIO) & (lower >= -TAIL_LOG_RATIO)
        assert torch.equal(lower[negative_tail].flip(0), -upper[positive_tail])

    def test_bins_are_ascending_contiguous_and_fine_near_one(self):
        lower, upper = log_ratio_bin_bounds()
        assert lower.numel() == upper.numel() == NUM_BINS - 1  # all but the NaN bin
        assert torch.all(lower[1:] >= lower[:-1]) and torch.all(upper[:-1] <= lower[1:] + 1e-15)
        core = (lower.abs() < CORE_LOG_RATIO) & (upper.abs() <= CORE_LOG_RATIO)
        assert (upper[core] - lower[core]).max().item() <= CORE_BIN_WIDTH + 1e-15
        assert CORE_BIN_WIDTH < 1e-3  # relative resolution of the ratio near 1
        assert NUM_BINS < 5000  # the gathered vector stays small

    def test_every_value_lands_in_the_bin_that_bounds_it(self):
        generator = torch.Generator().manual_seed(0)
        values = torch.cat(
            [
                torch.randn(20000, generator=generator, dtype=torch.float64) * 3,
                torch.rand(20000, generator=generator, dtype=torch.float64) - 0.5,
                torch.tensor(
                    [
                        0.0,
                        -CORE_LOG_RATIO,
                        CORE_LOG_RATIO,
                        TAIL_LOG_RATIO,
                        -TAIL_LOG_RATIO,
                        1e9,
                        -1e9,
                        1e-12,
                        math.inf,
                        -math.inf,
                    ],
                    dtype=torch.float64,
                ),
            ]
        )
        bins = log_ratio_bins(values)
        lower, upper = log_ratio_bin_bounds()
        assert torch.all((lower[bins] <= values) & (values <= upper[bins]))
        assert log_ratio_bins(torch.tensor([0.0])).item() != log_ratio_bins(torch.tensor([1e-12])).item()
        assert log_ratio_bins(torch.tensor([math.nan])).item() == NUM_BINS - 1

    def test_quantiles_of_a_known_histogram(self):
        lower = torch.tensor([-math.inf, 0.0, 1.0, 2.0], dtype=torch.float64)
        upper = torch.tensor([0.0, 1.0, 2.0, math.inf], dtype=torch.float64)
        counts = torch.tensor([0.0, 2.0, 2.0, 0.0])  # two values in [0, 1], two in [1, 2]
        low, median, high = histogram_quantiles(counts, lower, upper, [0.0, 0.5, 1.0], 0.2, 1.9)
        assert (low, high) == (0.2, 1.9)
        assert 0.75 <= median <= 1.25

    def test_quantile_names(self):
        names = [quantile_metric_name(q) for q in (0.05, 0.5, 0.95, 0.999, 0.0, 1.0)]
        assert names == ["ratio/p05", "ratio/p50", "ratio/p95", "ratio/p99.9", "ratio/p00", "ratio/p100"]

    def test_ratio_histogram_counts_every_token(self):
        batches = [captured_batch(seed) for seed in range(2)]
        summary = summarize([accumulate(batches)])
        limits, counts, minimum, maximum, number, total, squares = summary.histograms["ratio"]
        ratios = torch.cat([out.ratio[out.mask] for out, _ in batches]).double()
        assert number == sum(counts) == ratios.numel()
        assert limits == sorted(limits) and limits[-1] == maximum == ratios.max().item()
        assert total == pytest.approx(ratios.sum().item()) and squares == pytest.approx(ratios.pow(2).sum().item())
        assert len(counts) <= 70


DIAGNOSTIC_NAMES = [
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "ratio/mean",
    "ratio/std",
    "ratio/min",
    "ratio/max",
    "ratio/p05",
    "ratio/p50",
    "ratio/p95",
    "loss/policy",
    "loss/kl_penalty",
    "kl",
    "entropy",
    "grad_norm",
    "learning_rate",
]
# Logged at the steps that generate (TRL's convention: with num_iterations=2, every other step).
GENERATION_NAMES = [
    "reward",
    "rewards/count_a_reward/mean",
    "completions/mean_length",
    "reward_std/group_mean",
    "reward_std/group_min",
    "reward_std/group_max",
    "frac_reward_zero_std",
]


def test_every_log_step_has_every_metric_with_consistent_values(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    logs, _ = train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, num_iterations=2, max_steps=6)
    assert len(logs) == 6
    for step, entry in enumerate(logs, start=1):
        assert set(DIAGNOSTIC_NAMES) <= set(entry), step
        if step % 2 == 1:  # generating steps carry the reward statistics (TRL's convention)
            assert set(GENERATION_NAMES) <= set(entry), step
            assert entry["reward_std/group_min"] <= entry["reward_std/group_mean"] <= entry["reward_std/group_max"]
        assert entry["ratio/min"] <= entry["ratio/p05"] <= entry["ratio/p50"] <= entry["ratio/p95"]
        assert entry["ratio/p95"] <= entry["ratio/max"]
        assert entry["loss/policy"] + entry["loss/kl_penalty"] == pytest.approx(entry["loss"], rel=1e-4, abs=1e-7)


def test_reused_generations_move_the_ratios_and_clip(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    logs, _ = train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, num_iterations=2)
    reused = logs[1::2]
    assert all(entry["ratio/std"] > 0 and entry["ratio/max"] > entry["ratio/min"] for entry in reused)
    assert any(entry["clip_ratio/region_mean"] > 0 for entry in reused)


def test_on_policy_ratios_are_exactly_one(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    logs, _ = train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, num_iterations=1)
    for entry in logs:
        for name in ("ratio/mean", "ratio/min", "ratio/max", "ratio/p05", "ratio/p50", "ratio/p95"):
            assert entry[name] == 1.0, name
        assert entry["ratio/std"] == 0.0
        assert entry["clip_ratio/region_mean"] == entry["clip_ratio/low_mean"] == entry["clip_ratio/high_mean"] == 0


def test_eval_logs_the_diagnostics_with_the_eval_prefix(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    _, trainer = train_logs(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        eval_dataset=prompt_dataset.select(range(8)),
        max_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
    )
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert evals
    for name in ("eval_ratio/p50", "eval_loss/policy", "eval_reward_std/group_mean", "eval_clip_ratio/region_mean"):
        assert name in evals[0], name
    assert evals[0]["eval_loss/policy"] + evals[0]["eval_loss/kl_penalty"] == pytest.approx(
        evals[0]["eval_loss"], rel=1e-4, abs=1e-7
    )


def test_switching_diagnostics_off_keeps_trl_metrics(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    logs, _ = train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, max_steps=2, log_diagnostics=False)
    assert not any(key.startswith(("ratio/", "loss/", "reward_std/group")) for key in logs[0])
    assert {"kl", "entropy", "clip_ratio/region_mean", "reward"} <= set(logs[0])


def test_tensorboard_receives_the_ratio_and_reward_spread_histograms(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_logs(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        max_steps=2,
        num_iterations=2,
        report_to=["tensorboard"],
    )
    (run_dir,) = (tmp_path / "runs").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"histograms": 0}).Reload()
    assert "train/ratio/histogram" in events.Tags()["histograms"]
    assert "train/reward_std/group/histogram" in events.Tags()["histograms"]
    ratio = events.Histograms("train/ratio/histogram")
    assert [event.step for event in ratio] == [1, 2]
    assert ratio[1].histogram_value.num == sum(ratio[1].histogram_value.bucket)
    assert ratio[1].histogram_value.max > ratio[1].histogram_value.min  # step 2 reuses step 1's completions
    assert "train/ratio/p95" in events.Tags()["scalars"]


def trackio_rows(trackio_dir, project: str) -> list[tuple[int, dict]]:
    """(step, metrics) of every entry in trackio's local store of `project` (its SQLite file)."""
    import json
    import sqlite3

    with sqlite3.connect(trackio_dir / f"{project}.db") as connection:
        rows = connection.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    return [(step, json.loads(metrics)) for step, metrics in rows]


def run_with_logger(tmp_path, tiny_model_path, report_to: str, **env) -> None:
    """tests/launched.py's `logger` phase: two steps (the second off-policy) reporting to `report_to`, with `env`
    set."""
    result = run_alone(tmp_path / "run", tiny_model_path, ["logger"], "--report_to", report_to, env=env)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_trackio_receives_the_histograms_at_the_step_of_their_scalars(tiny_model_path, tmp_path):
    run_with_logger(tmp_path, tiny_model_path, "trackio", TRACKIO_DIR=str(tmp_path / "trackio"))  # local store only
    rows = trackio_rows(tmp_path / "trackio", "grpo-histograms")
    histograms = [(step, metrics) for step, metrics in rows if "train/ratio/histogram" in metrics]
    assert [metrics["train/global_step"] for _, metrics in histograms] == [1, 2]
    scalar_steps = {metrics["train/global_step"]: step for step, metrics in rows if "train/ratio/p50" in metrics}
    assert [step for step, _ in histograms] == [scalar_steps[1], scalar_steps[2]]  # beside their scalars
    ratio = histograms[1][1]["train/ratio/histogram"]
    assert ratio["_type"] == "trackio.histogram" and len(ratio["bins"]) == len(ratio["values"]) + 1
    assert ratio["bins"][-1] > ratio["bins"][0] and sum(ratio["values"]) > 0  # step 2 reuses step 1's completions
    assert "train/reward_std/group/histogram" in histograms[0][1]


def wandb_history(wandb_dir) -> list[dict]:
    """The history rows of the offline W&B run under `wandb_dir`, read from its `run-<id>.wandb` file: W&B's record
    log (LevelDB's log format: 32 KiB blocks of records, each a 7-byte header of checksum, length and type - full,
    first, middle or last fragment) of `Record` protocol buffers."""
    import glob
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:4] == b":W&B"
    records, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 4:
            records.append(pending + chunk)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


@pytest.mark.slow
def test_wandb_receives_the_histograms_offline(tiny_model_path, tmp_path):
    wandb_env = {
        name: str(tmp_path / "wandb-home") for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")
    }
    run_with_logger(
        tmp_path,
        tiny_model_path,
        "wandb",
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path),
        WANDB_SILENT="true",
        **wandb_env,
    )
    rows = wandb_history(tmp_path)
    histograms = [row for row in rows if "train/ratio/histogram/_type" in row]
    assert [row["train/global_step"] for row in histograms] == [1, 2]  # W&B plots every metric against it
    assert {row["train/ratio/histogram/_type"] for row in histograms} == {"histogram"}
    bins, values = histograms[1]["train/ratio/histogram/bins"], histograms[1]["train/ratio/histogram/values"]
    assert len(bins) == len(values) + 1 and bins[-1] > bins[0] and sum(values) > 0
    assert "train/reward_std/group/histogram/_type" in histograms[0]
    assert any("train/ratio/p50" in row for row in rows)


def test_histogram_edges_start_at_the_minimum():
    from trl_grpo_ext.diagnostics.loggers import histogram_edges

    counts, edges = histogram_edges(([1.0, 1.5, 3.0], [2.0, 0.0, 1.0], 0.5, 3.0, 3.0, 4.5, 9.0))
    assert counts == [2.0, 0.0, 1.0] and edges == [0.5, 1.0, 1.5, 3.0]


def test_loggers_without_histograms_are_not_broken(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    logs, _ = train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, max_steps=2, report_to="none")
    assert "ratio/p50" in logs[0]


def test_quantiles_are_configurable(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    logs, _ = train_logs(
        tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, max_steps=2, ratio_quantiles=[0.01, 0.999]
    )
    assert {"ratio/p01", "ratio/p99.9"} <= set(logs[0]) and "ratio/p50" not in logs[0]


def test_bad_quantiles_are_refused(tmp_path):
    with pytest.raises(ValueError, match="`ratio_quantiles`"):
        GRPOConfigExt(output_dir=str(tmp_path), ratio_quantiles=[0.5, 1.5])


@pytest.mark.parametrize("padding_free", [False, True])
def test_no_host_sync_per_micro_batch(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch, padding_free
):
    # `.item()` and `.tolist()` in the loss path would force a device sync per micro-batch on a GPU; the packed
    # forward reads its rows' spans once per micro-batch (forward.layout.row_spans), nothing else does.
    calls = {"loss_path": 0}
    in_loss = [False]
    original_item, original_tolist = torch.Tensor.item, torch.Tensor.tolist

    def counting(original):
        def wrapper(self, *args, **kwargs):
            calls["loss_path"] += in_loss[0]
            return original(self, *args, **kwargs)

        return wrapper

    class Watched(GRPOTrainerExt):
        def _compute_loss(self, model, inputs):
            in_loss[0] = True
            try:
                return super()._compute_loss(model, inputs)
            finally:
                in_loss[0] = False

    monkeypatch.setattr(torch.Tensor, "item", counting(original_item))
    monkeypatch.setattr(torch.Tensor, "tolist", counting(original_tolist))
    train_logs(
        tmp_path,
        tiny_model_path,
        tiny_tokenizer,
        prompt_dataset,
        trainer_cls=Watched,
        max_steps=2,
        padding_free=padding_free,
    )
    assert calls["loss_path"] == (2 if padding_free else 0)  # 2 steps of one micro-batch each
