"""Helpers shared by the test modules (importable as `helpers`: pytest puts tests/ on sys.path)."""

import glob
import math
import os
import random
import socket
import subprocess
import sys

import pytest
import torch
from transformers import TrainerCallback, set_seed
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.diagnostics import CORE_BIN_WIDTH
from trl_grpo_ext.guardrails import AnomalyMonitor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "recipes")
ACCELERATE_CONFIGS = os.path.join(RECIPES, "accelerate_configs")
LAUNCHED = os.path.join(REPO, "tests", "launched.py")
# tests/launched.py's two-process runs: gradient_accumulation_steps=2, logging_steps=1
MICRO_BATCHES_PER_LOG = 2


def recipe_configs() -> list[str]:
    """The repository's recipe configs and those shipped in the package, each file once (recipes/tiny links to the
    package)."""
    from trl_grpo_ext.tools.recipes.demo import DEMO_DIR

    return sorted(
        {
            os.path.realpath(path)
            for path in glob.glob(os.path.join(RECIPES, "**", "*.yaml"), recursive=True)
            + glob.glob(os.path.join(DEMO_DIR, "*.yaml"))
            if os.sep + "accelerate_configs" + os.sep not in path
        }
    )


RECIPE_CONFIGS = recipe_configs()


def model_card(
    model_name: str = "m",
    base_model: str | None = None,
    dataset_name: str | list[str] | None = None,
    hub_model_id: str | None = None,
    tags: tuple[str, ...] = (),
    wandb_url: str | None = None,
    trackio_url: str | None = None,
    comet_url: str | None = None,
    **sections,
) -> str:
    """A run's model card: stock TRL's, as `GRPOTrainer.create_model_card` renders it for the run, with this package's
    sections added (`tools.card.extend_card(card, **sections)`)."""
    from trl.trainer.utils import generate_model_card

    from trl_grpo_ext.tools.card import extend_card

    trl_card = generate_model_card(
        base_model=base_model,
        model_name=model_name,
        hub_model_id=hub_model_id,
        dataset_name=dataset_name,
        tags=[*tags, *GRPOTrainer._tag_names],
        wandb_url=wandb_url,
        trackio_url=trackio_url,
        comet_url=comet_url,
        trainer_name=GRPOTrainer._name,
        trainer_citation=GRPOTrainer._paper.get("citation"),
        template_file=GRPOTrainer._template_file,
        paper_title=GRPOTrainer._paper.get("title"),
        paper_id=GRPOTrainer._paper.get("id"),
    )
    return extend_card(str(trl_card), dataset_name=dataset_name, hub_model_id=hub_model_id, **sections)


def count_a_reward(completions, **kwargs) -> list[float]:
    """Rewards letters 'a' and length: different completions of one prompt get different rewards."""
    return [completion.count("a") + 0.1 * len(completion) for completion in completions]


CONSTANT_PROMPTS = {"xyz=", "qq="}  # half of the conftest `prompt_dataset`


def half_constant_reward(prompts, completions, **kwargs) -> list[float]:
    """Constant for half of the prompts (their groups have no spread), letters 'a' and length for the others."""
    return [
        1.0 if prompt in CONSTANT_PROMPTS else completion.count("a") + 0.1 * len(completion)
        for prompt, completion in zip(prompts, completions, strict=True)
    ]


def constant_reward(completions, **kwargs) -> list[float]:
    """The same reward for every completion: no group has any spread."""
    return [1.0] * len(completions)


def tiny_grpo_args(output_dir, **overrides) -> dict:
    """Keyword arguments for a few-step CPU GRPO run on the tiny model."""
    args = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    args.update(overrides)
    return args


def tiny_lora():
    """The LoRA adapter of the tests: rank 4 on every linear layer."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def make_trainer(
    output_dir,
    model,
    tokenizer,
    dataset,
    *,
    trainer_cls: type[GRPOTrainer] = GRPOTrainerExt,
    config_cls: type[GRPOConfig] = GRPOConfigExt,
    reward_funcs=count_a_reward,
    peft_config=None,
    eval_dataset=None,
    callbacks=None,
    trainer_kwargs: dict | None = None,
    args: GRPOConfig | None = None,
    **config,
) -> GRPOTrainer:
    """A trainer for a few-step CPU run: `trainer_cls` with `config_cls(**tiny_grpo_args(output_dir, **config))`.

    The RNGs are seeded with the config's seed first: stock TRL 1.14 draws LoRA adapters from the unseeded generator
    (`GRPOTrainerExt` and TRL >= 1.15 seed before they build the model, so for them this changes nothing).

    Args:
        model: a path or a model, as `trl.GRPOTrainer` takes it; `tokenizer` may be `None` (TRL loads it).
        trainer_kwargs: further keyword arguments of `trainer_cls`, e.g. `heldout_metrics`.
        args: a config built by the caller, instead of `config_cls(...)` (then `config` must be empty).
        **config: fields of the config, over `tiny_grpo_args`'s.
    """
    if args is None:
        args = config_cls(**tiny_grpo_args(output_dir, **config))
    elif config:
        raise TypeError(f"make_trainer got both a config and config fields: {sorted(config)}")
    set_seed(args.seed)
    return trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
        **(trainer_kwargs or {}),
    )


def training_entries(trainer) -> list[dict]:
    """The entries of the trainer's log history that training logged (those with a loss)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def train_logs(output_dir, model, tokenizer, dataset, **kwargs) -> tuple[list[dict], GRPOTrainer]:
    """Trains `make_trainer(output_dir, model, tokenizer, dataset, **kwargs)`: its training entries and the trainer."""
    trainer = make_trainer(output_dir, model, tokenizer, dataset, **kwargs)
    trainer.train()
    return training_entries(trainer), trainer


def fired_at(stream, name, thresholds=None, **settings):
    """The indices of the entries of `stream` at which the alarm `name` was given, and the warnings."""
    monitor = AnomalyMonitor(thresholds, **settings)
    indices, messages = [], []
    for index, entry in enumerate(stream):
        started = [message for message in monitor.check(entry, step=index, warn=False) if f"alarms/{name};" in message]
        if started:
            indices.append(index)
            messages += started
    return indices, messages, monitor


def monitor_of(trainer) -> AnomalyMonitor:
    (monitor,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnomalyMonitor)]
    return monitor


def noisy_run(curve, steps: int = 400, noise: float = 0.03, seed: int = 0) -> list[dict]:
    """One log entry per step: `curve(step)` plus normal noise, with a gradient norm and a loss."""
    rng = random.Random(seed)
    return [
        {"step": step, "loss": 0.1, "grad_norm": 1.0, "reward": curve(step) + rng.gauss(0, noise)}
        for step in range(1, steps + 1)
    ]


def resumed_at(history: list[dict], cut: int, whole: AnomalyMonitor, alarm: str) -> int:
    """Replays `history[:cut]` into a fresh monitor (a resume from a checkpoint), checks the rest live, asserts the
    episodes and counts are those of `whole` (the run without a resume); returns how often `alarm` was given after
    the cut."""
    resumed = AnomalyMonitor()
    resumed.replay(history[:cut])
    warnings = [warning for entry in history[cut:] for warning in resumed.check(entry, warn=False)]
    assert [(e.name, e.start, e.end) for e in resumed.episodes] == [(e.name, e.start, e.end) for e in whole.episodes]
    assert resumed.counts == whole.counts
    return len([warning for warning in warnings if f"alarms/{alarm};" in warning])


# Two runs that should log the same: the same formulas evaluated in another order agree to ~1e-7 relative per step; a
# different sampled completion, the only way the runs could drift further, would move `reward` by >= 0.1.
RTOL, ATOL = 1e-5, 1e-6
UNCOMPARED = {"step_time"}  # wall-clock


def assert_same_logs(stock: list[dict], ours: list[dict]) -> int:
    """Every float metric of the 4 training entries of `stock` is in `ours`, equal within RTOL/ATOL; how many."""
    assert len(stock) == len(ours) == 4
    compared = 0
    for step, (expected, got) in enumerate(zip(stock, ours, strict=True), start=1):
        for key, value in expected.items():
            if key in UNCOMPARED:
                continue
            assert key in got, (step, key)
            if isinstance(value, float) and not math.isnan(value):
                assert got[key] == pytest.approx(value, rel=RTOL, abs=ATOL), (step, key)
                compared += 1
    return compared


class SamplerStandIn:
    """Stands in for TRL's vLLM backend: samples with the trainer's own model and reports each sampled token's
    log-probability a little off the trainer's (a deterministic offset), as an inference engine's differ."""

    def __init__(self, *, model, processing_class, max_completion_length, **kwargs):
        self.model, self.tokenizer, self.max_new_tokens = model, processing_class, max_completion_length

    def sync_weights(self):
        pass  # it samples with the trainer's weights themselves

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        model = self.model
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        completions, logprobs = [], []
        for prompt in prompts:
            prompt_tensor = torch.tensor([prompt])
            generated = model.generate(
                prompt_tensor, do_sample=True, max_new_tokens=self.max_new_tokens, pad_token_id=pad
            )[0, len(prompt) :].tolist()
            if eos in generated:
                generated = generated[: generated.index(eos) + 1]
            sequence = torch.tensor([prompt + generated])
            scores = model(sequence).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            exact = scores.gather(-1, torch.tensor(generated)[:, None]).squeeze(-1)
            offsets = 0.05 * torch.sin(torch.arange(len(generated), dtype=torch.float32) + len(prompt))
            completions.append(generated)
            logprobs.append([[value] for value in (exact + offsets).tolist()])
        return prompts, completions, logprobs, None


#: TRL's `vllm_importance_sampling_mode` values; the fast pair covers token-level truncation and sequence-level
#: masking, the other two are slow.
CORRECTION_MODES = [
    "token_truncate",
    pytest.param("token_mask", marks=pytest.mark.slow),
    pytest.param("sequence_truncate", marks=pytest.mark.slow),
    "sequence_mask",
]


def use_sampler_stand_in(monkeypatch) -> None:
    """TRL builds a `SamplerStandIn` where `use_vllm=True` would start vLLM."""
    import trl.trainer.grpo_trainer

    monkeypatch.setattr(trl.trainer.grpo_trainer, "VLLMGeneration", SamplerStandIn)


class WeightRecorder(TrainerCallback):
    """Keeps a copy of the trainable weights after every optimizer step (index 0: before training)."""

    def __init__(self):
        self.snapshots = []

    def snapshot(self, model):
        self.snapshots.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshot(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshot(model)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_env(**variables) -> dict:
    """This process's environment for the processes of tests/launched.py: no GPU, one thread each, the Hub offline."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **variables)


def harness_command(output_dir, model_path, phases, *options) -> list[str]:
    """The arguments of tests/launched.py: its `phases` (names, in order) with `options`, e.g. `--save_steps 3`."""
    return [LAUNCHED, str(output_dir), str(model_path), "--phases", ",".join(phases), *map(str, options)]


def launch(config: str, output_dir, model_path, phases, *options, check: bool = True) -> subprocess.CompletedProcess:
    """tests/launched.py's `phases` under `accelerate launch` with `recipes/accelerate_configs/<config>` (two
    processes), on the CPU."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ACCELERATE_CONFIGS, config),
        "--main_process_port",
        str(free_port()),
        *harness_command(output_dir, model_path, phases, *options),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=launched_env(), cwd=REPO)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def run_alone(output_dir, model_path, phases, *options, env: dict | None = None) -> subprocess.CompletedProcess:
    """tests/launched.py's `phases` in one process of this Python, without a launcher; `env`: more variables."""
    command = [sys.executable, *harness_command(output_dir, model_path, phases, *options)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=launched_env(**(env or {})))


def phase_results(output_dir, phase: str, num_processes: int = 2) -> list[dict]:
    """What each process of a tests/launched.py phase saved."""
    return [
        torch.load(os.path.join(output_dir, phase, f"rank{rank}.pt"), weights_only=False)
        for rank in range(num_processes)
    ]


def assert_logged_statistics_are_those_of_both_processes_pooled(ranks: list[dict]) -> None:
    """Every logged diagnostic of a tests/launched.py `reference` run equals that of the pooled records."""
    logs = [entry for entry in ranks[0]["log_history"] if "loss" in entry]
    steps = [rank["records"]["steps"] for rank in ranks]
    assert len(logs) * MICRO_BATCHES_PER_LOG == len(steps[0]) == len(steps[1])
    # The processes saw different completions.
    assert not torch.equal(steps[0][0]["mask"], steps[1][0]["mask"]) or not torch.equal(
        steps[0][0]["advantages"], steps[1][0]["advantages"]
    )
    rewards_seen = 0
    for window, entry in enumerate(logs):
        window_steps = [
            rank_steps[window * MICRO_BATCHES_PER_LOG : (window + 1) * MICRO_BATCHES_PER_LOG] for rank_steps in steps
        ]
        pooled = [step for rank_steps in window_steps for step in rank_steps]
        ratios = torch.cat([step["ratio"][step["mask"]] for step in pooled]).double()
        log_ratios = torch.cat([step["log_ratio"][step["mask"]] for step in pooled]).double()
        assert entry["ratio/mean"] == pytest.approx(ratios.mean().item(), rel=1e-9)
        assert entry["ratio/std"] == pytest.approx(ratios.std().item(), rel=1e-6, abs=1e-12)
        assert entry["ratio/min"] == pytest.approx(ratios.min().item(), rel=1e-7)
        assert entry["ratio/max"] == pytest.approx(ratios.max().item(), rel=1e-7)
        for quantile in (0.05, 0.5, 0.95):
            got = math.log(entry[f"ratio/p{round(quantile * 100):02d}"])
            lower = torch.quantile(log_ratios, quantile, interpolation="lower").item()
            higher = torch.quantile(log_ratios, quantile, interpolation="higher").item()
            assert lower - CORE_BIN_WIDTH - 1e-9 <= got <= higher + CORE_BIN_WIDTH + 1e-9
        # The recorded terms are in backward units (divided by the accumulation steps); the logged ones are their sum
        # over each optimizer step, averaged over the optimizer steps of both processes (one per log step each).
        optimizer_steps = len(pooled) / MICRO_BATCHES_PER_LOG
        policy = [step["policy_loss"].item() for step in pooled]
        penalty = [step["kl_penalty"].item() for step in pooled]
        assert entry["loss/policy"] == pytest.approx(sum(policy) / optimizer_steps, rel=1e-6, abs=1e-9)
        assert entry["loss/kl_penalty"] == pytest.approx(sum(penalty) / optimizer_steps, rel=1e-6, abs=1e-12)
        assert entry["loss/policy"] + entry["loss/kl_penalty"] == pytest.approx(entry["loss"], rel=1e-5, abs=1e-7)
        # TRL's definitions: per micro-batch, a token mean over both processes; then the mean over micro-batches.
        per_step_kl, per_step_clip = [], []
        for first, second in zip(*window_steps, strict=True):
            tokens = first["mask"].sum() + second["mask"].sum()
            kl = first["per_token_kl"][first["mask"]].sum() + second["per_token_kl"][second["mask"]].sum()
            per_step_kl.append((kl / tokens).item())
            clipped = sum(
                (
                    ((step["ratio"] < 0.8) & (step["advantages"] < 0))
                    | ((step["ratio"] > 1.2) & (step["advantages"] > 0))
                )[step["mask"]].sum()
                for step in (first, second)
            )
            per_step_clip.append((clipped / tokens).item())
        assert entry["kl"] == pytest.approx(sum(per_step_kl) / len(per_step_kl), rel=1e-5, abs=1e-12)
        assert entry["clip_ratio/region_mean"] == pytest.approx(sum(per_step_clip) / len(per_step_clip), rel=1e-6)
        if "reward_std/group_mean" in entry:  # logged by the steps that generated
            # Rewards are already gathered: both processes hold the same, whole generation batch.
            rewards = [rank["records"]["rewards"][rewards_seen] for rank in ranks]
            rewards_seen += 1
            assert torch.equal(rewards[0], rewards[1])
            group_stds = rewards[0].double().view(-1, 4).std(dim=1)
            assert entry["reward_std/group_mean"] == pytest.approx(group_stds.mean().item(), rel=1e-6)
            assert entry["reward_std/group_min"] == pytest.approx(group_stds.min().item(), abs=1e-7)
            assert entry["reward_std/group_max"] == pytest.approx(group_stds.max().item(), rel=1e-6)
            # Each process's lengths are its slice of the batch, in process order; every group lies on one process.
            lengths = torch.cat([rank["records"]["lengths"][rewards_seen - 1] for rank in ranks]).double()
            reward = rewards[0].double().view(-1, 4)
            length = lengths.view(-1, 4)
            reward, length = reward - reward.mean(dim=1, keepdim=True), length - length.mean(dim=1, keepdim=True)
            reward = torch.where(group_stds[:, None] > 1e-8, reward, 0.0)
            correlation = (reward * length).sum() / (reward.pow(2).sum() * length.pow(2).sum()).sqrt()
            if torch.isfinite(correlation):
                assert entry["reward_length_corr/within_group"] == pytest.approx(correlation.item(), rel=1e-6)
            else:  # no length or no reward spread inside any group
                assert "reward_length_corr/within_group" not in entry
    assert rewards_seen == len(ranks[0]["records"]["rewards"]) > 0


def assert_one_gather_per_log_step(ranks: list[dict]) -> None:
    """The diagnostics of a tests/launched.py `reference` run made one collective per log step, no more."""
    for rank in ranks:
        calls = rank["collectives"]
        assert rank["records"]["log_calls"] == len([entry for entry in rank["log_history"] if "loss" in entry]) > 0
        assert calls["ours"] == rank["records"]["log_calls"]  # one gather per log step
        assert calls["ours_in_loss"] == 0  # nothing per micro-batch
        assert calls["total"] > calls["ours"]  # the engine's own collectives were counted by the same hooks


def assert_packed_is_padded(packed: list[dict], padded: list[dict]) -> None:
    """tests/launched.py's `reference` run (padding-free log-probs, the default) logged the losses, gradient norms
    and statistics of its `padded` run (TRL's padded forward) to rounding, and each ran the forward it names."""
    for packed_rank, padded_rank in zip(packed, padded, strict=True):
        assert packed_rank["records"]["packed_forwards"] > 0
        assert padded_rank["records"]["packed_forwards"] == 0
    ours = [entry for entry in packed[0]["log_history"] if "loss" in entry]
    theirs = [entry for entry in padded[0]["log_history"] if "loss" in entry]
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert a.get("reward") == b.get("reward"), a["step"]  # the same completions were sampled
        # float32: packed and padded attention sum in another order (a few units in the last place per log-prob).
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
        for key in ("kl", "entropy", "ratio/mean"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
        assert a["forward/tokens_per_distinct"] == b["forward/tokens_per_distinct"]  # logged whichever ran


# Held-out evaluation shared by tests/test_extras_heldout.py and tests/launched.py's `heldout` phase: 11
# prompts in chunks of 2 (6 chunks, 4 completions each): two processes get unequal shares.
HELDOUT_PROMPTS = [
    f"{letters}=" for letters in ("abc", "hello", "xyz", "qq", "aaa", "bcd", "zz", "kite", "ab", "q", "a")
]
HELDOUT_OPTIONS = {"heldout_num_generations": 4, "heldout_pass_at": [1, 2, 4], "heldout_batch_size": 8}


def letter_a_metric(completions, target, **kwargs) -> list[float]:
    """1 when a completion contains the row's `target` letter, else 0; `None` (unscored) for an empty completion."""
    pairs = zip(completions, target, strict=True)
    return [None if not completion else float(letter in completion) for completion, letter in pairs]


def heldout_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": HELDOUT_PROMPTS, "target": ["a"] * len(HELDOUT_PROMPTS)})


def heldout_arguments(*metrics) -> dict:
    """The trainer's held-out arguments: `metrics` on the prompts of `heldout_dataset()`."""
    return {"heldout_metrics": list(metrics), "heldout_dataset": heldout_dataset()}


def heldout_in_one_process(model_path, output_dir) -> dict:
    """What tests/launched.py's `heldout` phase evaluates, computed by one process (its sampling settings)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    trainer = make_trainer(
        output_dir,
        model_path,
        AutoTokenizer.from_pretrained(model_path),
        Dataset.from_dict({"prompt": HELDOUT_PROMPTS}),
        trainer_kwargs=heldout_arguments(letter_a_metric),
        max_completion_length=6,
        **HELDOUT_OPTIONS,
    )
    return trainer.evaluate_heldout(log=False)


def assert_heldout_is_that_of_one_process(ranks: list[dict], expected: dict) -> None:
    """Every process of a `heldout` phase, before training and on the engine's weights during it, got `expected`."""
    assert 0.0 < expected["heldout/letter_a_metric/pass@4"] < 1.0
    for rank in ranks:
        assert rank["before"] == expected
        assert {key: rank["during"][key] for key in expected} == expected
        assert rank["collectives"] == 1  # the per-prompt counts, pooled with one gather
