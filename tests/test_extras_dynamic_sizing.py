"""Dynamic sampling's extra rounds generate only what the batch lacks: the round size follows the documented rule
(the missing groups over the share kept so far, times the margin; the layouts themselves are
tests/test_extras_plan.py's), the share kept is decayed and resumable, the metrics count what was generated, and
two processes and a resumed run stay exact."""

import math
import signal

import pytest
import torch
from datasets import Dataset
from helpers import half_constant_reward, launch, make_trainer, phase_results, run_alone, tiny_grpo_args
from transformers import TrainerCallback
from trl import GRPOTrainer

from trl_grpo_ext import GRPOConfigExt
from trl_grpo_ext.extras.dynamic import KeepRate

G = 4
TEXTS = ("abc=", "hello=", "xyz=", "qq=", "kite=", "zz=", "ab=", "bcd=")


def test_the_keep_rate_weighs_recent_batches_most_and_round_trips_its_state():
    rate = KeepRate(decay=0.5)
    assert rate.estimate(0, 0) == 0.0
    assert rate.estimate(3, 4) == 0.75
    rate.update(3, 4)
    rate.update(1, 4)
    assert (rate.kept, rate.generated) == (2.5, 6.0)
    assert rate.estimate(4, 4) == pytest.approx(6.5 / 10.0)
    again = KeepRate(decay=0.5)
    again.load_state_dict(rate.state_dict())
    assert again.estimate(1, 2) == rate.estimate(1, 2)


def flat_on_one_text(prompts, completions, **kwargs) -> list[float]:
    """Constant for `qq=`; elsewhere the completion's place in its group (always a spread): flat groups are known
    from the prompts alone."""
    return [1.0 if prompt == "qq=" else float(i % G) for i, prompt in enumerate(prompts)]


def recorded_run(model_path, tokenizer, output_dir, **options):
    options = {
        "num_iterations": 1,
        "beta": 0.0,
        "max_steps": 12,
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "dynamic_sampling": True,
        "dynamic_sampling_max_rounds": 4,
        **options,
    }
    dataset = Dataset.from_dict({"prompt": list(TEXTS) * 4})
    trainer = make_trainer(output_dir, model_path, tokenizer, dataset, reward_funcs=flat_on_one_text, **options)
    calls, batches = [], []
    stock = GRPOTrainer._generate_and_score_completions

    def recorded(self, inputs):
        calls.append([row["prompt"] for row in inputs])
        return stock(self, inputs)

    original = trainer._generate_and_score_completions

    def kept(inputs):
        output = original(inputs)
        batches.append(tokenizer.batch_decode(output["prompt_ids"], skip_special_tokens=True))
        return output

    trainer._generate_and_score_completions = kept
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GRPOTrainer, "_generate_and_score_completions", recorded)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "dynamic_sampling/rounds" in entry]
    return trainer, calls, batches, logs


@pytest.mark.parametrize("margin", [1.0, 1.5])
def test_each_extra_round_generates_what_the_documented_rule_asks_and_the_metrics_count_it(
    margin, tiny_model_path, tiny_tokenizer, tmp_path
):
    trainer, calls, batches, logs = recorded_run(
        tiny_model_path, tiny_tokenizer, tmp_path, dynamic_sampling_round_margin=margin
    )
    rows = trainer.args.generation_batch_size  # 32: 8 groups
    assert len(logs) == len(batches) == 12  # one generation batch per step
    rate = KeepRate()
    position = 0
    sizes = []
    for entry, batch in zip(logs, batches, strict=True):
        rounds = int(entry["dynamic_sampling/rounds"])
        batch_calls = calls[position : position + rounds + 1]
        position += rounds + 1
        assert len(batch_calls[0]) == rows
        flags = [[call[i] != "qq=" for i in range(0, len(call), G)] for call in batch_calls]
        kept, generated = sum(flags[0]), len(flags[0])
        short = generated - kept
        for call, round_flags in zip(batch_calls[1:], flags[1:], strict=True):
            want = min(rows // G, math.ceil(margin * short / rate.estimate(kept, generated)))
            assert len(call) == G * want  # the rule, on one process: whole groups
            sizes.append(len(call))
            kept, generated = kept + sum(round_flags), generated + len(round_flags)
            short = max(0, short - sum(round_flags))
        rate.update(kept, generated)
        assert entry["dynamic_sampling/generated_groups"] == generated
        assert entry["dynamic_sampling/kept_fraction"] == pytest.approx(kept / generated)
        assert entry["dynamic_sampling/frac_reward_zero_std_generated"] == pytest.approx(1 - kept / generated)
        assert len(batch) == rows
        if short == 0:  # filled: no group without spread trains
            assert "qq=" not in batch and entry["frac_reward_zero_std"] == 0.0
    assert position == len(calls)
    assert sizes and min(sizes) < rows  # rounds smaller than a generation batch happened


def test_a_margin_of_a_whole_batch_makes_every_extra_round_a_whole_generation_batch(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    trainer, calls, _, logs = recorded_run(tiny_model_path, tiny_tokenizer, tmp_path, dynamic_sampling_round_margin=8)
    rows = trainer.args.generation_batch_size
    assert any(entry["dynamic_sampling/rounds"] > 0 for entry in logs)
    assert all(len(call) == rows for call in calls)
    for entry in logs:
        assert entry["dynamic_sampling/generated_groups"] == (entry["dynamic_sampling/rounds"] + 1) * rows / G


def test_a_margin_that_is_not_positive_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling_round_margin"):
        GRPOConfigExt(**tiny_grpo_args(tmp_path, dynamic_sampling=True, dynamic_sampling_round_margin=0.0))


@pytest.fixture(scope="module")
def two_processes(tiny_model_path, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("sizing-ddp")
    launch("cpu_ddp.yaml", output_dir, tiny_model_path, ["sizing-whole", "sizing-spanning"])
    return output_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "rows", "sizes"), [("sizing-whole", 16, {4, 8, 12, 16}), ("sizing-spanning", 6, {2, 4, 6})]
)
def test_two_processes_generate_rounds_of_equal_size_and_train_whole_groups_with_spread(
    phase, rows, sizes, two_processes
):
    ranks = phase_results(two_processes, phase)
    for rank in ranks:
        assert rank["engine"]["processes"] == 2 and rank["engine"]["distributed_type"].endswith("MULTI_CPU")
    assert ranks[0]["stock_rows"] == ranks[1]["stock_rows"]
    extra = [count for count in ranks[0]["stock_rows"] if count != rows]
    assert set(ranks[0]["stock_rows"]) <= sizes and extra  # smaller rounds, in layouts TRL can generate
    logs = [[{k: v for k, v in e.items() if k != "step_time"} for e in r["log_history"] if "loss" in e] for r in ranks]
    assert logs[0] == logs[1]
    for first, second in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True):
        assert len(first["prompts"]) == len(second["prompts"]) == rows
        prompts = first["prompts"] + second["prompts"]
        completions = first["completions"] + second["completions"]
        assert all(len(set(prompts[i : i + G])) == 1 for i in range(0, len(prompts), G))
        rewards = torch.tensor(half_constant_reward(prompts, completions)).view(-1, G)  # the phase's reward
        assert (rewards.std(dim=1) > 0).all()  # every place filled (at most 6 rounds)
        advantages = torch.cat([first["advantages"], second["advantages"]]).view(-1, G)
        expected = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-4)
        torch.testing.assert_close(advantages, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_round_sizes_and_logs_of_the_uninterrupted_run(tiny_model_path, tmp_path):
    phase = "sizing-checkpointed"

    def run(output_dir, *extra):  # tests/launched.py's run, in <output_dir>/sizing-checkpointed
        return run_alone(output_dir, tiny_model_path, [phase], *extra)

    reference = run(tmp_path / "reference", "--save_steps", "100")
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = run(tmp_path / "run", "--save_steps", "3", "--kill_during_save_of", "6")
    assert killed.returncode == -signal.SIGKILL
    resumed = run(tmp_path / "run", "--save_steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (reference_rows,) = phase_results(tmp_path / "reference", phase, num_processes=1)
    (resumed_rows,) = phase_results(tmp_path / "run", phase, num_processes=1)

    def logs(saved):
        return {entry["step"]: entry for entry in saved["log_history"] if "loss" in entry}

    expected, got = logs(reference_rows), logs(resumed_rows)
    keys = ("loss", "grad_norm", "reward", "dynamic_sampling/generated_groups", "dynamic_sampling/kept_fraction")
    later = [step for step in expected if step > 3]
    assert any(expected[step].get("dynamic_sampling/rounds", 0) > 0 for step in later)
    for step in later:
        for key in keys:
            if key in expected[step]:
                assert got[step][key] == expected[step][key], (step, key)
    assert resumed_rows["stock_rows"] == reference_rows["stock_rows"][-len(resumed_rows["stock_rows"]) :]
    assert min(reference_rows["stock_rows"]) < 16


def flat_on_two_texts(prompts, completions, **kwargs) -> list[float]:
    """`helpers.half_constant_reward` with its constant prompts among `TEXTS` (2 of 8 groups flat): a function of
    the prompt and the completion, computed again on a batch's decoded rows."""
    return half_constant_reward(prompts, completions)


def run_with_small_rounds(model_path, tokenizer, output_dir, dataset=None, reward=flat_on_two_texts, **options):
    """A run whose extra rounds are smaller than a generation batch (one generation batch of 8 groups per step): per
    call of TRL's generation, its step, completion lengths and truncation (TRL's definitions) and its groups' prompts;
    per step, the batch that trains and TRL's completions table as a log step reads it."""
    dataset = dataset if dataset is not None else Dataset.from_dict({"prompt": list(TEXTS) * 4})
    options = {
        "num_iterations": 1,
        "beta": 0.0,
        "max_steps": 6,
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "dynamic_sampling": True,
        **options,
    }
    trainer = make_trainer(output_dir, model_path, tokenizer, dataset, reward_funcs=reward, **options)
    ends = {*trainer.eos_token_ids, tokenizer.pad_token_id}
    calls, batches, tables = [], [], []
    stock = GRPOTrainer._generate_and_score_completions

    def recorded(self, inputs):
        output = stock(self, inputs)
        lengths = output["completion_mask"].sum(dim=1)
        last = output["completion_ids"].gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        truncated = [int(token) not in ends for token in last]
        prompts = [row["prompt"] for row in inputs[::G]]
        calls.append((self.state.global_step, lengths.tolist(), truncated, prompts))
        return output

    original = trainer._generate_and_score_completions

    def kept(inputs):
        output = original(inputs)
        batches.append(output)
        return output

    class TableAtLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                table = trainer._logs
                rewards = {name: list(column) for name, column in table["rewards"].items()}
                tables.append((list(table["prompt"]), list(table["completion"]), rewards, list(table["advantages"])))

    trainer._generate_and_score_completions = kept
    trainer.add_callback(TableAtLog())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GRPOTrainer, "_generate_and_score_completions", recorded)
        trainer.train()
    return trainer, calls, batches, tables


@pytest.fixture(scope="module")
def small_rounds(tiny_model_path, tiny_tokenizer, tmp_path_factory):
    return run_with_small_rounds(tiny_model_path, tiny_tokenizer, tmp_path_factory.mktemp("small-rounds"))


def test_with_rounds_smaller_than_a_batch_the_completions_table_holds_the_rows_that_train(
    small_rounds, tiny_tokenizer
):
    trainer, calls, batches, tables = small_rounds
    rows = trainer.args.generation_batch_size
    assert any(len(lengths) < rows for _, lengths, _, _ in calls)  # an extra round smaller than a generation batch
    assert len(tables) == len(batches) == 6
    for (prompts, completions, rewards, advantages), batch in zip(tables, batches, strict=True):
        assert prompts == tiny_tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
        assert completions == tiny_tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
        assert rewards == {"flat_on_two_texts": pytest.approx(flat_on_two_texts(prompts, completions))}
        assert advantages == pytest.approx(batch["advantages"].tolist())


def test_the_completions_metrics_count_every_generated_row_once_whatever_the_round_sizes(small_rounds):
    trainer, calls, _, _ = small_rounds
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 6
    assert any(entry["dynamic_sampling/rounds"] > 0 for entry in logs)
    for entry in logs:
        step_calls = [call for call in calls if call[0] == entry["step"] - 1]  # generated during that step
        lengths = [length for _, call_lengths, _, _ in step_calls for length in call_lengths]
        truncated = [flag for _, _, call_flags, _ in step_calls for flag in call_flags]
        terminated = [length for length, cut in zip(lengths, truncated, strict=True) if not cut] or [0]
        assert entry["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
        assert entry["completions/min_length"] == min(lengths)
        assert entry["completions/max_length"] == max(lengths)
        assert entry["completions/clipped_ratio"] == pytest.approx(sum(truncated) / len(truncated))
        assert entry["completions/mean_terminated_length"] == pytest.approx(sum(terminated) / len(terminated))
        assert entry["completions/min_terminated_length"] == min(terminated)
        assert entry["completions/max_terminated_length"] == max(terminated)


DISTINCT = [first + second + "=" for first in "abcd" for second in "efgh"]  # 16 distinct prompts
FLAT = set(DISTINCT[1::4])  # 4 of them, 2 in each generation batch of 8 groups


def flat_on_some(prompts, completions, **kwargs) -> list[float]:
    return [1.0 if prompt in FLAT else float(i % G) for i, prompt in enumerate(prompts)]


def test_an_extra_round_never_generates_again_a_prompt_of_its_batch_even_in_the_sampler_s_order(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    dataset = Dataset.from_dict({"prompt": DISTINCT})
    _, calls, _, _ = run_with_small_rounds(
        tiny_model_path, tiny_tokenizer, tmp_path, dataset, flat_on_some, max_steps=4, shuffle_dataset=False
    )
    steps = sorted({step for step, *_ in calls})
    assert len(calls) > len(steps)  # extra rounds happened
    for step in steps:
        generated = [prompt for call_step, *_, prompts in calls if call_step == step for prompt in prompts]
        assert len(generated) == len(set(generated)), generated
