"""The model card and the training report image."""

import yaml

from trl_grpo_ext.model_card import build_model_card, final_metrics
from trl_grpo_ext.report import plot_training_report

HISTORY = [
    {"loss": 0.1, "reward": 0.2, "kl": 0.01, "ratio/p05": 0.9, "ratio/p50": 1.0, "ratio/p95": 1.1, "step": 1},
    {"loss": 0.2, "kl": 0.02, "ratio/p05": 0.95, "ratio/p50": 1.0, "ratio/p95": 1.05, "step": 2},
    {"train_runtime": 3.0, "step": 2},
]


def test_final_metrics_are_the_last_logged_values():
    assert final_metrics(HISTORY) == {
        "reward": 0.2,
        "kl": 0.02,
        "ratio/p05": 0.95,
        "ratio/p50": 1.0,
        "ratio/p95": 1.05,
        "loss": 0.2,
    }


def card(**overrides):
    kwargs = dict(
        model_name="m",
        base_model="Qwen/Qwen2.5-0.5B-Instruct",
        is_adapter=True,
        config={"learning_rate": 1e-3, "beta": 0.04},
        metrics={"reward": 0.5},
        extra_metrics={"held-out exact_match (after)": 0.8},
        dataset_name="openai/gsm8k",
        lora={"r": 16, "alpha": 32, "target_modules": "all-linear"},
    )
    kwargs.update(overrides)
    return build_model_card(**kwargs)


def test_adapter_card_front_matter_and_sections():
    text = card()
    front = yaml.safe_load(text.split("---")[1])
    assert front["library_name"] == "peft" and front["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert front["tags"][:4] == ["trl", "grpo", "trl_grpo_ext", "lora"]
    assert front["datasets"] == ["openai/gsm8k"]
    for piece in (
        "## Objective",
        "| `beta` | 0.04 |",
        "| `lora_r` | 16 |",
        "held-out exact_match (after)",
        "![Training curves",
        "AutoPeftModelForCausalLM",
    ):
        assert piece in text, piece


def test_full_model_card_without_hub_base_model(tmp_path):
    local = tmp_path / "data"
    local.mkdir()
    front = yaml.safe_load(card(is_adapter=False, base_model=None, lora=None, dataset_name=str(local)).split("---")[1])
    assert front["library_name"] == "transformers"
    assert "base_model" not in front and "datasets" not in front and "lora" not in front["tags"]


def test_report_needs_training_entries_and_writes_a_png(tmp_path):
    assert plot_training_report([{"train_runtime": 1.0, "step": 1}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    path = plot_training_report(HISTORY, tmp_path / "report.png", title="t")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.endswith("report.png")
