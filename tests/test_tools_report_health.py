"""A run that learns nothing is never called healthy: live alarms, the health verdicts of `report` and the card.

Each test pins one failure mode found in review: batch-scaled rewards hiding flat groups, rewards that score nothing
or are infinite, a gradient that is 0 throughout, a last step far above the run's gradient norms.
"""

import math

import pytest
from helpers import model_card, train_logs
from trl import GRPOConfig

from trl_grpo_ext import GRPOConfigExt
from trl_grpo_ext.guardrails import AnomalyMonitor, RewardFunctionError
from trl_grpo_ext.guardrails.alarms import ALARMS, DEFAULTS
from trl_grpo_ext.tools.card.fields import card_config
from trl_grpo_ext.tools.report.health import assess

PROMPT_REWARD = {"abc=": 0.0, "hello=": 1.0, "xyz=": 2.0, "qq=": 3.0}


def prompt_only_reward(prompts, completions, **kwargs):
    """Depends on the prompt only: every group is flat, but the batch is not."""
    return [PROMPT_REWARD[prompt] for prompt in prompts]


def never_parses(completions, **kwargs):
    """A parser that never matches: it scores nothing."""
    return [None] * len(completions)


def infinite_for_one_in_five(completions, **kwargs):
    return [math.inf if index % 5 == 2 else 1.0 for index in range(len(completions))]


def scalar_reward(completions, **kwargs):
    return 1.0


def alarms_raised(trainer) -> set[str]:
    return {key.removeprefix("alarms/") for entry in trainer.state.log_history for key in entry if "alarms/" in key}


@pytest.mark.parametrize(
    "options", [{"scale_rewards": "batch"}, {"multi_objective_aggregation": "normalize_then_sum"}]
)
def test_flat_groups_raise_the_spread_alarms_whatever_the_reward_scaling(
    options, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    _, trainer = train_logs(
        tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=prompt_only_reward, **options
    )
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["reward_std/group_max"] == 0.0 for entry in logs)  # every group flat
    assert all(entry["reward_std/frac_zero_groups"] == 1.0 for entry in logs)
    assert {"zero_std", "no_spread"} <= alarms_raised(trainer)
    health = assess(trainer.state.log_history, AnomalyMonitor.from_config(trainer.args))
    assert not health.ok
    verdicts = {signal.signal.name: signal.verdict for signal in health.signals}
    assert verdicts["groups without spread"] == verdicts["reward spread in groups"] == "ALARM"


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_reward_that_scores_nothing_raises_an_alarm_naming_it_at_the_first_step(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, caplog, padding_free
):
    _, trainer = train_logs(
        tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=never_parses, padding_free=padding_free
    )
    first = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert first["alarms/unscored"] == 1
    assert "reward function 'never_parses' scored no completion" in caplog.text
    health = assess(trainer.state.log_history, AnomalyMonitor.from_config(trainer.args))
    # TRL's padded forward gives the reference and the policy bitwise equal log-probs at the first step, so that
    # with no advantage the gradient is exactly 0. Packed forwards pack the reference's chunks and the shuffled
    # micro-batches differently: their KL is rounding (about 1e-15), whose gradient Adam scales to a step. The run
    # is still flagged, by the flat groups.
    expected = {"unscored", "no_gradient"} if not padding_free else {"unscored", "zero_std"}
    assert not health.ok and expected <= set(health.alarms)
    card = model_card(
        model_name="dead",
        is_adapter=False,
        config=card_config(trainer.args),
        metrics={},
        alarms=health.problem_lines(),
    )
    assert "No alarm was raised" not in card and "never_parses" in card


def test_an_infinite_reward_is_refused_naming_the_function_the_value_and_the_completion(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    with pytest.raises(RewardFunctionError, match=r"'infinite_for_one_in_five' returned an infinite reward, inf, "):
        train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=infinite_for_one_in_five)


def test_a_reward_that_returns_a_scalar_is_refused_naming_the_function(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    with pytest.raises(RewardFunctionError, match=r"'scalar_reward' returned float 1.0 for \d+ completions"):
        train_logs(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=scalar_reward)


def test_nan_stays_unscored_and_is_not_an_error(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    def half_nan(completions, **kwargs):
        return [math.nan if index % 2 else float(len(completion)) for index, completion in enumerate(completions)]

    _, trainer = train_logs(
        tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, reward_funcs=half_nan, max_steps=1
    )
    assert trainer.state.log_history[0]["frac_reward_unscored"] == pytest.approx(0.5)


def training_entries(values, key="grad_norm", **extra):
    return [{"loss": 0.0, "step": step, key: value, **extra} for step, value in enumerate(values, start=1)]


def test_an_infinite_reward_in_a_history_is_never_ok():
    """A stock TRL run (or one before rewards were checked) that logged `reward inf`."""
    history = [{"loss": 0.1, "step": step, "reward": value} for step, value in enumerate((0.5, math.inf, math.inf), 1)]
    health = assess(history)
    reward = next(signal for signal in health.signals if signal.signal.name == "reward")
    assert reward.verdict == "FAIL" and "not finite at steps 2-3" in reward.detail and not health.ok
    assert any(line.startswith("reward: reward is not finite") for line in health.problem_lines())


def test_a_gradient_norm_of_0_throughout_is_never_ok():
    for steps in (2, 6):  # too short for the live alarm (3 steps), and long enough for it
        health = assess(training_entries([0.0] * steps))
        gradient = next(signal for signal in health.signals if signal.signal.name == "gradient norm")
        assert gradient.verdict in ("FAIL", "ALARM") and not health.ok, steps


def test_a_gradient_norm_nan_throughout_is_never_ok():
    stock = training_entries([math.nan] * 6)  # no guard: each NaN norm was applied, a grad_norm_spike
    guarded = [{**entry, "nonfinite/skipped_steps": entry["step"]} for entry in stock]  # the guard skipped each step
    for history, verdict in ((stock, "ALARM"), (guarded, "FAIL")):
        health = assess(history)
        gradient = next(signal for signal in health.signals if signal.signal.name == "gradient norm")
        assert gradient.verdict == verdict and not health.ok, verdict
    assert gradient.onset == 1 and "grad_norm NaN at every logged step (steps 1-6)" in gradient.detail


def test_a_last_gradient_norm_far_above_the_run_s_median_is_never_ok():
    health = assess(training_entries([1.0, 1.1, 0.9, 1.0, 1.05, 6.0]))  # 6x: below the 10x of grad_norm_spike
    gradient = next(signal for signal in health.signals if signal.signal.name == "gradient norm")
    assert not health.episodes and gradient.verdict == "note" and "6.0x the run's median" in gradient.detail
    assert not health.ok
    assert assess(training_entries([1.0, 1.1, 0.9, 1.0, 1.05, 1.2])).ok  # the same run ending normally


def test_zero_gradient_steps_do_not_make_the_first_real_gradient_a_spike():
    monitor = AnomalyMonitor()
    stream = training_entries([0.0] * 8 + [0.4, 0.5, 0.45])  # no reward spread at first, then learning starts
    started = [message for index, entry in enumerate(stream) for message in monitor.check(entry, index, warn=False)]
    assert not [message for message in started if "alarms/grad_norm_spike" in message]


def test_the_card_shows_cispo_s_cap_as_trl_trains_with_it():
    def cispo(**options):
        return GRPOConfig(
            output_dir="unused", loss_type="cispo", report_to="none", use_cpu=True, bf16=False, **options
        )

    config = card_config(cispo(epsilon=4.0))
    assert config["epsilon_high"] == 4.0  # TRL: epsilon_high = epsilon_high or epsilon, CISPO's cap
    assert "epsilon" not in config
    assert card_config(cispo(epsilon_high=5.0))["epsilon_high"] == 5.0


def test_every_alarm_is_one_family_entry_that_the_config_the_monitor_and_the_report_read():
    """An alarm is a key of its family's `alarms` and a method of that family: its default is the config's (named in
    the field's help) and the monitor's, its range refuses a value below it, `None` switches it off."""
    helped = GRPOConfigExt.__dataclass_fields__["alarm_thresholds"].metadata["help"]
    for name, family in ALARMS.items():
        alarm = family.alarms[name]
        assert callable(getattr(family, name)) and f"{name} {alarm.default:g}" in helped, name
        assert AnomalyMonitor().thresholds[name] == alarm.default == DEFAULTS[name]
        assert (
            AnomalyMonitor({name: None}).thresholds[name] is None and name not in AnomalyMonitor({name: None}).counts
        )
        assert alarm.range.problem(alarm.default) is None and alarm.range.problem(alarm.range.low - 1) is not None


def nan_loss_history(first_nan_step: int | None, steps: int = 200) -> list[dict]:
    """rlwatch's NaN-loss trace in TRL's format: a falling loss, NaN from `first_nan_step` on."""
    history = []
    for step in range(1, steps + 1):
        loss = math.nan if first_nan_step is not None and step >= first_nan_step else 0.5 - step / 2000
        history.append({"loss": loss, "loss/policy": loss, "reward": 0.3, "grad_norm": 1.0, "step": step})
    return history


def test_a_nan_loss_is_a_failure_naming_its_first_step():
    health = assess(nan_loss_history(100))
    loss = next(signal for signal in health.signals if signal.signal.name == "loss split")
    assert loss.verdict == "FAIL" and loss.severity == "critical" and loss.onset == 100
    assert "not finite (NaN or inf) from step 100: loss at steps 100-200; loss/policy at steps 100-200" in loss.detail
    assert not health.ok and any(line.startswith("loss split: not finite") for line in health.problem_lines())


def test_an_infinite_loss_logged_once_is_a_failure_and_a_finite_one_is_not():
    history = nan_loss_history(None, steps=10)
    history[6]["loss/kl_penalty"] = math.inf
    loss = next(signal for signal in assess(history).signals if signal.signal.name == "loss split")
    assert loss.verdict == "FAIL" and loss.onset == 7 and "loss/kl_penalty at step 7" in loss.detail
    healthy = next(signal for signal in assess(nan_loss_history(None)).signals if signal.signal.name == "loss split")
    assert healthy.verdict == "shown" and healthy.onset is None and healthy.severity == "ok"


def test_a_metric_logged_as_nan_at_every_step_is_named_as_nan_not_as_missing():
    history = [{"loss": 0.1, "step": step, "kl": math.nan, "entropy": math.nan} for step in range(1, 21)]
    health = {signal.signal.name: signal for signal in assess(history).signals}
    kl, entropy = health["KL to the reference"], health["entropy"]
    # kl_high counts a NaN KL as not finite; the line says what was logged, not "not logged"
    assert kl.verdict == "ALARM" and "kl_high at steps 1-20" in kl.detail
    assert "not logged" not in kl.detail and "kl NaN at every logged step (steps 1-20)" in kl.detail
    # no rule reads a NaN entropy: logged NaN throughout is a run that cannot have trained well
    assert entropy.verdict == "FAIL" and entropy.onset == 1
    assert "entropy NaN at every logged step (steps 1-20)" in entropy.detail
    some = [{"loss": 0.1, "step": step, "entropy": math.nan if step % 2 else 1.0} for step in range(1, 21)]
    entropy = next(signal for signal in assess(some).signals if signal.signal.name == "entropy")
    assert entropy.verdict != "FAIL" and "NaN at 10 of 20 logged steps" in entropy.detail


def test_a_history_with_infinite_and_nan_values_everywhere_is_judged_without_an_error():
    """`report` reads any log: +inf, -inf, NaN, None, a bool or a string in any metric, at any step."""
    import random

    from trl_grpo_ext import metrics
    from trl_grpo_ext.metrics import heldout_metric, reward_function_metric
    from trl_grpo_ext.tools.report.formats import Report, forward_summary, render
    from trl_grpo_ext.tools.report.sampling import sampling_summary

    keys = sorted(
        {value for name, value in vars(metrics).items() if name.isupper() and not name.endswith("_PREFIX")}
        | {reward_function_metric("format_reward"), reward_function_metric("accuracy"), "reward_std"}
        | {heldout_metric("accuracy", "mean", 4), "heldout/accuracy/scored@4", "epoch", "step_time"}
    )
    odd = [math.inf, -math.inf, math.nan, None, True, "x", 0.0, -1.0, 1e308]
    rng = random.Random(0)
    for case in range(40):
        history = []
        for step in range(1, rng.randint(1, 120)):
            entry = {"step": step, "loss": rng.choice([0.1, *odd])}
            for key in rng.sample(keys, rng.randint(1, len(keys))):
                entry[key] = rng.choice(odd) if rng.random() < 0.3 else rng.uniform(0.0, 2.0)
            history.append(entry)
        health = assess(history)
        report = Report(
            run_dir="run",
            read="trainer_state.json",
            source="trainer_state",
            global_step=len(history),
            notes=[],
            image="report.png: not drawn",
            health=health,
            forward=forward_summary(history),
            sampling=sampling_summary(history),
        )
        for form in ("text", "markdown", "json"):
            assert render(report, form), (case, form)
