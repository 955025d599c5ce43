"""The console: one compact line per log step with the key signals and the alarms that start, the progress bar."""

from helpers import count_a_reward, tiny_grpo_args
from transformers import PrinterCallback, ProgressCallback, TrainerControl, TrainerState

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.extras.console import ConsoleCallback, format_log_line
from trl_grpo_ext.tools.recipes import grpo as recipe

TRAIN = {
    "loss": 0.0123,
    "reward": 0.41234,
    "reward_std/group_mean": 0.2311,
    "kl": 0.0031234,
    "clip_ratio/region_mean": 0.0125,
    "ratio/p95": 1.0834,
    "entropy": 1.9321,
    "completions/mean_length": 7.4,
    "learning_rate": 1e-3,
    "epoch": 0.5,
}


def test_a_training_line_shows_the_key_signals_in_order():
    assert format_log_line(TRAIN, 20, 400) == (
        "step 20/400 | reward 0.412 | spread 0.231 | kl 0.00312 | clip 0.0125 | ratio p95 1.08 | entropy 1.93 "
        "| len 7.4"
    )


def test_signals_not_logged_at_a_step_show_a_dash_and_alarms_come_last():
    logs = {"loss": 0.0, "kl": 0.5, "entropy": float("nan")}  # no reward at a step that does not generate
    line = format_log_line(logs, 3, alarms=["kl_jump", "entropy_collapse"])
    assert line == (
        "step 3 | reward - | spread - | kl 0.5 | clip - | ratio p95 - | entropy - | len - "
        "| ALARM kl_jump, entropy_collapse"
    )


def test_evaluation_and_summary_lines():
    evaluation = {"eval_loss": 0.1, "eval_reward": 0.7, "eval_kl": 0.01}
    assert format_log_line(evaluation, 10, 40).startswith("eval step 10/40 | reward 0.7 | spread - | kl 0.01")
    summary = {"train_runtime": 93.21, "train_loss": 0.0123, "epoch": 1.0, "total_flos": 0.0}
    assert format_log_line(summary, 40, 40) == "step 40/40 | train_runtime 93.2 | train_loss 0.0123"
    heldout = {
        "heldout/exact_match/mean@1": 0.77,
        "heldout/exact_match/pass@1": 0.77,
        "heldout/exact_match/scored@1": 500,
    }
    assert format_log_line(heldout, 400, 400) == "step 400/400 | heldout/exact_match/mean@1 0.77"
    sampled = {"heldout/f/mean@4": 0.5, "heldout/f/pass@1": 0.5, "heldout/f/pass@4": 0.9, "heldout/f/scored@4": 80}
    assert format_log_line(sampled, 4) == "step 4 | heldout/f/mean@4 0.5 | heldout/f/pass@1 0.5 | heldout/f/pass@4 0.9"


def test_the_console_prints_one_line_per_log_with_the_alarms_that_start(tmp_path, capsys):
    args = GRPOConfigExt(**tiny_grpo_args(tmp_path))  # disable_tqdm: no bar, the lines are printed
    console, state, control = ConsoleCallback(), TrainerState(max_steps=3), TrainerControl()
    console.on_train_begin(args, state, control)
    for step, count in ((1, 1), (2, 1), (3, 2)):
        state.global_step = step
        console.on_log(args, state, control, logs={**TRAIN, "alarms/truncation": count})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("| len 7.4 | ALARM truncation") and lines[1].endswith("| len 7.4")
    assert lines[2].endswith("| ALARM truncation")  # given again: a new episode


def test_the_console_replaces_the_raw_dict_lines_and_keeps_a_progress_bar(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, capsys
):
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=GRPOConfigExt(**tiny_grpo_args(tmp_path, disable_tqdm=False, max_completion_length=1)),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    ConsoleCallback.install(trainer)
    kinds = [type(callback) for callback in trainer.callback_handler.callbacks]
    assert ConsoleCallback in kinds and PrinterCallback not in kinds and ProgressCallback not in kinds
    trainer.train()
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/4 | reward ") and "| ALARM zero_std, truncation" in lines[0]
    assert len(lines) == 5 and lines[-1].startswith("step 4/4 | train_runtime ")  # 4 steps and the summary
    assert "'loss':" not in out  # no raw dict line
    assert "4/4" in err  # the progress bar (tqdm writes to stderr)


def test_the_recipe_console_is_compact_by_default_and_raw_one_flag_away():
    _, training_args, _ = recipe.parse_args(["--model_name_or_path", "m", "--output_dir", "o"])
    assert training_args.console == "compact"
    _, training_args, _ = recipe.parse_args(["--model_name_or_path", "m", "--output_dir", "o", "--console", "raw"])
    assert training_args.console == "raw"


def test_a_resumed_run_does_not_repeat_the_alarms_given_before_it(tmp_path, capsys):
    """The last entry of a checkpoint's history may be a held-out evaluation, without alarm counts: the counts given
    before come from the whole history."""
    console = ConsoleCallback()
    args = GRPOConfigExt(**tiny_grpo_args(tmp_path))  # disable_tqdm: no bar, the lines are printed
    state = TrainerState(max_steps=4, global_step=2)
    state.log_history = [
        {"loss": 0.1, "step": 1, "alarms/zero_std": 1},
        {"loss": 0.1, "step": 2, "alarms/zero_std": 1, "alarms/truncation": 1},
        {"heldout/exact_match/mean@1": 0.5, "step": 2},  # the held-out pass at the save step: no counts
    ]
    console.on_train_begin(args, state, TrainerControl())
    state.global_step = 3
    console.on_log(args, state, TrainerControl(), logs={**TRAIN, "alarms/zero_std": 1, "alarms/truncation": 1})
    assert "ALARM" not in capsys.readouterr().out
    console.on_log(args, state, TrainerControl(), logs={**TRAIN, "alarms/zero_std": 2, "alarms/truncation": 1})
    assert capsys.readouterr().out.rstrip().endswith("| ALARM zero_std")


def test_a_nan_or_infinite_loss_is_shown_on_the_line_not_dropped():
    line = format_log_line({**TRAIN, "loss": float("nan"), "loss/policy": float("inf")}, 7, alarms=["kl_jump"])
    assert line.endswith("| len 7.4 | loss nan loss/policy inf | ALARM kl_jump")
    assert "nan" not in format_log_line(TRAIN, 7)


def test_the_end_of_training_prints_the_sampling_line_once_it_has_flat_shares(tmp_path, capsys):
    args = GRPOConfigExt(**tiny_grpo_args(tmp_path))
    console, state, control = ConsoleCallback(), TrainerState(max_steps=2), TrainerControl()
    console.on_train_begin(args, state, control)
    console.on_train_end(args, state, control)  # nothing logged: no line
    assert capsys.readouterr().out == ""
    state.log_history = [{"frac_reward_zero_std": 0.5, "epoch": 6.0, "step": 1}]
    console.on_train_end(args, state, control)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("sampling: in 50% of the groups generated") and "the prompts recur" in line
    state.log_history = [{"frac_reward_zero_std": 0.1, "epoch": 6.0, "step": 1}]
    console.on_train_end(args, state, control)  # few flat groups: nothing to change, no line
    assert capsys.readouterr().out == ""
