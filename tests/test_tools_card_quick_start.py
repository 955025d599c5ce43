"""The model card's quick start runs as written, from any folder: the run's folder by its absolute path (the Hub id
after a push), an adapter whose base model reference is absolute; and what the card says when matplotlib is missing."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, count_a_reward, make_trainer, model_card, tiny_grpo_args
from transformers import AutoTokenizer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.tools.recipes.demo import DEMO_MODEL


def quick_start(card: str) -> str:
    """The Python code of the card's "Quick start" section."""
    section = card.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return code


def card(**overrides) -> str:
    kwargs = dict(model_name="tiny-demo", base_model=None, is_adapter=True, config={}, metrics={})
    return model_card(**{**kwargs, **overrides})


def test_the_quick_start_loads_the_run_folder_by_its_absolute_path_with_a_training_prompt(tmp_path):
    text = card(model_path=str(tmp_path / "runs" / "tiny-demo"), prompt="abc=", base_model_path=DEMO_MODEL)
    code = quick_start(text)
    assert f'AutoPeftModelForCausalLM.from_pretrained("{tmp_path / "runs" / "tiny-demo"}")' in code
    assert f'AutoTokenizer.from_pretrained("{tmp_path / "runs" / "tiny-demo"}")' in code
    assert "inputs = tokenizer(['abc='], return_tensors=\"pt\")" in code
    assert f"The adapter's base model is the local folder `{DEMO_MODEL}`" in text


def test_after_a_push_the_quick_start_loads_the_hub_id():
    text = card(hub_model_id="me/tiny-demo", model_path="/somewhere/runs/tiny-demo", base_model="Qwen/Qwen2.5-0.5B")
    code = quick_start(text)
    assert 'from_pretrained("me/tiny-demo")' in code and "/somewhere" not in code
    assert "<your prompt>" in code  # no training prompt given
    assert "local folder" not in text  # a Hub base model loads anywhere


def test_the_adapter_quick_start_runs_without_a_future_warning(tiny_model_path, tmp_path):
    """PEFT 0.21 wrapping the base model reads transformers' deprecated `is_gradient_checkpointing`: the quick start,
    run with FutureWarnings as errors, loads the adapter and generates all the same."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=2, target_modules="all-linear")
    )
    model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(adapter)
    code = quick_start(card(model_path=str(adapter), prompt="abc=")).replace("max_new_tokens=64", "max_new_tokens=2")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-W", "error::FutureWarning", "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_a_full_model_is_loaded_with_transformers():
    code = quick_start(card(is_adapter=False, model_path="/runs/full"))
    assert 'AutoModelForCausalLM.from_pretrained("/runs/full")' in code and "peft" not in code


def test_a_relative_local_model_folder_is_made_absolute_for_the_adapter(tiny_model_path, tmp_path, monkeypatch):
    from peft import LoraConfig

    monkeypatch.chdir(os.path.dirname(tiny_model_path))
    relative = os.path.basename(tiny_model_path)
    trainer = GRPOTrainerExt(
        model=relative,
        reward_funcs=count_a_reward,
        args=GRPOConfigExt(**tiny_grpo_args(tmp_path / "out")),
        train_dataset=__import__("datasets").Dataset.from_dict({"prompt": ["abc="] * 8}),
        peft_config=LoraConfig(r=4, target_modules="all-linear"),
    )
    assert trainer.model.peft_config["default"].base_model_name_or_path == tiny_model_path
    trainer.save_model(str(tmp_path / "out"))
    with open(tmp_path / "out" / "adapter_config.json") as handle:
        assert json.load(handle)["base_model_name_or_path"] == tiny_model_path


def test_without_matplotlib_the_card_says_once_that_there_is_no_report(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch, caplog
):
    from transformers.utils import logging

    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=GRPOConfigExt(**tiny_grpo_args(tmp_path)),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.state.log_history = [{"loss": 0.1, "reward": 0.5, "step": 1}]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    logging.get_logger("trl_grpo_ext").warning_once.cache_clear()
    logging.enable_propagation()
    try:
        for _ in range(3):  # the card is written at every checkpoint
            trainer.create_model_card()
    finally:
        logging.disable_propagation()
    said = [record for record in caplog.records if "matplotlib is not installed" in record.getMessage()]
    assert len(said) == 1 and not (tmp_path / "report.png").exists()
    assert "## Training report" not in (tmp_path / "README.md").read_text()


def test_a_run_on_an_iterable_dataset_writes_its_card_without_a_training_prompt(tiny_model_path, tmp_path):
    """An `IterableDataset` is not read for the quick start's prompt (before: an AttributeError at the first card)."""
    from datasets import Dataset

    stream = Dataset.from_dict({"prompt": ["abc="] * 8}).to_iterable_dataset()
    trainer = make_trainer(tmp_path, tiny_model_path, None, stream)
    trainer.create_model_card()
    code = quick_start((tmp_path / "README.md").read_text())
    assert "<your prompt>" in code and "abc=" not in code


@pytest.mark.slow
def test_the_quick_start_of_a_demo_run_runs_as_written_from_another_folder(tmp_path):
    """Two demo steps into a folder, then the card's quick start, copied as it is, in a process whose current folder
    is neither the repository nor the run's parent."""
    run_dir, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    demo = [sys.executable, os.path.join(REPO, "recipes", "grpo.py"), "--config", "recipes/tiny/config_demo.yaml"]
    demo += ["--max_steps", "2", "--logging_steps", "1", "--eval_samples", "0", "--save_strategy", "no"]
    demo += ["--per_device_train_batch_size", "16", "--output_dir", str(run_dir / "runs" / "tiny-demo")]
    # As `make demo` runs it: from the repository root, with the config's relative model path.
    result = subprocess.run(demo, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    output = run_dir / "runs" / "tiny-demo"
    with open(output / "adapter_config.json") as handle:
        base = json.load(handle)["base_model_name_or_path"]
    assert os.path.isabs(base) and os.path.isfile(os.path.join(base, "model.safetensors"))

    code = quick_start((output / "README.md").read_text())
    assert f'"{output}"' in code
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    letters = result.stdout.strip().splitlines()[-1].replace(" ", "")
    assert letters and set(letters) <= set("abcdefghij")  # a completion of the reversal task


def test_a_run_that_never_saved_into_its_folder_has_a_quick_start_that_loads_its_checkpoint(tmp_path):
    """The README's tiny example: `train()` without `save_model()`; the card (written with the checkpoint at the
    last step) loads the model from that checkpoint, and its quick start runs as written."""
    from datasets import Dataset

    run_dir = tmp_path / "runs" / "tiny-grpo"
    trainer = GRPOTrainerExt(
        model=DEMO_MODEL,
        reward_funcs=count_a_reward,
        args=GRPOConfigExt(output_dir=str(run_dir), max_steps=2, logging_steps=1, use_cpu=True, report_to="none"),
        train_dataset=Dataset.from_dict({"prompt": ["abc=", "hij=", "efgd="] * 32}),
    )
    trainer.train()
    assert not (run_dir / "model.safetensors").exists() and (run_dir / "checkpoint-2" / "model.safetensors").exists()
    code = quick_start((run_dir / "README.md").read_text())
    assert f'from_pretrained("{run_dir / "checkpoint-2"}")' in code
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-4000:]


def test_a_card_written_before_any_save_says_how_to_save_the_model(tiny_model_path, tmp_path):
    from datasets import Dataset

    trainer = make_trainer(tmp_path, tiny_model_path, None, Dataset.from_dict({"prompt": ["abc="] * 8}))
    trainer.create_model_card()
    text = (tmp_path / "README.md").read_text()
    assert "No model was saved with this card yet: `trainer.save_model()`" in text and str(tmp_path) in text
    trainer.save_model()
    trainer.create_model_card()
    assert "No model was saved" not in (tmp_path / "README.md").read_text()
