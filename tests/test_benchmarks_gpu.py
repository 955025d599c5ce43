"""`python -m benchmarks gpu`: its CPU run, its bookkeeping of failures and time, its sync counter."""

import inspect
import json
import math
import time
import warnings

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Trainer

from benchmarks import gpu, kernel
from benchmarks.__main__ import main as bench_main
from benchmarks.gpu_kernels import section_kernels
from benchmarks.gpu_sections import TOLERANCES, _compare
from benchmarks.gpu_setup import EOS_SCALE, QUICK, QWEN25_05B_CONFIG, Context, build_model_folder
from benchmarks.gpu_summary import render
from benchmarks.syncs import SyncCounter
from trl_grpo_ext import grpo_loss
from trl_grpo_ext.diagnostics import DiagnosticsAccumulator


@pytest.mark.slow
def test_quick_run_exercises_every_section_and_writes_json_and_markdown(tmp_path, capsys):
    # In this process (the command's own start-up is `__main__`'s one line): about a minute on two cores.
    status = gpu.main(["--quick", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "gpu.json").read_text())
    sections = results["sections"]
    assert list(sections) == list(gpu.DEFAULT_SECTIONS)  # `sharded` runs only when asked for
    statuses = {name: entry["status"] for name, entry in sections.items()}
    assert set(statuses.values()) <= {"passed", "checks_failed"}, capsys.readouterr().out[-5000:]
    # The exit status says whether any check failed, and the failed checks are named.
    assert status == (1 if "checks_failed" in statuses.values() else 0)
    for entry in sections.values():
        failed = sorted(name for name, ok in entry["result"]["checks"].items() if not ok)
        assert entry.get("failed_checks", []) == failed

    environment = sections["environment"]["result"]
    assert environment["packages"]["trl"].startswith("1.16.") and environment["device"] == "cpu"
    assert environment["skipped"]["gpu"] == "no CUDA device"

    # float32 on a CPU: both modes within the tight tolerance, every step compared, the same completions sampled.
    equivalence = sections["equivalence"]["result"]
    assert equivalence["tolerance"]["loss"] == {"rtol": 1e-5, "atol": 1e-6}
    for mode in ("full", "lora"):
        comparison = equivalence["modes"][mode]
        assert comparison["within_tolerance"] and comparison["samples_diverged_at_step"] is None
        assert [step["step"] for step in comparison["steps"]] == list(range(1, 9))
        assert any(step["kl"]["ext"] > 0 for step in comparison["steps"])
    # The length normalisation is exercised: some completions end before the length limit.
    lengths = [step["completions/mean_length"]["stock"] for step in equivalence["modes"]["full"]["steps"]]
    assert any(length is not None and length < QUICK.completion_length for length in lengths)
    assert "deterministic" in equivalence["skipped"]["stock_against_itself_full"]

    syncs = sections["syncs"]["result"]
    assert "TorchDispatchMode" in syncs["runs"]["ext"]["method"]
    assert syncs["runs"]["ext"]["micro_batches"] == 6 and syncs["runs"]["ext"]["log_steps"] == 3
    # Stock TRL reads its loss metrics on the host every micro-batch; GRPOTrainerExt's trl-owned loss work does not.
    assert syncs["runs"]["trl"]["trl_per_micro_batch"]["loss"] > syncs["runs"]["ext"]["trl_per_micro_batch"]["loss"]
    assert syncs["runs"]["trl"]["trl_grpo_ext_sites"] == []
    assert "CUDA only" in syncs["skipped"]["ext_syncs_per_log_step"]

    kernels = sections["kernels"]["result"]
    assert len(kernels["agreement"]) == 4 and not kernels["compile"]["fell_back_to_eager"]
    default = kernels["agreement"][0]
    assert (default["epsilon"], default["epsilon_high"], default["agrees"]) == (0.2, None, True)
    assert all(case["clipped_token_share"] > 0.05 for case in kernels["agreement"])
    (case,) = kernels["cases"]
    assert set(case["sides"]) == set(kernel.SIDES)
    assert all(side["time_s"]["median"] > 0 for side in case["sides"].values())
    assert "CUDA only" in kernels["skipped"]["extra_peak_memory"]

    assert all(sections["nonfinite"]["result"]["checks"].values())
    assert sections["nonfinite"]["result"]["skipped_steps_logged"] == [0, 1, 1]

    e2e = sections["e2e"]["result"]
    assert set(e2e["modes"]) == {"full"} and e2e["modes"]["full"]["sides"]["ext"]["step_time_s"]["n"] == 2
    assert e2e["targets"]["full_peak_memory_ext_over_trl"]["value"] > 0

    # The padding-free forward: sdpa only on a CPU, packed exactly, fewer tokens than TRL's padded rows.
    forward = sections["forward"]["result"]
    assert list(forward["runs"]) == ["sdpa"] and forward["config"]["quick"]
    assert forward["checks"] == {"sdpa_self_check_passed": True, "sdpa_fewer_tokens": True}
    assert set(forward["targets"]) == {"sdpa_step_time_ext_over_trl", "sdpa_activation_memory_ext_over_trl"}
    assert forward["targets"]["sdpa_activation_memory_ext_over_trl"]["value"] < 1.0

    summary = (tmp_path / "gpu.md").read_text()
    for title in (
        "## Equivalence with stock TRL",
        "## Host synchronisations",
        "## Loss kernels",
        "## End to end",
        "## The log-prob forward",
    ):
        assert title in summary


def _fake_sections(calls):
    def passes(ctx, allotted, result):
        calls.append(("passes", allotted))
        result.update(checks={"fine": True})

    def raises(ctx, allotted, result):
        calls.append(("raises", allotted))
        raise RuntimeError("only on a GPU")

    def overruns(ctx, allotted, result):
        calls.append(("overruns", allotted))
        result["first_part"] = 1.5
        ctx.save()
        time.sleep(60)

    def fails_a_check(ctx, allotted, result):
        calls.append(("fails_a_check", allotted))
        result.update(checks={"fine": True, "wrong": False})

    return {
        "environment": (passes, 0.1, (0, 0)),
        "equivalence": (raises, 0.1, (0, 0)),
        "syncs": (fails_a_check, 0.1, (0, 0)),
        "kernels": (overruns, 0.1, (0, 0)),
        "nonfinite": (passes, 0.1, (1, 1)),
        "e2e": (passes, 0.1, (1, 1)),
        "forward": (passes, 0.1, (1, 1)),
    }


@pytest.mark.slow
def test_a_failing_or_overrunning_section_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gpu, "_sections", lambda: _fake_sections(calls))
    budget_s = 15.0  # room for the start-up (imports, the environment section) on a loaded machine
    results = gpu.run(str(tmp_path), budget_s=budget_s, started=time.time(), grace_s=0.5)
    sections = json.loads((tmp_path / "gpu.json").read_text())["sections"]
    assert [name for name, _ in calls] == ["passes", "raises", "fails_a_check", "overruns"]
    assert sections["environment"]["status"] == "passed"
    assert sections["equivalence"]["status"] == "error"
    assert "RuntimeError: only on a GPU" in sections["equivalence"]["traceback"]
    assert sections["syncs"]["status"] == "checks_failed" and sections["syncs"]["failed_checks"] == ["wrong"]
    assert sections["kernels"]["status"] == "error" and "SectionTimeout" in sections["kernels"]["error"]
    assert sections["kernels"]["seconds"] < budget_s + 1  # interrupted at the end of the budget, not after its 60 s
    assert sections["kernels"]["result"] == {"first_part": 1.5}  # what it finished is kept
    for name in ("nonfinite", "e2e", "forward"):
        assert sections[name]["status"] == "skipped" and "time budget" in sections[name]["reason"]
    assert results["sections"] == sections
    summary = (tmp_path / "gpu.md").read_text()
    assert "| equivalence | error" in summary and "only on a GPU" in summary


def test_unknown_sections_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown sections \['kernel'\]"):
        gpu.run(str(tmp_path), sections=("kernel",))
    with pytest.raises(SystemExit) as exit_info:  # through `python -m benchmarks gpu ...`
        bench_main(["gpu", "--sections", "environment,kernel", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown sections ['kernel']; choose from environment, equivalence" in capsys.readouterr().err


def test_the_summary_renders_partial_and_malformed_results():
    results = {
        "command": "x",
        "date": "today",
        "device": "cpu",
        "sizes": "quick",
        "budget_s": 10.0,
        "elapsed_s": 3.0,
        "sections": {
            "environment": {"status": "skipped", "reason": "time budget"},
            "kernels": {"status": "passed", "seconds": 1.0, "result": {"checks": {}, "targets": {}, "unexpected": 1}},
            "e2e": {"status": "pending"},
        },
    }
    text = render(results)
    assert "| environment | skipped |" in text and "time budget" in text
    assert "Could not render this section" in text and "KeyError" in text
    assert "## End to end" not in text


def _logs(values):
    # Steps 1, 3, 5, 7 generate (num_iterations=2) and log the rewards of what they sampled.
    return [
        {"loss": loss, "grad_norm": 1.0, "kl": 0.01, **({"reward": 0.5} if i % 2 == 0 else {})}
        for i, loss in enumerate(values)
    ]


def test_equivalence_comparison_applies_the_stated_tolerance():
    stock = _logs([0.1 * step for step in range(8)])
    rtol, atol = TOLERANCES["bf16"]["loss"]
    close = _logs([0.1 * step * (1 + rtol / 2) for step in range(8)])
    far = _logs([0.1 * step + 2 * atol + 0.1 * step * rtol for step in range(8)])
    assert _compare(stock, close, "bf16")["within_tolerance"]
    result = _compare(stock, far, "bf16")
    assert not result["within_tolerance"] and result["worst_fraction_of_tolerance"]["loss"] > 1
    assert not _compare(stock, close, "fp32")["within_tolerance"]  # float32's tolerance is far tighter
    assert not _compare(stock, close[:7], "bf16")["within_tolerance"]  # a missing step fails
    nan = _logs([0.1 * step for step in range(8)])
    nan[3]["grad_norm"] = math.nan
    assert not _compare(stock, nan, "bf16")["within_tolerance"]
    # Once the sampled completions differ (step 5's rewards), later steps are reported but not compared.
    resampled = _logs([0.1 * step for step in range(4)] + [9.0] * 4)
    resampled[4]["reward"] = 0.25
    result = _compare(stock, resampled, "bf16")
    assert result["within_tolerance"] and result["steps_compared"] == 4
    assert result["samples_diverged_at_step"] == 5 and not result["steps"][5]["loss"]["within"]
    resampled[2]["reward"] = 0.25  # step 3: only the first generation's two steps compare
    assert _compare(stock, resampled, "bf16")["steps_compared"] == 2
    resampled[0]["reward"] = 0.25  # step 1: nothing compares, nothing passes
    assert not _compare(stock, resampled, "bf16")["within_tolerance"]


def test_the_kernel_section_reports_a_fallback_from_compiled_to_eager(tmp_path, monkeypatch):
    from trl_grpo_ext.ops import fused

    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fused, "_compiled_terms", None)
    monkeypatch.setattr(fused, "_compile_failed", False)
    monkeypatch.setattr(torch, "compile", lambda function, **options: broken)
    ctx = Context(device="cpu", sizes=QUICK, workdir=str(tmp_path), log=lambda message: None, remaining=lambda: 60.0)
    result = section_kernels(ctx, 30.0, {})
    assert result["compile"]["fell_back_to_eager"] and "no compiler here" in result["compile"]["fallback_warnings"][0]
    assert result["checks"] == {
        "compiled_agrees_with_reference": True,  # the eager kernel it fell back to computes the same loss
        "compiled_did_not_fall_back": False,
        "every_timing_ran": True,
    }


def test_the_gpu_model_has_qwen25_05b_size_and_the_tokenizer_matches_its_vocabulary(tmp_path):
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B_CONFIG))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B, tied embeddings
    model_path, tokenizer_path = build_model_folder(str(tmp_path), QUICK.model, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    built = Qwen2ForCausalLM.from_pretrained(model_path)
    assert len(tokenizer) == built.config.vocab_size == QUICK.model["vocab_size"]
    assert built.config.rope_parameters["rope_theta"] == 1e6 and built.config.tie_word_embeddings
    embeddings = built.get_input_embeddings().weight
    others = embeddings[[i for i in range(len(tokenizer)) if i != tokenizer.eos_token_id]]
    assert embeddings[tokenizer.eos_token_id].norm() > EOS_SCALE / 2 * others.norm(dim=-1).mean()
    assert tokenizer.decode(tokenizer("abc=").input_ids) == "abc="


class _FakeTrainer(Trainer):
    def __init__(self):  # no model: only the stack frames of its methods matter here
        pass

    def log(self, value):
        return value.item()


def test_sync_counter_attributes_each_event_to_its_code_and_trainer_phase():
    inputs = kernel.make_inputs(4, 16, torch.float32, "cpu")
    values = torch.arange(3.0)
    with SyncCounter("cpu") as counter:
        for implementation in ("fused", "reference"):
            leaf = inputs["logps"].clone().requires_grad_(True)
            out = grpo_loss(
                leaf, inputs["old"], inputs["ref"], inputs["advantages"], inputs["mask"], implementation=implementation
            )
            out.loss.backward()
        assert counter.total() == 0  # the loss reads nothing on the host
        values.sum().item()
        _FakeTrainer().log(values.max())
        torch.tensor([1.0, 2.0])
        values[values > 1]
        DiagnosticsAccumulator().summarize(None)
    assert counter.counts[("other", "other")] == 3  # .item(), torch.tensor(data), boolean indexing
    assert counter.counts[("other", "log")] == 1
    assert counter.total("trl_grpo_ext") == 0
    report = counter.as_dict()
    assert {row["site"].split(":")[0] for row in report["top_sites"]} == {"test_benchmarks_gpu.py"}
    # Outside the context nothing is counted.
    values.sum().item()
    assert counter.total() == 4


class _WarningTrainer(_FakeTrainer):
    def _compute_loss(self, model, inputs):
        # What torch does, through the CUDA sync debug mode, for each synchronising call.
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


_WARNING_LINE = inspect.getsourcelines(_WarningTrainer._compute_loss)[1] + 2


def test_sync_counter_counts_cuda_sync_warnings_by_phase_and_lets_other_warnings_through(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)  # no GPU here: only the warning path
    with warnings.catch_warnings(record=True) as shown:
        before = warnings.showwarning
        with SyncCounter("cuda") as counter:
            for _ in range(3):  # the same line each time: counted each time, not once per location
                _WarningTrainer()._compute_loss(None, None)
            warnings.warn("something else", UserWarning, stacklevel=1)
        assert warnings.showwarning is before  # restored on leaving
    assert counter.counts == {("other", "loss"): 3}
    assert counter.sites[("other", "loss", f"test_benchmarks_gpu.py:{_WARNING_LINE} _compute_loss")] == 3
    assert [str(w.message) for w in shown] == ["something else"]
    assert modes == ["warn", 0]


@pytest.mark.parametrize("step", ["add_loss_step", "add_rewards"])
def test_diagnostics_accumulation_needs_no_host_sync(step):
    inputs = kernel.make_inputs(8, 16, torch.float32, "cpu")
    out = grpo_loss(inputs["logps"], inputs["old"], inputs["ref"], inputs["advantages"], inputs["mask"])
    accumulator = DiagnosticsAccumulator()
    with SyncCounter("cpu") as counter:
        if step == "add_loss_step":
            accumulator.add_loss_step(out, torch.rand(8, 16))
        else:
            accumulator.add_rewards(torch.rand(8), 4)
    assert counter.as_dict()["trl_grpo_ext_sites"] == []


def test_sync_counter_refuses_an_unknown_device():
    with pytest.raises(ValueError, match="`device` must be 'cuda' or 'cpu', got 'mps'"):
        SyncCounter("mps")
