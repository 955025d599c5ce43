"""`python -m benchmarks gpu`: its CPU run, its bookkeeping of failures and time, its sync counter."""

import inspect
import json
import math
import re
import time
import warnings

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Trainer

from benchmarks import emulation, gpu, kernel
from benchmarks.__main__ import main as bench_main
from benchmarks.gpu_attention import classify_kernels, longer_rows_may_pay
from benchmarks.gpu_kernels import section_kernels
from benchmarks.gpu_packing import section_engagement, section_exactness
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
    assert list(sections) == list(gpu.DEFAULT_SECTIONS)  # the others run only when asked for
    statuses = {name: entry["status"] for name, entry in sections.items()}
    assert set(statuses.values()) == {"passed"}, capsys.readouterr().out[-5000:]
    assert status == 0

    environment = sections["environment"]["result"]
    assert environment["packages"]["trl"].startswith("1.16.") and environment["device"] == "cpu"
    assert environment["skipped"]["gpu"] == "no CUDA device"
    assert environment["flash_attention_2"]["kernels"] == "emulated"

    # 1. The README's setup (float32 weights, bf16 autocast: CPU autocast here) and bf16 weights: every forward of
    # the training step packed, the self-check at bf16.
    engagement = sections["engagement"]["result"]
    assert [engagement["setups"][name]["weights"] for name in ("default", "bf16_weights")] == ["float32", "bfloat16"]
    for setup in engagement["setups"].values():
        assert setup["forwards"] >= 1 and setup["packed_forwards"] == setup["forwards"] and not setup["fell_back"]
        check = setup["self_check"]
        assert check["passed"] and check["shared_passed"] and check["dtype"] == "bfloat16"
        assert check["difference"] <= check["tolerance"] and any(
            "match the padded ones" in m for m in setup["messages"]
        )

    # 2. Several packed rows, sdpa and the flash path's stand-ins, bf16 autocast and float32, shared and not.
    exactness = sections["exactness"]["result"]
    runs = {(run["attention"], run["precision"]): run for run in exactness["runs"]}
    assert set(runs) == {(a, p) for a in ("sdpa", "flash_attention_2") for p in ("bf16 autocast", "float32")}
    for (attention, precision), run in runs.items():
        for side in ("packed", "shared"):
            entry = run["sides"][side]
            assert entry["packed_rows"] >= 2 and entry["within_tolerance"], (attention, precision, side)
            assert entry["p99.9"] <= entry["max"] <= run["tolerance"]
        assert run["sides"]["shared"]["shares_prompts"]
        if precision == "float32":
            assert run["sides"]["packed"]["max"] < 1e-5 and run["floor"]["max"] < 1e-5
    assert "exact stand-ins" in runs[("flash_attention_2", "float32")]["kernels"]

    # 3. An attention kernel named for every side; throughput at both lengths; the dense rows' decision.
    attention = sections["attention"]["result"]
    assert len(attention["kernels"]) == 6 and all(entry["classes"] for entry in attention["kernels"].values())
    assert [case["length"] for case in attention["throughput"]] == [64, 128]
    decision = attention["decision"]
    assert 0 < decision["dense_layout_tail_share"] < 1 and decision["attention_share_measured"] > 0
    assert decision["verdict"] in (
        "dense rows stay at the padded width",
        "a dense row longer than the padded width may pay",
    )

    # 4. Bytes saved for the backward (deterministic on a CPU): checkpointing saves less, shared prompts less than
    # TRL's padded rows.
    memory = sections["memory"]["result"]
    assert len(memory["runs"]) == 6
    saved = {label: {key: run["saved_bytes"] for key, run in runs.items()} for label, runs in memory["runs"].items()}
    for label, runs in saved.items():
        assert runs["checkpointing_on"] < runs["checkpointing_off"], label
    assert saved["shared/sdpa"]["checkpointing_off"] < saved["trl/sdpa"]["checkpointing_off"]
    assert memory["self_check"]["passed"]

    # 5. Every side timed; what each forwards: TRL's padded rows, one varlen row of exactly the real tokens.
    speed = sections["speed"]["result"]
    assert len(speed["sides"]) == 6 and speed["sides"]["trl/sdpa"]["time_over_trl_sdpa"] == 1.0
    tokens = {label: entry["tokens_forwarded"] for label, entry in speed["sides"].items()}
    assert tokens["trl/sdpa"] == tokens["trl/flash_attention_2"] == speed["batch"]["rows"] * speed["batch"]["width"]
    assert tokens["packed/flash_attention_2"] == speed["batch"]["real_tokens"]
    assert tokens["shared/sdpa"] < tokens["packed/sdpa"] < tokens["trl/sdpa"]

    # 6. One host synchronisation per packed chunk (the rows' spans), none for TRL's forward.
    host = sections["host"]["result"]
    for label, entry in host["sides"].items():
        assert entry["package_syncs_per_chunk"] == (0 if label.startswith("trl/") else 1), label
        assert entry["host_s"] > 0
    assert all(target["met"] for target in host["targets"].values())

    # 7. The truncation match timed through the package's public functions.
    truncation = sections["truncation"]["result"]
    assert "error" not in truncation and truncation["positions"] == 8 * truncation["batch"]["completion_width"]
    assert truncation["vocab"] == QUICK.check_model["vocab_size"]

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

    assert all(sections["nonfinite"]["result"]["checks"].values())
    assert sections["nonfinite"]["result"]["skipped_steps_logged"] == [0, 1, 1]

    summary = (tmp_path / "gpu.md").read_text()
    for title in (
        "## 1. Does packing engage?",
        "## 2. |packed - padded| log-prob",
        "## 3. Attention kernels",
        "## 4. Peak memory",
        "## 5. Forward + backward time",
        "## 6. Host time before each forward",
        "## 7. The truncation match's cost",
        "## Equivalence with stock TRL",
        "## Non-finite guard",
    ):
        assert title in summary


@pytest.mark.slow
def test_quick_run_of_sections_run_only_when_asked_for(tmp_path, capsys):
    # Two of them (`kernels` compiles for a minute, `e2e` starts two processes: their own tests cover them).
    status = gpu.main(["--quick", "--out", str(tmp_path), "--sections", "forward,syncs"])
    sections = json.loads((tmp_path / "gpu.json").read_text())["sections"]
    assert list(sections) == ["syncs", "forward"]  # in running order
    # On a CPU the sync count's check sees the host reads a GPU would synchronise on (the packed forward's one per
    # chunk among them): it may fail there, and the exit status says so.
    assert sections["syncs"]["status"] in ("passed", "checks_failed"), capsys.readouterr().out[-5000:]
    assert sections["forward"]["status"] == "passed"
    assert status == (1 if sections["syncs"]["status"] == "checks_failed" else 0)

    syncs = sections["syncs"]["result"]
    assert "TorchDispatchMode" in syncs["runs"]["ext"]["method"]
    assert syncs["runs"]["ext"]["micro_batches"] == 6 and syncs["runs"]["ext"]["log_steps"] == 3
    # Stock TRL reads its loss metrics on the host every micro-batch; GRPOTrainerExt's trl-owned loss work does not.
    assert syncs["runs"]["trl"]["trl_per_micro_batch"]["loss"] > syncs["runs"]["ext"]["trl_per_micro_batch"]["loss"]
    assert syncs["runs"]["trl"]["trl_grpo_ext_sites"] == []

    forward = sections["forward"]["result"]
    assert list(forward["runs"]) == ["sdpa"] and forward["checks"]["sdpa_self_check_passed"]
    summary = (tmp_path / "gpu.md").read_text()
    assert "## Host synchronisations" in summary and "## The log-prob forward on a small model" in summary


def _fake_sections(calls, order):
    def passes(ctx, allotted, result):
        calls.append(("passes", allotted))
        result.update(checks={"fine": True})

    def raises(ctx, allotted, result):
        calls.append(("raises", allotted))
        raise RuntimeError("only on a GPU")

    def fails_a_check(ctx, allotted, result):
        calls.append(("fails_a_check", allotted))
        result.update(checks={"fine": True, "wrong": False})

    def overruns(ctx, allotted, result):
        calls.append(("overruns", allotted))
        result.update(first_part=1.5, checks={"fine": True})
        ctx.save()
        time.sleep(60)

    def fails_a_check_then_overruns(ctx, allotted, result):
        calls.append(("fails_a_check_then_overruns", allotted))
        result.update(checks={"wrong": False})
        time.sleep(60)

    functions = {f.__name__: f for f in (passes, raises, fails_a_check, overruns, fails_a_check_then_overruns)}
    registry = {
        name: (functions[kind], 0.1, (0, 0) if index < 2 else (1, 1)) for index, (name, kind) in enumerate(order)
    }
    return {name: registry.get(name, (passes, 0.1, (1, 1))) for name in gpu.SECTION_NAMES}


@pytest.mark.slow
def test_a_failing_or_overrunning_section_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    calls = []
    order = [
        ("environment", "passes"),
        ("engagement", "raises"),
        ("exactness", "fails_a_check"),
        ("attention", "fails_a_check_then_overruns"),
    ]
    monkeypatch.setattr(gpu, "_sections", lambda: _fake_sections(calls, order))
    budget_s = 15.0  # room for the start-up (imports, the environment section) on a loaded machine
    results = gpu.run(str(tmp_path), budget_s=budget_s, started=time.time(), grace_s=0.5)
    sections = json.loads((tmp_path / "gpu.json").read_text())["sections"]
    assert [kind for kind, _ in calls] == [kind for _, kind in order]
    assert sections["environment"]["status"] == "passed"
    assert sections["engagement"]["status"] == "error"
    assert "RuntimeError: only on a GPU" in sections["engagement"]["traceback"]
    assert sections["exactness"]["status"] == "checks_failed" and sections["exactness"]["failed_checks"] == ["wrong"]
    # A check that failed before the time ran out is still a wrong result.
    attention = sections["attention"]
    assert attention["status"] == "checks_failed" and "time budget ran out" in attention["reason"]
    assert attention["seconds"] < budget_s + 1  # interrupted at the end of the budget, not after its 60 s
    for name in gpu.DEFAULT_SECTIONS[4:]:
        assert sections[name]["status"] == "skipped" and "time budget" in sections[name]["reason"]
    assert results["sections"] == sections and gpu.exit_status(results) == 1
    summary = (tmp_path / "gpu.md").read_text()
    assert re.search(r"\| engagement +\| error", summary) and "only on a GPU" in summary


@pytest.mark.slow
def test_a_section_interrupted_for_time_keeps_its_results_and_does_not_fail_the_run(tmp_path, monkeypatch):
    calls = []
    order = [("environment", "passes"), ("engagement", "overruns")]
    monkeypatch.setattr(gpu, "_sections", lambda: _fake_sections(calls, order))
    results = gpu.run(str(tmp_path), budget_s=4.0, started=time.time(), grace_s=0.5)
    engagement = results["sections"]["engagement"]
    assert engagement["status"] == "interrupted" and "time budget ran out" in engagement["reason"]
    assert engagement["result"] == {"first_part": 1.5, "checks": {"fine": True}}  # what it finished is kept
    assert {results["sections"][name]["status"] for name in gpu.DEFAULT_SECTIONS[2:]} == {"skipped"}
    assert gpu.exit_status(results) == 0


def test_unknown_sections_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown sections \['kernel'\]"):
        gpu.run(str(tmp_path), sections=("kernel",))
    with pytest.raises(SystemExit) as exit_info:  # through `python -m benchmarks gpu ...`
        bench_main(["gpu", "--sections", "environment,kernel", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown sections ['kernel']; choose from environment, engagement, exactness" in capsys.readouterr().err


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


@pytest.mark.parametrize(
    ("names", "classes"),
    [
        (["pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "ampere_bf16_gemm"], ["flash"]),
        (["fmha_cutlassF_bf16_aligned_64x128_rf_sm80(AttentionKernel)", "softmax_warp_forward"], ["memory-efficient"]),
        (["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"], ["cudnn"]),
        (["aten::_scaled_dot_product_attention_math", "aten::_softmax"], ["math"]),
        (["sm90_xmma_gemm_bf16bf16", "cunn_SoftMaxForward<4, float>"], ["math"]),
        (["sm90_xmma_gemm_bf16bf16", "elementwise_kernel"], []),
    ],
)
def test_attention_kernels_are_classed_by_name(names, classes):
    assert classify_kernels(names) == classes


def test_dense_rows_longer_than_the_padded_width_pay_only_when_attention_costs_less_than_the_tails_save():
    assert not longer_rows_may_pay(attention_share=0.5, tail_share=0.1)  # 1.9 x 1 > 1.5: longer rows cost more
    assert longer_rows_may_pay(attention_share=0.05, tail_share=0.1)
    assert longer_rows_may_pay(attention_share=10.0, tail_share=0.5)  # half the tokens are tails: always


@pytest.mark.parametrize("signature", ["window", "causal_flag"])
def test_torch_flash_kernels_take_each_torch_releases_keywords_and_match_the_exact_stand_ins(monkeypatch, signature):
    # torch's varlen_attn, faked by the exact stand-in: torch 2.13's keywords (a window, grouped-query heads), or an
    # older release's (a causal flag, as many key heads as query heads).
    import torch.nn.attention.varlen as torch_varlen

    calls = []

    def window(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append({"window_size": window_size, "enable_gqa": enable_gqa, "heads": k.size(1)})
        assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
        causal = window_size == (-1, 0)
        return emulation.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)

    def causal_flag(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None):
        calls.append({"is_causal": is_causal, "heads": k.size(1)})
        assert k.size(1) == q.size(1)
        return emulation.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=is_causal)

    monkeypatch.setattr(torch_varlen, "varlen_attn", {"window": window, "causal_flag": causal_flag}[signature])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 4, 8, generator=generator)
    k, v = (torch.randn(3, 7, 2, 8, generator=generator) for _ in range(2))  # fewer keys: bottom-right causal
    got = emulation.torch_dense_attention(q, k, v, softmax_scale=0.3, causal=True)
    expected = emulation.dense_attention(q, k, v, softmax_scale=0.3, causal=True)
    torch.testing.assert_close(got, expected)
    if signature == "window":
        assert calls == [{"window_size": (-1, 0), "enable_gqa": True, "heads": 2}]
    else:
        assert calls == [{"is_causal": True, "heads": 4}]  # key and value heads repeated for the query heads


def _quick_context(tmp_path) -> Context:
    return Context(device="cpu", sizes=QUICK, workdir=str(tmp_path), log=lambda message: None, remaining=lambda: 60.0)


@pytest.mark.slow
def test_the_engagement_section_fails_when_the_default_setup_falls_back(tmp_path, monkeypatch):
    from trl_grpo_ext.forward.logprobs import SelfCheck

    judge = SelfCheck.judge

    def fails(self, dtype):
        judge(self, dtype)
        self.passed, self.cause = False, "a failure for the test"

    monkeypatch.setattr(SelfCheck, "judge", fails)
    result = section_engagement(_quick_context(tmp_path), 30.0, {})
    default = result["setups"]["default"]
    assert default["fell_back"] and default["packed_forwards"] == 0 and not default["self_check"]["passed"]
    assert any("a failure for the test" in message for message in default["messages"])
    assert result["checks"]["default_packs"] is False and result["checks"]["bf16_weights_packs"] is False


@pytest.mark.slow
def test_the_exactness_section_catches_boundaries_inferred_from_position_ids_on_several_rows(tmp_path, monkeypatch):
    # Issue 48's flash-attention defect, reintroduced: without explicit boundaries transformers infers packed
    # sequences from position_ids for one row only, and a sequence attends to those packed before it in its row.
    from trl_grpo_ext.forward.attention import PackedAttention

    monkeypatch.setattr(PackedAttention, "varlen_keywords", lambda self: {})
    result = section_exactness(_quick_context(tmp_path), 30.0, {})
    checks = result["checks"]
    assert checks["sdpa_float32_packed_within_tolerance"] and checks["sdpa_float32_shared_within_tolerance"]
    for precision in ("float32", "bf16_autocast"):
        for side in ("packed", "shared"):
            assert not checks[f"flash_attention_2_{precision}_{side}_within_tolerance"]
    runs = {(run["attention"], run["precision"]): run for run in result["runs"]}
    flash = runs[("flash_attention_2", "float32")]
    assert flash["sides"]["packed"]["max"] > 100 * flash["tolerance"]
    # A shared prompt's gathered keys without their boundaries: the forward raises, recorded as a failed side.
    assert "error" in flash["sides"]["shared"]
