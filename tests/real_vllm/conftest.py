"""The real-vLLM tier (`make test-vllm`): vLLM's CPU engine in TRL's colocate mode, on the demo's tiny model.

Left out of the default run (`--ignore=tests/real_vllm` in pyproject's addopts; `pytest tests/real_vllm` collects it)
and marked `vllm`. TRL's colocate engine runs in the calling process
(`distributed_executor_backend="external_launcher"`) and can be built once per process, so the tests in this process
share one engine (`shared_engine`, through `cpu_engines.reuse_vllm_engine`); each trainer pushes its own
weights into it at its first generation. The tests that need an engine of their own (a kill and resume, a run without
the shim, an engine vLLM spawns) run scripts in subprocesses. Starting an engine takes 15-130 s here.
"""

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for a 14-token vocabulary and 32 positions

import pytest  # noqa: E402
from vllm_helpers import DEMO_MODEL, DEMO_TRAIN, HERE  # noqa: E402


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.dirname(str(item.fspath)).startswith(HERE):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session", autouse=True)
def vllm_environment(library_temporary_files):
    """vLLM's compile cache under pytest's temporary folder, shared with the engines of the subprocesses."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(library_temporary_files / "vllm"))
        yield


@pytest.fixture(scope="session")
def shared_engine():
    """The shim on, and every colocate trainer built in this process on one engine (built by the first)."""
    from cpu_engines import enable_vllm_on_cpu, reuse_vllm_engine

    enable_vllm_on_cpu()
    with reuse_vllm_engine():
        yield


@pytest.fixture(scope="session")
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="session")
def reversal_dataset():
    """The demo's string-reversal prompts (with their `solution` column)."""
    from datasets import load_dataset

    return load_dataset("json", data_files=DEMO_TRAIN, split="train").select(range(512))
