"""vLLM's importance-sampling correction under truncated sampling, on a real engine: `python -m benchmarks truncation`.

Each side trains the demo model (`trl_grpo_ext/tools/recipes/tiny/base_model`, full fine-tuning, the demo's learning
rate and temperature) for a few steps per sampling setting, generating with vLLM in colocate mode with
`vllm_importance_sampling_correction` on. Run it from the vLLM environment (`make test-vllm` builds `.venv-vllm`):

    .venv-vllm/bin/python -m benchmarks truncation [--truncation-settings "top_p=1.0;top_p=0.8;top_k=3"]
        [--truncation-sides trl,ext] [--truncation-steps 8] [--truncation-mode sequence_mask]

On a machine without GPUs it calls the tests' `enable_vllm_on_cpu()` (`tests/cpu_engines.py`); all runs share one
engine (`reuse_vllm_engine`: a colocated engine is built once per process), with the sampling settings per request.

vLLM reports log-probs of the distribution it sampled from, after truncation and renormalisation
(`logprobs_mode="processed_logprobs"`). Stock TRL compares them with the trainer's whole-vocabulary log-probs: with
`top_p < 1` or `top_k > 0` every ratio `exp(trainer_logp - sampler_logp)` then carries the kept probability mass (TRL
issue #6789). `GRPOConfigExt`'s `match_sampler_truncation` (on by default) gives the correction the trainer's
log-probs of the same truncated distribution. Reported per side and setting, over the steps (median, with min and
max):

- `sampling/importance_sampling_ratio/mean`, as the trainer logs it (after the mode's truncation or masking; per
  sequence in the `sequence_*` modes);
- from each generated batch, the ratio entering the correction per completion token, before truncation or masking:
  `exp(trainer_logp - sampling_per_token_logps)` with the trainer log-probs the correction used (stock TRL:
  `old_per_token_logps`; this package: the truncated ones it computed): its mean and the share of tokens outside
  [0.9, 1.1] (over all steps' tokens, and per step), and that share over the same side's without truncation (the
  first setting without a cut).

The CPU engine runs in bfloat16 against a float32 trainer: the untruncated setting's share is that mismatch alone.

Sides (`SIDES`): stock `trl.GRPOTrainer` with `trl.GRPOConfig`, and `GRPOTrainerExt` with `GRPOConfigExt`; a side's
extra options go in `OPTIONS`.

`python -m benchmarks truncation-cost [--quick] [--repeats N]` (no vLLM; `run_cost`): what the match costs at Qwen's
151,936-token vocabulary against the forward TRL runs for `old_per_token_logps`. The forward: TRL 1.16's padded
log-prob forward with its fused LM head (as `_get_per_token_logps_and_entropies` runs it, one micro-batch) on a
Qwen2-architecture model with random weights (`COST_MODEL`: Qwen2.5-1.5B's vocabulary, 28 layers and MLP width, its
hidden size scaled from 1,536 to 256, so that the LM head keeps its share of the forward's matmul FLOPs, 16% against
15%), on one group of 8 completions of log-normal length (`cost_batch`). The match's projection, on the hidden
states and LM head of that shape, top_p = 0.95, temperature 1:

- `before`: every padded completion position, the whole vocabulary sorted at each, 27 positions per chunk (4M
  logits: the match up to the top-k bounds; `top_p_bounds=()`, whose result is the same);
- `after`: the scored completion tokens only, the top-k bounds, 110 positions per chunk (the defaults).

The distribution decides how many positions a bound covers, so the projection runs on two made-up ones (`SCENARIOS`):
`lm-like`, at each position a Zipf law of exponent drawn from [1.3, 3.5] over a random order of the vocabulary, times
log-normal noise (mean entropy about 1.5 nats: compare a run's logged `entropy`), and `flat`, the noise alone (the
nucleus holds most of the vocabulary everywhere: every position goes to the full sort; the worst case). Reported:
seconds (median of the interleaved repeats, min-max), the positions projected and those sorted in full, the match's
cost over the forward's (an extra forward plus the projection, as the match runs today; the projection alone, what
it adds inside TRL's forward), and the projection's extra resident memory (a fresh process per side, as
`kernel.extra_peak_bytes` measures it).
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

from .common import CHECKOUT, child_env, cpu_engines, format_table, summarize

DEMO_MODEL = os.path.join(CHECKOUT, "trl_grpo_ext", "tools", "recipes", "tiny", "base_model")
DEMO_TRAIN = os.path.join(CHECKOUT, "trl_grpo_ext", "tools", "recipes", "tiny", "data", "train.jsonl")
SIDES = {
    "trl": "stock trl.GRPOTrainer, trl.GRPOConfig",
    "ext": "GRPOTrainerExt, GRPOConfigExt",
}
OPTIONS: dict[str, dict] = {"trl": {}, "ext": {}}
DEFAULT_SETTINGS = "top_p=1.0;top_p=0.8;top_k=3"
BAND = (0.9, 1.1)


def parse_settings(text: str) -> list[dict]:
    """`"top_p=0.8;top_k=3,top_p=0.9"` -> `[{"top_p": 0.8}, {"top_k": 3, "top_p": 0.9}]` (`;` between settings)."""
    settings = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        setting = {}
        for pair in item.split(","):
            name, value = (part.strip() for part in pair.split("="))
            if name not in ("top_p", "top_k", "min_p"):
                raise ValueError(f"unknown sampling setting {name!r} (top_p, top_k or min_p)")
            setting[name] = int(value) if name == "top_k" else float(value)
        settings.append(setting)
    return settings


def _label(setting: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in setting.items())


def _reward(completions, solution, **kwargs) -> list[float]:
    return [float(completion == answer) for completion, answer in zip(completions, solution, strict=True)]


def train(side: str, setting: dict, steps: int, mode: str, output_dir: str) -> dict:
    """One side at one sampling setting: the logged ratio mean and the raw token ratios, per step."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    trainer_class, config_class = {"trl": (GRPOTrainer, GRPOConfig), "ext": (GRPOTrainerExt, GRPOConfigExt)}[side]
    on_cpu = not torch.cuda.is_available()

    class Measured(trainer_class):
        def _generate_and_score_completions(self, inputs):
            self.used_logps = None
            output = super()._generate_and_score_completions(inputs)
            mask = output["completion_mask"].bool()
            trainer_logps = output["old_per_token_logps"] if self.used_logps is None else self.used_logps
            log_ratio = trainer_logps - output["sampling_per_token_logps"]
            ratio = log_ratio[mask].double().exp()
            self.token_ratios.append(
                {
                    "mean": ratio.mean().item(),
                    "outside": ((ratio < BAND[0]) | (ratio > BAND[1])).double().mean().item(),
                    "tokens": ratio.numel(),
                    "outside_tokens": int(((ratio < BAND[0]) | (ratio > BAND[1])).sum()),
                }
            )
            return output

    args = config_class(
        output_dir=output_dir,
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=10,
        temperature=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        use_cpu=on_cpu,
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        **setting,
        **OPTIONS[side],
    )
    trainer = Measured(
        model=DEMO_MODEL,
        reward_funcs=_reward,
        args=args,
        train_dataset=load_dataset("json", data_files=DEMO_TRAIN, split="train"),
        processing_class=AutoTokenizer.from_pretrained(DEMO_MODEL),
    )
    trainer.token_ratios = []
    match = getattr(getattr(trainer, "_vllm_batches", None), "match", None)  # stock TRL's trainer has neither
    if match is not None:  # keep the truncated log-probs the correction was computed from
        apply = match.apply

        def kept(*args, **kwargs):
            trainer.used_logps = apply(*args, **kwargs)
            return trainer.used_logps

        match.apply = kept
    trainer.train()
    logged = [
        entry["sampling/importance_sampling_ratio/mean"]
        for entry in trainer.state.log_history
        if "sampling/importance_sampling_ratio/mean" in entry
    ]
    return {
        "side": side,
        "setting": setting,
        "logged_mean": logged,
        "token_mean": [step["mean"] for step in trainer.token_ratios],
        "token_outside": [step["outside"] for step in trainer.token_ratios],
        "tokens": sum(step["tokens"] for step in trainer.token_ratios),
        "outside_tokens": sum(step["outside_tokens"] for step in trainer.token_ratios),
    }


def run(settings: list[dict], sides: tuple[str, ...], steps: int, mode: str) -> dict:
    import torch

    shims = cpu_engines()
    if not torch.cuda.is_available():
        shims.enable_vllm_on_cpu()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    runs = []
    with shims.reuse_vllm_engine(), tempfile.TemporaryDirectory() as folder:
        for setting in settings:
            for side in sides:
                runs.append(train(side, setting, steps, mode, os.path.join(folder, f"{side}-{len(runs)}")))
    return {"mode": mode, "steps": steps, "band": list(BAND), "sides": {s: SIDES[s] for s in sides}, "runs": runs}


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _untruncated(setting: dict) -> bool:
    return not (setting.get("top_k", 0) > 0 or setting.get("top_p", 1.0) < 1.0 or setting.get("min_p", 0.0) > 0.0)


def pooled_outside(run: dict) -> float:
    """The share of tokens outside the band over all of a run's steps."""
    return run["outside_tokens"] / run["tokens"] if run["tokens"] else math.nan


def outside_over_untruncated(results: dict, run: dict) -> float | None:
    """The pooled share of tokens outside the band of `run`, over that of its side's first untruncated setting."""
    for other in results["runs"]:
        if other["side"] == run["side"] and _untruncated(other["setting"]):
            baseline = pooled_outside(other)
            return pooled_outside(run) / baseline if baseline else math.inf
    return None


def table(results: dict) -> str:
    low, high = results["band"]
    headers = [
        "side",
        "sampling",
        f"sampling/importance_sampling_ratio/mean ({results['mode']})",
        "token ratio mean",
        f"tokens outside [{low}, {high}]: all steps (per step)",
        "outside / untruncated",
    ]
    rows = []
    for run in results["runs"]:
        ratio = outside_over_untruncated(results, run)
        rows.append(
            [
                run["side"],
                _label(run["setting"]),
                _spread(run["logged_mean"]),
                _spread(run["token_mean"]),
                f"{pooled_outside(run):.4f} = {run['outside_tokens']}/{run['tokens']} "
                f"({_spread(run['token_outside'])})",
                "-" if ratio is None else f"{ratio:.2f}",
            ]
        )
    return format_table(headers, rows)


# The match's cost at Qwen's vocabulary: `python -m benchmarks truncation-cost`.

#: Qwen2.5-1.5B's vocabulary, layers and MLP width with its hidden size scaled from 1,536 to 256 (2 heads of 128, one
#: key/value head): the LM head is 16% of the forward's matmul FLOPs per token (Qwen2.5-1.5B: 15%).
COST_MODEL = {
    "vocab_size": 151_936,
    "hidden_size": 256,
    "intermediate_size": 8_960,
    "num_hidden_layers": 28,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
}
QUICK_COST_MODEL = COST_MODEL | {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
COST_TOP_P = 0.95
#: The chunk of the match before the top-k bounds: 4M logits (27 positions at Qwen's vocabulary).
BEFORE_CHUNK_ELEMENTS = 1 << 22
#: Per position, the Zipf exponent's range (`None`: no Zipf law, the noise alone) and the log-normal noise's sigma.
SCENARIOS = {"lm-like": ((1.3, 3.5), 0.5), "flat": (None, 1.0)}
COST_SIDES = ("before", "after")


def cost_batch(rows: int, prompt: int, width: int, vocab: int, seed: int = 0):
    """`(input_ids, attention_mask, completion_mask)` of one group: `rows` completions of log-normal length (median
    a third of `width`, some cut at `width`) after a prompt of `prompt` tokens, right-padded as TRL pads them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(width / 3) + 0.8 * torch.randn(rows, generator=generator))
    lengths = lengths.round().clamp(1, width).long()
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(3, vocab, (rows, prompt + width), generator=generator)
    attention_mask = torch.cat([torch.ones(rows, prompt, dtype=torch.long), completion_mask], dim=1)
    return ids, attention_mask, completion_mask


def projection_inputs(scenario: str, count: int, hidden_size: int, vocab: int, seed: int = 0):
    """`(hidden, weight)` `(count, H)`, `(V, H)`: through `weight`, position `i` has the logits
    `-alpha_i * log(rank) + sigma * noise` (`SCENARIOS`), the ranks a random order of the vocabulary."""
    import torch

    alphas, sigma = SCENARIOS[scenario]
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=generator) * (sigma / math.sqrt(hidden_size - 1))
    weight[:, 0] = -(torch.randperm(vocab, generator=generator).float() + 1).log()
    hidden = torch.randn(count, hidden_size, generator=generator)
    hidden[:, 0] = torch.empty(count).uniform_(*alphas, generator=generator) if alphas else 0.0
    return hidden, weight


def project(side: str, hidden, weight, targets):
    """The match's projection of `hidden` `(M, H)` as `side` runs it (module docstring)."""
    from trl_grpo_ext.extras.vllm.sampler_cuts import SamplerCuts, truncated_log_probs_from_hidden

    cuts = SamplerCuts(top_p=COST_TOP_P)
    if side == "before":
        chunk = BEFORE_CHUNK_ELEMENTS // weight.shape[0]
        return truncated_log_probs_from_hidden(hidden, weight, None, targets, cuts, chunk_size=chunk, top_p_bounds=())
    return truncated_log_probs_from_hidden(hidden, weight, None, targets, cuts)


@contextmanager
def rows_through(*names: str):
    """Count the rows `torch.<name>` receives, per name (the top-k bounds' `topk` and the full `sort`)."""
    import torch

    counts = {name: [] for name in names}
    originals = {name: getattr(torch, name) for name in names}

    def counted(name):
        def call(input, *args, **kwargs):
            counts[name].append(input.shape[0])
            return originals[name](input, *args, **kwargs)

        return call

    for name in names:
        setattr(torch, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def mean_entropy(hidden, weight, chunk: int = 64) -> float:
    """The mean entropy (nats) of `softmax(hidden @ weight.T)` over the positions."""
    import torch

    total = 0.0
    for start in range(0, hidden.shape[0], chunk):
        logp = torch.log_softmax(hidden[start : start + chunk] @ weight.T, dim=-1)
        total += float(-(logp.exp() * logp).sum())
    return total / max(1, hidden.shape[0])


def trl_forward(model, input_ids, attention_mask, logits_to_keep: int):
    """TRL 1.16's `_get_per_token_logps_and_entropies` for one micro-batch, without gradient: the fused LM head
    (`add_fused_lm_head`) scoring the completion tokens."""
    import torch

    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).log_probs


def projection_peak_bytes(side: str, scenario: str, count: int, hidden_size: int, vocab: int) -> int:
    """The projection's extra resident memory, in a fresh process whose allocator maps every block of 64 KiB or more
    from the system and returns it on free (`kernel.extra_peak_bytes`)."""
    env = child_env(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "benchmarks.truncation", "--memory", side, scenario]
    command += [str(count), str(hidden_size), str(vocab)]
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"memory measurement of {side} failed:\n{completed.stderr[-2000:]}")
    return int(completed.stdout.strip().splitlines()[-1])


def _measure_memory_here(side: str, scenario: str, count: int, hidden_size: int, vocab: int) -> int:
    import torch

    from .kernel import _rss_bytes

    torch.set_num_threads(1)
    hidden, weight = projection_inputs(scenario, count, hidden_size, vocab)
    targets = torch.randint(0, vocab, (count,))
    project(side, hidden, weight, targets)  # warm-up: lazy initialisations
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current resident set
    before = _rss_bytes("VmHWM")
    project(side, hidden, weight, targets)
    return max(0, _rss_bytes("VmHWM") - before)


def run_cost(repeats: int = 3, quick: bool = False) -> dict:
    """The forward and both sides' projections in each scenario, interleaved `repeats` times (module docstring)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_grpo_ext.extras.vllm.sampler_cuts import CHUNK_ELEMENTS, TOP_P_BOUNDS

    config = QUICK_COST_MODEL if quick else COST_MODEL
    rows, prompt, width = (4, 8, 16) if quick else (8, 32, 128)
    vocab, hidden_size = config["vocab_size"], config["hidden_size"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
    add_fused_lm_head(model, temperature=1.0)
    ids, attention_mask, completion_mask = cost_batch(rows, prompt, width, vocab)
    scored = completion_mask.bool()
    targets = ids[:, -width:]
    positions = {"before": scored.numel(), "after": int(scored.sum())}
    inputs, scenarios = {}, {}
    chunk_positions = {"before": BEFORE_CHUNK_ELEMENTS // vocab, "after": CHUNK_ELEMENTS // vocab}
    for scenario in SCENARIOS:
        hidden, weight = projection_inputs(scenario, scored.numel(), hidden_size, vocab)
        hidden = hidden.view(rows, width, hidden_size)
        inputs[scenario] = {
            "before": (hidden.reshape(-1, hidden_size), weight, targets.reshape(-1)),
            "after": (hidden[scored], weight, targets[scored]),
        }
        sides = {}
        for side in COST_SIDES:
            # A chunk's buffers are freed before the next: two chunks' positions show the peak.
            count = min(positions[side], 2 * chunk_positions[side])
            peak = projection_peak_bytes(side, scenario, count, hidden_size, vocab)
            sides[side] = {"positions": positions[side], "time_s": [], "extra_peak_bytes": peak}
        scenarios[scenario] = {"mean_entropy": mean_entropy(hidden[scored], weight), "sides": sides}
    trl_forward(model, ids, attention_mask, width)  # warm-up
    forward = []
    for repeat in range(repeats):
        begin = time.perf_counter()
        trl_forward(model, ids, attention_mask, width)
        forward.append(time.perf_counter() - begin)
        for scenario, entry in scenarios.items():
            for side, stats in entry["sides"].items():
                with rows_through("topk", "sort") as counts:  # a Python call per chunk: no measurable time
                    begin = time.perf_counter()
                    project(side, *inputs[scenario][side])
                    stats["time_s"].append(time.perf_counter() - begin)
                if repeat == 0:
                    stats["bounded_rows"], stats["sorted_rows"] = counts["topk"], sum(counts["sort"])
    for sides in scenarios.values():
        for stats in sides["sides"].values():
            stats["time_s"] = summarize(stats["time_s"])
    head = hidden_size * vocab
    layer = 4 * hidden_size * hidden_size + 3 * hidden_size * config["intermediate_size"]
    return {
        "model": config,
        "lm_head_flop_share": head / (head + config["num_hidden_layers"] * layer),
        "batch": {"rows": rows, "prompt": prompt, "width": width, "completion_tokens": positions["after"]},
        "top_p": COST_TOP_P,
        "top_p_bounds": list(TOP_P_BOUNDS),
        "chunk_positions": chunk_positions,
        "repeats": repeats,
        "forward_s": summarize(forward),
        "scenarios": scenarios,
    }


def cost_table(results: dict) -> str:
    """One row per scenario and side: the work, the seconds and the cost over the forward's."""
    forward = results["forward_s"]["median"]
    headers = [
        "distribution",
        "side",
        "positions projected",
        "sorted in full",
        "projection s",
        "match / forward (extra forward + projection)",
        "projection / forward",
        "extra peak MiB",
    ]
    rows = []
    for scenario, entry in results["scenarios"].items():
        for side, stats in entry["sides"].items():
            seconds = stats["time_s"]["median"]
            rows.append(
                [
                    f"{scenario} ({entry['mean_entropy']:.2f} nats)",
                    side,
                    stats["positions"],
                    stats["sorted_rows"],
                    f"{seconds:.2f} ({stats['time_s']['min']:.2f}-{stats['time_s']['max']:.2f})",
                    f"{(forward + seconds) / forward:.2f}",
                    f"{seconds / forward:.2f}",
                    f"{stats['extra_peak_bytes'] / 2**20:.0f}",
                ]
            )
    return format_table(headers, rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory"]:
        side, scenario, count, hidden_size, vocab = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
        print(_measure_memory_here(side, scenario, count, hidden_size, vocab))
