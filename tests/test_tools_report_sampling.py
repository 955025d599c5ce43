"""`report`'s sampling line: the generation spent on groups without reward spread, and whether the options pay."""

import json

import pytest
from test_tools_report_command import flat, report, write_state

from trl_grpo_ext.tools.report.formats import unrecognised_keys
from trl_grpo_ext.tools.report.sampling import sampling_summary


def history(flat: list[float], key: str = "frac_reward_zero_std", epochs: float = 1.0, **logged) -> list[dict]:
    """One log entry per value of `flat`, the last at `epochs` epochs, each with the `logged` values as well."""
    return [
        {"loss": 0.1, "reward": 0.5, "grad_norm": 1.0, key: value, "epoch": epochs * (index + 1) / len(flat),
         "step": index + 1, **logged}
        for index, value in enumerate(flat)
    ]  # fmt: skip


def test_the_flat_share_and_its_last_quarter_are_read_from_the_generated_groups_first():
    generated = history([0.2, 0.4, 0.6, 0.8], key="dynamic_sampling/frac_reward_zero_std_generated")
    for entry in generated:
        entry["frac_reward_zero_std"] = 0.0  # the trained batches of dynamic sampling: none flat
    summary = sampling_summary(generated)
    assert summary["flat_share"] == pytest.approx(0.5) and summary["flat_share_late"] == pytest.approx(0.8)
    assert summary["message"].startswith("sampling: in 50% of the groups generated (80% in the last quarter) every")
    assert sampling_summary([{"loss": 0.1, "step": 1}]) is None


@pytest.mark.parametrize(
    ("flat", "epochs", "precision", "advice"),
    [
        ([0.1, 0.1], 5.0, None, None),  # little generation to save: no line
        (
            [0.6, 0.6],
            1.2,
            None,
            "dynamic_sampling=True replaces those groups with new ones (more generation per step)",
        ),
        ([0.6, 0.6], 6.0, None, "the prompts recur (6 passes over the training set): selective_rollouts=True skips"),
        ([0.5, 0.5], 6.0, 0.9, "(selective_rollouts) was right 90% of the time: it pays here"),
        ([0.5, 0.5], 6.0, 0.55, "right 55% of the time, not much more than the 50% of any prompt: it saves little"),
    ],
)
def test_the_advice_follows_the_flat_share_the_epochs_and_the_precision(flat, epochs, precision, advice):
    logged = {"selective_rollouts/precision": precision} if precision is not None else {}
    message = sampling_summary(history(flat, epochs=epochs, **logged))["message"]
    assert message is None if advice is None else advice in message
    if epochs < 2.0:
        assert "selective_rollouts" not in message  # prompts that do not recur: nothing it could do


def test_the_report_prints_the_sampling_line_in_every_format(tmp_path, capsys):
    write_state(tmp_path, 4, history([0.7, 0.7, 0.8, 0.9], epochs=6.0, **{"selective_rollouts/precision": 0.95}))
    _, out, _ = report(tmp_path, capsys)
    assert "sampling: in 78% of the groups generated (90% in the last quarter) every completion" in flat(out)
    assert "selective_rollouts/precision" not in out  # a known family: not listed as unrecognised
    assert json.loads(report(tmp_path, capsys, "--format", "json")[1])["sampling"]["precision"] == 0.95
    assert "it pays here" in report(tmp_path, capsys, "--format", "markdown")[1]
    assert unrecognised_keys([{"selective_rollouts/skipped_prompts": 3.0}]) == []
