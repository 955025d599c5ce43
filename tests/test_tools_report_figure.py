"""The training report image: its panels, what they draw, the panels that were not logged, the alarm episodes."""

from matplotlib.collections import PolyCollection

from trl_grpo_ext.tools.report.figure import build_report_figure, missing_panels, plot_training_report
from trl_grpo_ext.tools.report.health import assess

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
    reading = by_title["reward spread: std inside each group"].get_legend().get_title().get_text()
    assert reading.startswith("no spread: 50% of completions at step 1")  # TRL's share is of completions
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


def demo_history(steps: int = 20, *, beta: float = 0.04, kl_peak: float = 0.4) -> list[dict]:
    """A demo-shaped history: 8 completions per prompt and a 0/1 reward, so that some group has std 0 and some the
    largest std of 8 such rewards (0.53) at every step; the penalty `beta * kl` logged beside the KL."""
    entries = []
    for step in range(1, steps + 1):
        kl = kl_peak * step / steps
        zero = 0.3 + 0.4 * step / steps
        entries.append(
            {
                "loss": 0.01 + beta * kl,
                "loss/policy": 0.01,
                "loss/kl_penalty": beta * kl,
                "reward": 0.2 + 0.03 * step,
                "reward_std/group_mean": 0.5 * (1 - zero),
                "reward_std/group_min": 0.0,
                "reward_std/group_max": 0.5345,
                "reward_std/frac_zero_groups": zero,
                "frac_reward_zero_std": zero,
                "kl": kl,
                "completions/mean_length": 20.0,
                "completions/clipped_ratio": 0.02,
                "step": step,
            }
        )
    return entries


def by_title(figure) -> dict:
    return {ax.get_title(): ax for ax in figure.axes if ax.get_title()}


def test_a_spread_band_whose_edges_never_change_is_not_drawn_but_named():
    spread = by_title(build_report_figure(demo_history()))["reward spread: std inside each group"]
    assert not [item for item in spread.collections if isinstance(item, PolyCollection)]
    reading = spread.get_legend().get_title().get_text()
    assert "std of a group from 0 to 0.534 at every step" in reading


def test_the_spread_panel_reads_the_share_of_groups_without_spread_against_its_alarm():
    figure = build_report_figure(demo_history(), thresholds={"zero_std": 0.8})
    spread = by_title(figure)["reward spread: std inside each group"]
    (right,) = [ax for ax in figure.axes if ax.get_ylabel() == "share of groups"]
    shares = [line for line in right.get_lines() if line.get_label() == "reward_std/frac_zero_groups (right)"]
    assert list(shares[0].get_ydata()) == [entry["reward_std/frac_zero_groups"] for entry in demo_history()]
    (alarm,) = [line for line in right.get_lines() if line.get_label() == "zero_std alarm (right)"]
    assert list(alarm.get_ydata()) == [0.8]
    # TRL's frac_reward_zero_std says the same here: not drawn a second time.
    assert not [line for ax in figure.axes for line in ax.get_lines() if "frac_reward_zero_std" in line.get_label()]
    reading = spread.get_legend().get_title().get_text()
    assert reading.startswith("no spread: 70% of groups at step 20, 51% on average; zero_std alarm at 80%")


def test_the_kl_panel_draws_the_kl_alone_with_its_alarm_threshold():
    kl = by_title(build_report_figure(demo_history(), thresholds={"kl_high": 0.5}))["KL to the reference"]
    beta_kl = [entry["loss/kl_penalty"] for entry in demo_history()]
    assert not [line for line in kl.get_lines() if list(line.get_ydata()) == beta_kl]
    assert [line.get_label() for line in kl.get_lines()] == ["kl", "kl_high alarm"]
    assert list(kl.get_lines()[1].get_ydata()) == [0.5, 0.5]
    assert kl.get_legend().get_title().get_text() == "peak 0.4 at step 20, 80% of the kl_high alarm's 0.5"


def test_a_kl_threshold_far_above_the_curve_is_named_not_drawn():
    kl = by_title(build_report_figure(demo_history(kl_peak=0.05)))["KL to the reference"]  # default kl_high: 1
    assert [line.get_label() for line in kl.get_lines()] == ["kl"]
    assert kl.get_legend().get_title().get_text() == "peak 0.05 at step 20, 5% of the kl_high alarm's 1"
    off = by_title(build_report_figure(demo_history(), thresholds={"kl_high": None}))["KL to the reference"]
    assert off.get_legend().get_title().get_text() == "peak 0.4 at step 20; alarm kl_high off"


def test_each_panel_has_one_legend_above_its_axes_and_below_its_title():
    history = demo_history()
    for entry in history[-3:]:
        entry["completions/clipped_ratio"] = 1.0  # an alarm episode: its span is in the legend too
    figure = build_report_figure(history, episodes=assess(history).episodes)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legends = 0
    for ax in figure.axes:
        legend = ax.get_legend()
        if not ax.get_title():  # a right axis: its lines are in the legend of the panel it is drawn on
            assert legend is None
            continue
        if legend is None:
            continue
        legends += 1
        box, frame = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.y0 >= frame.y1  # above the data area: it covers no curve
        assert ax.title.get_window_extent(renderer).y0 >= box.y1
    assert legends == 5  # reward, spread, KL, loss, completion length: what this history logs
    length = by_title(figure)["completion length (tokens)"]
    assert [text.get_text() for text in length.get_legend().get_texts()] == [
        "mean",
        "alarm truncation",
        "completions/clipped_ratio (right)",
    ]


def test_the_image_states_the_run_s_verdict_under_its_title():
    history = [{**entry, "completions/clipped_ratio": 0.9} for entry in demo_history()]
    health = assess(history)
    figure = build_report_figure(history, title="run", episodes=health.episodes, verdict=health.headline())
    texts = [text.get_text() for text in figure.texts]
    assert health.headline() in texts and health.headline().startswith("2 alarms raised: truncation")
    assert assess(demo_history()).headline() == "No alarm was raised and no health check failed."


def _extent(artist):
    return artist.get_window_extent(artist.figure.canvas.get_renderer())


def test_the_figure_title_and_verdict_sit_clear_above_every_panel_s_title_and_legend():
    # the middle panel's title and legend are the highest (two lines of reading in its legend's title); the figure's
    # title sat 8 pixels above it, read as one block with it
    history = demo_history()
    for verdict in (None, assess(history).headline()):
        figure = build_report_figure(history, title="tiny-demo", verdict=verdict)
        figure.canvas.draw()
        lowest = min(_extent(text).y0 for text in [figure._suptitle, *figure.texts])
        clear = 12 * figure.dpi / 72  # 12 points
        for ax in figure.axes:
            for artist in (ax.title, ax.get_legend()):
                if artist is not None and (ax.get_title() or artist is not ax.title):
                    assert _extent(artist).y1 + clear <= lowest, ax.get_title()


def test_the_zero_std_threshold_is_marked_on_the_right_axis_and_crosses_no_curve():
    figure = build_report_figure(demo_history(), thresholds={"zero_std": 0.8})
    (right,) = [ax for ax in figure.axes if ax.get_ylabel() == "share of groups"]
    (alarm,) = [line for line in right.get_lines() if line.get_label() == "zero_std alarm (right)"]
    # a mark at the right edge, at the threshold on the right axis: no line across the left axis' curves
    assert min(alarm.get_xdata()) >= 0.97 and list(alarm.get_ydata()) == [0.8] * len(alarm.get_xdata())
