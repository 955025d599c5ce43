"""The training report image: its panels, what they draw, the panels that were not logged, the alarm episodes."""

from matplotlib.collections import PolyCollection

from trl_grpo_ext.report import build_report_figure, missing_panels, plot_training_report
from trl_grpo_ext.report.health import assess

HISTORY = [
    {"loss": 0.1, "reward": 0.2, "kl": 0.01, "ratio/p05": 0.9, "ratio/p50": 1.0, "ratio/p95": 1.1, "step": 1},
    {"loss": 0.2, "kl": 0.02, "ratio/p05": 0.95, "ratio/p50": 1.0, "ratio/p95": 1.05, "step": 2},
    {"train_runtime": 3.0, "step": 2},
]


def test_report_needs_training_entries_and_writes_a_png(tmp_path):
    assert plot_training_report([{"train_runtime": 1.0, "step": 1}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    path = plot_training_report(HISTORY, tmp_path / "report.png", title="t")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.endswith("report.png")


SPREAD_HISTORY = [
    {
        "loss": 0.1 * step,
        "reward": 0.2 * step,
        "reward_std/group_mean": 0.3 + 0.1 * step,
        "reward_std/group_min": 0.1 * step,
        "reward_std/group_max": 0.6 + 0.1 * step,
        "frac_reward_zero_std": 0.5 / step,
        "step": step,
    }
    for step in (1, 2, 3)
]


def test_the_report_draws_the_reward_spread_beside_the_reward():
    figure = build_report_figure(SPREAD_HISTORY)
    by_title = {ax.get_title(): ax for ax in figure.axes if ax.get_title()}
    reward, spread = by_title["reward"], by_title["reward spread: std inside each group"]
    # Beside the reward: same row, the next column.
    reward_box, spread_box = reward.get_position(), spread.get_position()
    assert abs(reward_box.y0 - spread_box.y0) < 1e-6 and spread_box.x0 > reward_box.x1
    (mean_line,) = [line for line in spread.get_lines() if line.get_label() == "group mean"]
    assert list(mean_line.get_ydata()) == [entry["reward_std/group_mean"] for entry in SPREAD_HISTORY]
    (band,) = [item for item in spread.collections if isinstance(item, PolyCollection)]
    band_y = band.get_paths()[0].vertices[:, 1]
    assert band_y.min() == min(entry["reward_std/group_min"] for entry in SPREAD_HISTORY)
    assert band_y.max() == max(entry["reward_std/group_max"] for entry in SPREAD_HISTORY)
    zero_lines = [line for ax in figure.axes for line in ax.get_lines() if "frac_reward_zero_std" in line.get_label()]
    assert list(zero_lines[0].get_ydata()) == [entry["frac_reward_zero_std"] for entry in SPREAD_HISTORY]


def test_the_report_says_which_panels_were_not_logged():
    figure = build_report_figure([{"loss": 0.5, "reward": 1.0, "frac_reward_zero_std": 0.5, "step": 1}])
    by_title = {ax.get_title(): ax for ax in figure.axes if ax.get_title()}
    assert [text.get_text() for text in by_title["importance ratio r = pi / pi_old"].texts] == [
        "not logged: ratio/p50, ratio/p05, ratio/p95"
    ]
    assert by_title["reward"].has_data() and not by_title["reward"].texts
    # TRL's frac_reward_zero_std alone (a stock TRL run) is enough for the spread panel, drawn on its right axis.
    assert not by_title["reward spread: std inside each group"].texts
    assert [title for title, _ in missing_panels([{"loss": 0.5, "reward": 1.0, "step": 1}])][:2] == [
        "reward spread: std inside each group",
        "KL to the reference",
    ]


def test_the_report_shades_the_alarm_episodes_on_their_panel():
    history = [
        {"loss": 0.0, "completions/mean_length": 8.0, "completions/clipped_ratio": 1.0, "step": s} for s in (1, 2)
    ]
    figure = build_report_figure(history, episodes=assess(history).episodes)
    by_title = {ax.get_title(): ax for ax in figure.axes if ax.get_title()}
    (span,) = [
        patch for patch in by_title["completion length (tokens)"].patches if patch.get_label() == "alarm truncation"
    ]
    assert span.get_x() == 0.5 and span.get_width() == 2.0  # steps 1-2, half a step wider on each side
    assert not [patch for patch in by_title["entropy"].patches if "alarm" in patch.get_label()]
