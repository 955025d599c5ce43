"""report.png as a reader sees it: a title, a label on every y axis, no line twice, no line off its panel's scale, the
held-out curve. Checked on the matplotlib objects, not on pixels."""

import pytest

pytest.importorskip("matplotlib")

from trl_grpo_ext.tools.report.figure import PANELS, build_report_figure  # noqa: E402


def history(steps=(1, 2, 3, 4), *, ratio_max=1.1, ratio_min=0.9, heldout_steps=(0, 2, 4)) -> list[dict]:
    """A demo-like log history: one reward function (so `reward` equals its mean), ratios, held-out entries."""
    entries = []
    for step in steps:
        entries.append(
            {
                "loss": 0.01 * step,
                "reward": 0.2 + 0.1 * step,
                "rewards/exact_match/mean": 0.2 + 0.1 * step,
                "ratio/p05": 0.95,
                "ratio/p50": 1.0,
                "ratio/p95": 1.05,
                "ratio/min": ratio_min,
                "ratio/max": ratio_max,
                "step": step,
            }
        )
    for step in heldout_steps:
        entries.append(
            {"heldout/exact_match/mean@1": 0.2 + 0.05 * step, "heldout/exact_match/pass@1": 0.2, "step": step}
        )
    return sorted(entries, key=lambda entry: entry["step"])


def panels(figure) -> dict:
    return {ax.get_title(): ax for ax in figure.axes if ax.get_title()}


def labels(ax) -> list[str]:
    """The labels of the data lines of `ax` (not the clip-range guides, which matplotlib names `_child<n>`)."""
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_the_figure_is_titled_with_the_run_name():
    assert build_report_figure(history(), title="tiny-demo")._suptitle.get_text() == "tiny-demo: GRPO training report"
    assert build_report_figure(history())._suptitle.get_text() == "GRPO training report"


def test_every_panel_labels_its_y_axis_and_the_shares_on_the_right_too():
    figure = build_report_figure(
        history() + [{"loss": 0.0, "frac_reward_zero_std": 0.5, "completions/clipped_ratio": 0.1, "step": 5}]
    )
    by_title = panels(figure)
    assert [by_title[panel.title].get_ylabel() for panel in PANELS] == [panel.ylabel for panel in PANELS]
    assert all(panel.ylabel for panel in PANELS)
    right = sorted(ax.get_ylabel() for ax in figure.axes if not ax.get_title())  # the twin axes
    assert right == ["share of completions", "share truncated"]
    assert [ax.get_xlabel() for ax in figure.axes[6:9]] == ["step"] * 3


def test_a_reward_function_equal_to_the_reward_is_named_not_drawn_twice():
    reward = panels(build_report_figure(history()))["reward"]
    assert labels(reward) == ["reward = rewards/exact_match/mean", "heldout/exact_match/mean@1"]


def test_two_reward_functions_are_each_drawn():
    entries = history()
    for entry in entries:
        if "reward" in entry:
            entry["rewards/exact_match/mean"] = entry["reward"] * 0.7
            entry["rewards/format/mean"] = entry["reward"] * 0.3
    drawn = labels(panels(build_report_figure(entries))["reward"])
    assert drawn[:3] == ["reward", "rewards/exact_match/mean", "rewards/format/mean"]


def test_the_held_out_curve_starts_before_training():
    reward = panels(build_report_figure(history()))["reward"]
    (heldout,) = [line for line in reward.get_lines() if line.get_label().startswith("heldout/")]
    assert list(heldout.get_xdata()) == [0, 2, 4]
    assert list(heldout.get_ydata()) == pytest.approx([0.2, 0.3, 0.4])


def test_ratio_min_and_max_inside_the_frame_are_drawn():
    ratio = panels(build_report_figure(history()))["importance ratio r = pi / pi_old"]
    assert labels(ratio) == ["p50", "min (lowest 0.9)", "max (highest 1.1)"]
    assert not ratio.texts


def test_ratio_min_and_max_that_leave_the_frame_are_a_note_not_lines():
    ratio = panels(build_report_figure(history(ratio_max=5.02, ratio_min=0.407)))["importance ratio r = pi / pi_old"]
    assert labels(ratio) == ["p50"]
    legend = [text.get_text() for text in ratio.get_legend().get_texts()]
    assert not any(label.startswith(("min", "max")) for label in legend)
    (note,) = ratio.texts
    assert note.get_text() == "off scale: min (lowest 0.407), max (highest 5.02)"
    bottom, top = ratio.get_ylim()
    assert bottom <= 0.8 and top >= 1.2  # the clip range stays in the frame


def test_a_line_that_leaves_the_frame_at_some_steps_is_a_note_too():
    entries = history()
    entries[-1]["ratio/max"] = 9.0  # one off-policy step with an extreme token; the others fit
    ratio = panels(build_report_figure(entries))["importance ratio r = pi / pi_old"]
    assert labels(ratio) == ["p50", "min (lowest 0.9)"]
    assert ratio.texts[0].get_text() == "off scale: max (highest 9)"


def test_every_alarm_is_shaded_on_one_panel_but_those_of_counts_without_a_panel():
    from trl_grpo_ext.guardrails.alarms import ALARMS
    from trl_grpo_ext.tools.report.health import SIGNALS

    shaded = [alarm for panel in PANELS for alarm in panel.alarms]
    counted = {alarm for signal in SIGNALS if signal.kind == "count" for alarm in signal.alarms}
    assert sorted(shaded) == sorted(set(ALARMS) - counted)
    assert counted == {"unscored"}
