"""The model card (the training report image: `test_report_figure.py`)."""

import re
import sys
from types import SimpleNamespace

import pytest
import trl.trainer.utils as trl_utils
import yaml
from helpers import count_a_reward, make_trainer, model_card, tiny_grpo_args
from transformers.trainer_utils import SchedulerType
from transformers.training_args import OptimizerNames
from trl import GRPOConfig
from trl.trainer.utils import generate_model_card

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.tools.card.builder import final_metrics
from trl_grpo_ext.tools.card.fields import CARD_CONFIG_FIELDS, card_config
from trl_grpo_ext.tools.card.objective import objective_formula, objective_options
from trl_grpo_ext.tools.report.health import assess

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
        metrics={"reward": 0.5, "held-out exact_match (after)": 0.8},
        dataset_name="openai/gsm8k",
        lora={"r": 16, "alpha": 32, "target_modules": "all-linear"},
    )
    kwargs.update(overrides)
    return model_card(**kwargs)


def test_adapter_card_front_matter_and_sections():
    text = card()
    front = yaml.safe_load(text.split("---")[1])
    assert front["library_name"] == "peft" and front["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert front["tags"][:5] == ["generated_from_trainer", "trl", "grpo", "trl_grpo_ext", "lora"]
    assert front["datasets"] == "openai/gsm8k" and front["model_name"] == "m"
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
    assert "base_model" not in front and "lora" not in front["tags"]


def test_the_configuration_table_shows_values_as_a_user_writes_them(tmp_path):
    args = GRPOConfigExt(output_dir=str(tmp_path), lr_scheduler_type="constant", use_cpu=True, bf16=False)
    config = {key: getattr(args, key) for key in CARD_CONFIG_FIELDS}
    config["optimizers"] = [OptimizerNames.ADAMW_TORCH, SchedulerType.COSINE]  # enums inside a list too
    text = card(config=config)
    assert "| `lr_scheduler_type` | constant |" in text
    assert "| `optimizers` | adamw_torch, cosine |" in text
    assert "| `learning_rate` | 1e-06 |" in text and "| `loss_type` | grpo |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert not [row for row in rows if re.search(r"[A-Z][A-Za-z]+\.[A-Z_]+", row)]  # no `EnumClass.MEMBER`


def test_the_card_lists_the_alarms_raised_or_says_there_were_none():
    text = card(alarms=["truncation (steps 1-4): 100% of completions reached max_completion_length ..."])
    health = text.split("## Training health")[1].split("##")[0]
    assert "- truncation (steps 1-4): 100% of completions" in health
    assert "No alarm was raised" in card(alarms=[]) and "## Training health" not in card()


def test_a_run_with_its_alarms_off_has_a_card_that_lists_none_and_says_so(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer = make_trainer(
        tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, max_completion_length=1, warn_on_anomalies=False
    )
    trainer.train()
    assert "truncation" in assess(trainer.state.log_history).alarms  # what alarms on would have listed
    trainer.create_model_card()
    health = section((tmp_path / "README.md").read_text(), "## Training health")
    assert health.startswith("The alarms were off in this run (`warn_on_anomalies=False`).")
    assert "truncation" not in health and "No alarm was raised" not in health


# DeepSeekMath's GRPO objective, as the card of GRPOConfigExt's defaults has always written it.
DOCUMENTS_OBJECTIVE = """```
r_it = exp(logp_it - old_logp_it)
S_it = min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
K_it = exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1
loss = -(1/G) * sum_i (1/|o_i|) * sum_t (S_it - beta * K_it),   A_i = (R_i - mean_group R) / (std_group R + 1e-4)
```"""


def headings(text: str) -> list[str]:
    """The Markdown headings of a card's body, in order (lines in fenced code blocks are not headings)."""
    found, fenced = [], False
    for line in text.split("---", 2)[2].splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#+ ", line):
            found.append(line.strip())
    return found


def section(text: str, heading: str) -> str:
    """The text under `heading`, up to the next heading of any level."""
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(r"\n#+ ", body, maxsplit=1)[0].strip()


def lines_of(text: str) -> list[str]:
    """The non-blank lines of `text`, without trailing spaces (TRL's template leaves some)."""
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def objective_section(text: str) -> str:
    return text.split("## Objective")[1].split("## Training configuration")[0]


def config_card(args, **overrides) -> str:
    """The card as `create_model_card` builds it for `args`: the configuration table and the objective's options."""
    return card(
        config=card_config(args),
        objective=objective_options(args),
        **overrides,
    )


def test_the_card_of_trl_defaults_states_dapo_aggregation_over_the_window_and_no_kl(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)  # loss_type="dapo", beta=0.0
    text = card(config={key: getattr(args, key) for key in CARD_CONFIG_FIELDS})  # what the card was given
    objective = objective_section(text)
    assert "loss = -(1/D) * sum_i sum_t S_it,   A_i = (R_i - mean_group R) / (std_group R + 1e-4)" in objective
    assert "D = sum_i |o_i| over the gradient-accumulation window" in objective
    assert "K_it" not in objective and "beta" not in objective and "(1/|o_i|)" not in objective
    # TRL's paper line cites DeepSeekMath (GRPO's paper); the card does not claim its objective.
    assert "the DeepSeekMath objective" not in text and "the `dapo` objective of TRL" in text
    assert objective_section(config_card(args)) == objective


def test_a_cispo_card_names_cispo_term():
    objective = objective_section(card(config={"loss_type": "cispo", "beta": 0.0}))
    assert "S_it = sg(min(r_it, eps_high)) * A_i * logp_it" in objective and "CISPO" in objective
    assert "clip(" not in objective and "loss = -(1/D) * sum_i sum_t S_it," in objective


def test_a_bias_corrected_kl_is_multiplied_by_the_ratio(tmp_path):
    objective = objective_section(card(config={"beta": 0.04, "use_bias_correction_kl": True}))
    assert "K_it = (exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1) * r_it" in objective
    assert "sum_t (S_it - beta * K_it)" in objective
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, beta=0.04)  # use_bias_correction_kl=True
    assert objective_section(config_card(args)).count("* r_it") == 1
    # Without the KL term there is nothing to correct.
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert "K_it" not in objective_section(config_card(args))


def test_the_default_card_keeps_deepseekmath_s_objective(tmp_path):
    args = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert objective_formula(objective_options(args)) == DOCUMENTS_OBJECTIVE
    text = config_card(args)
    assert DOCUMENTS_OBJECTIVE in objective_section(text) and "whose loss is the DeepSeekMath objective" in text
    assert DOCUMENTS_OBJECTIVE in objective_section(card())  # no options given: GRPOConfigExt's defaults


@pytest.mark.parametrize(
    "options, pieces",
    [
        (
            {"importance_sampling_level": "sequence", "loss_type": "luspo", "beta": 0.0},
            ["r_it = exp((1/|o_i|) * sum_s (logp_is - old_logp_is))", "loss = -(1/G) * sum_i sum_t S_it,"],
        ),
        ({"delta": 4.0}, ["S_it = min(min(r_it, delta) * A_i, clip(", "delta = 4 (two-sided clipping)"]),
        (
            {"top_entropy_quantile": 0.2, "entropy_coef": 0.01, "beta": 0.0},
            ["sum_t (w_it * S_it) - c * H,", "w_it = h_it", "top 0.2 fraction", "c = entropy_coef = 0.01"],
        ),
        ({"use_adaptive_entropy": True}, ["- c * H,", "adapted each optimizer step towards entropy_target"]),
        (
            {"off_policy_mask_threshold": 0.5, "use_vllm": True, "vllm_importance_sampling_correction": True},
            ["sum_t (w_it * S_it - beta * K_it)", "w_it = m_i * rho_it", "> 0.5 (off_policy_mask_threshold)"],
        ),
        ({"scale_rewards": "batch"}, ["A_i = (R_i - mean_group R) / (std_batch R + 1e-4)"]),
        ({"scale_rewards": "none"}, ["A_i = R_i - mean_group R\n"]),
        ({"scale_rewards": False}, ["A_i = R_i - mean_group R\n"]),
        ({"loss_type": "bnpo"}, ["loss = -(1/T) * sum_i sum_t (S_it - beta * K_it),", "T = sum_i |o_i|"]),
        ({"loss_type": "dr_grpo"}, ["loss = -(1/D) * sum_i sum_t", "D = G * max_completion_length"]),
        ({"loss_type": "sapo"}, ["sigmoid(tau_i * (r_it - 1)) * A_i", "loss = -(1/G) * sum_i (1/|o_i|) * sum_t"]),
        ({"loss_type": "vespo", "beta": 0.0}, ["S_it = sg(phi_i) * A_i * logp_it", "w_i = exp(sum_t"]),
    ],
)
def test_each_option_shows_in_the_objective(options, pieces):
    objective = objective_section(card(config={}, objective=options))
    for piece in pieces:
        assert piece in objective, (piece, objective)
    assert DOCUMENTS_OBJECTIVE not in objective


def front_matter(text: str) -> dict:
    return yaml.safe_load(text.split("---")[1])


def trl_front_matter(model_name, dataset_name) -> dict:
    """The front matter of stock TRL's card (`trl.trainer.utils.generate_model_card`, as `GRPOTrainer` calls it)."""
    trl_card = generate_model_card(
        base_model="Qwen/Qwen2.5-0.5B-Instruct",
        model_name=model_name,
        hub_model_id=model_name,
        dataset_name=dataset_name,
        tags=["trl", "grpo"],
        wandb_url=None,
        trackio_url=None,
        trainer_name="GRPO",
    )
    return trl_card.data.to_dict()


@pytest.mark.parametrize("local", [True, False])
def test_model_name_and_dataset_are_written_as_trl_writes_them(tmp_path, local):
    dataset_name = str(tmp_path / "my_prompts.jsonl") if local else "openai/gsm8k"
    if local:
        (tmp_path / "my_prompts.jsonl").write_text("{}\n")
    text = card(model_name="tiny-grpo", dataset_name=dataset_name)
    ours, trl_front = front_matter(text), trl_front_matter("tiny-grpo", dataset_name)
    assert ours["model_name"] == trl_front["model_name"] == "tiny-grpo"
    if local:  # named in the text only: not a dataset id in the front matter, nor linked to a Hub page
        assert "datasets" not in ours and trl_front["datasets"] == dataset_name
        assert f"on the `{dataset_name}` dataset" in text and "huggingface.co/datasets" not in text
    else:
        assert ours["datasets"] == trl_front["datasets"] == dataset_name
        assert "on the [openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k) dataset" in text


@pytest.mark.parametrize(
    ("dataset_name", "written"),
    [
        ("gsm8k", "gsm8k"),  # a bare Hub id
        ("data/prompts.jsonl", None),  # a local file, existing below
        ("../prompts", None),
        ("/abs/prompts.jsonl", None),
        (["openai/gsm8k", "data/prompts.jsonl"], ["openai/gsm8k"]),
    ],
)
def test_the_front_matter_lists_only_hub_dataset_ids(dataset_name, written, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text("{}\n")
    assert front_matter(card(dataset_name=dataset_name)).get("datasets") == written


WANDB_URL = "https://wandb.ai/me/grpo/runs/abc123"
TRACKIO_URL = "https://me-trackio.hf.space?project=grpo&runs=run-1&sidebar=collapsed"
COMET_URL = "https://www.comet.com/me/grpo/0123456789"


def fake_active_runs(monkeypatch):
    """A W&B, a Trackio and a Comet run in progress, as stock TRL's `create_model_card` looks them up (offline)."""
    import trl.trainer.base_trainer as base_trainer

    # W&B as TRL's card checks it: transformers' `is_wandb_available()`, then `wandb.run.url`.
    monkeypatch.setattr(base_trainer, "is_wandb_available", lambda: True)
    monkeypatch.setattr(base_trainer, "wandb", SimpleNamespace(run=SimpleNamespace(url=WANDB_URL)), raising=False)
    run = SimpleNamespace(_space_id="me/trackio", project="grpo", name="run-1")
    monkeypatch.setattr(trl_utils, "is_trackio_available", lambda: True)
    context_vars = SimpleNamespace(current_run=SimpleNamespace(get=lambda: run))
    monkeypatch.setitem(sys.modules, "trackio", SimpleNamespace(context_vars=context_vars))
    monkeypatch.setattr(trl_utils, "is_comet_available", lambda: True)
    comet_ml = SimpleNamespace(get_running_experiment=lambda: SimpleNamespace(url=COMET_URL))
    monkeypatch.setattr(trl_utils, "comet_ml", comet_ml, raising=False)


def test_the_card_keeps_trl_s_links_to_the_active_wandb_trackio_and_comet_runs():
    urls = {"wandb_url": WANDB_URL, "trackio_url": TRACKIO_URL, "comet_url": COMET_URL}
    procedure = section(card(**urls), "## Training procedure")
    for tracker, url in (("Weights & Biases", WANDB_URL), ("Trackio", TRACKIO_URL), ("Comet", COMET_URL)):
        assert f'alt="Visualize in {tracker}"' in procedure and f"]({url})" in procedure  # TRL's badge
    assert "Visualize in" not in card(report_image=None)


def test_a_trainer_with_trl_defaults_writes_its_objective_name_dataset_and_run_link(
    tiny_model_path, tiny_tokenizer, prompt_dataset, monkeypatch, tmp_path
):
    args = GRPOConfig(**tiny_grpo_args(tmp_path))  # TRL's defaults: loss_type="dapo", beta=0.0
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=args,
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    fake_active_runs(monkeypatch)
    local_dataset = str(tmp_path)  # a folder: not a Hub id
    trainer.create_model_card(model_name="tiny-grpo", dataset_name=local_dataset)
    text = (tmp_path / "README.md").read_text()
    objective = objective_section(text)
    assert "loss = -(1/D) * sum_i sum_t S_it," in objective and "K_it" not in objective
    front = front_matter(text)
    assert (
        front["model_name"] == "tiny-grpo" and "datasets" not in front and f"on the `{local_dataset}` dataset" in text
    )
    assert {"trl", "grpo", "trl_grpo_ext", f"trackio:{TRACKIO_URL}"} <= set(front["tags"])
    assert f"]({WANDB_URL})" in section(text, "## Training procedure")
    assert f"]({TRACKIO_URL})" in section(text, "## Training procedure")


def stock_and_ext_cards(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, **card_kwargs) -> tuple[str, str]:
    """The card of stock `trl.GRPOTrainer` and of `GRPOTrainerExt` for the same run and the same call."""
    from trl import GRPOTrainer

    texts = []
    for name, trainer_class in (("stock", GRPOTrainer), ("ext", GRPOTrainerExt)):
        trainer = make_trainer(
            tmp_path / name,
            tiny_model_path,
            tiny_tokenizer,
            prompt_dataset,
            trainer_cls=trainer_class,
            config_cls=GRPOConfig,
        )
        trainer.create_model_card(**card_kwargs)
        texts.append((tmp_path / name / "README.md").read_text())
    return texts[0], texts[1]


def test_the_card_keeps_every_tag_and_heading_of_stock_trl_s_card(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    """Stock TRL 1.16's card for the same run (on Hugging Face Jobs, with W&B, trackio and Comet runs): each of its
    front-matter fields (`licence: license`, TRL's placeholder, included), each tag, each heading (same level, same
    order), its tracked-run badges and paper line, framework versions and citations are in this package's card."""
    monkeypatch.setenv("JOB_ID", "0123abcd")
    fake_active_runs(monkeypatch)
    stock, ours = stock_and_ext_cards(
        tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, model_name="tiny-grpo", dataset_name="openai/gsm8k"
    )
    stock_front, our_front = front_matter(stock), front_matter(ours)
    assert {"generated_from_trainer", "trl", "grpo", "hf_jobs", f"trackio:{TRACKIO_URL}"} <= set(stock_front["tags"])
    assert set(stock_front["tags"]) <= set(our_front["tags"])
    assert stock_front["licence"] == our_front["licence"] == "license"
    assert {key: our_front.get(key) for key in stock_front if key != "tags"} == {
        key: value for key, value in stock_front.items() if key != "tags"
    }
    stock_headings, our_headings = headings(stock), headings(ours)
    assert stock_headings == [
        "# Model Card for tiny-grpo",
        "## Quick start",
        "## Training procedure",
        "### Framework versions",
        "## Citations",
    ]
    positions = [our_headings.index(heading) for heading in stock_headings]
    assert positions == sorted(positions), our_headings  # in TRL's order, this package's sections in between
    for heading in ("## Training procedure", "## Citations"):
        assert lines_of(section(ours, heading)) == lines_of(section(stock, heading)), heading
    assert "@article{shao2024deepseekmath" in section(ours, "## Citations")
    assert "@software{vonwerra2020trl" in section(ours, "## Citations")
    stock_versions = section(stock, "### Framework versions").splitlines()
    our_versions = section(ours, "### Framework versions").splitlines()
    assert set(stock_versions) <= set(our_versions) and our_versions[0].startswith("- trl_grpo_ext: ")


def test_without_jobs_or_runs_the_card_has_neither_the_jobs_tag_nor_badges(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    monkeypatch.delenv("JOB_ID", raising=False)
    stock, ours = stock_and_ext_cards(tmp_path, tiny_model_path, tiny_tokenizer, prompt_dataset, tags="my-tag")
    stock_tags, our_tags = set(front_matter(stock)["tags"]), set(front_matter(ours)["tags"])
    assert "hf_jobs" not in our_tags and not any(tag.startswith("trackio:") for tag in our_tags)
    assert stock_tags <= our_tags and "my-tag" in our_tags
    assert lines_of(section(ours, "## Training procedure")) == lines_of(section(stock, "## Training procedure"))
    assert section(ours, "## Training procedure").startswith(
        "This model was trained with GRPO, a method introduced in"
    )


def test_the_configuration_table_leaves_out_fields_that_did_not_act(tmp_path):
    text = config_card(GRPOConfigExt(output_dir=str(tmp_path), max_steps=30, num_train_epochs=3, use_cpu=True))
    table = section(text, "## Training configuration")
    assert "| `max_steps` | 30 |" in table and "num_train_epochs" not in table  # max_steps > 0 sets the length
    table = section(
        config_card(GRPOConfigExt(output_dir=str(tmp_path), num_train_epochs=2, use_cpu=True)),
        "## Training configuration",
    )
    assert "| `num_train_epochs` | 2 |" in table and "max_steps" not in table
    args = GRPOConfigExt(output_dir=str(tmp_path), loss_type="cispo", epsilon_high=5.0, beta=0.0, use_cpu=True)
    table = section(config_card(args), "## Training configuration")
    assert "| `epsilon_high` | 5 |" in table and "| `epsilon` |" not in table  # CISPO truncates at eps_high only
    args = GRPOConfigExt(output_dir=str(tmp_path), loss_type="sapo", use_cpu=True)
    assert "epsilon" not in section(config_card(args), "## Training configuration")
    args = GRPOConfigExt(output_dir=str(tmp_path), multi_objective_aggregation="normalize_then_sum", use_cpu=True)
    assert "scale_rewards" not in section(config_card(args), "## Training configuration")
    args = GRPOConfigExt(output_dir=str(tmp_path), use_cpu=True)  # epsilon_high unset: TRL clips with epsilon
    table = section(config_card(args), "## Training configuration")
    assert "| `epsilon` | 0.2 |" in table and "epsilon_high" not in table


def test_the_card_shows_lora_target_modules_as_the_user_wrote_them(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainerExt(
        model=tiny_model_path,
        reward_funcs=count_a_reward,
        args=GRPOConfigExt(**tiny_grpo_args(tmp_path)),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
        peft_config=peft_config,
    )
    assert isinstance(peft_config.target_modules, set)  # PEFT wrote the 14 module paths it matched into it
    trainer.create_model_card(model_name="tiny-lora")
    text = (tmp_path / "README.md").read_text()
    table = section(text, "## Training configuration")
    assert "| `lora_target_modules` | all-linear |" in table and "| `lora_r` | 4 |" in table
    assert "self_attn" not in text and front_matter(text)["library_name"] == "peft"
