"""Shared fixtures: a tiny local model, a synthetic prompt dataset and a reward with spread inside each group."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

# Small ops ran several times faster on one thread than on two on 2-core machines.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from trl_grpo_ext.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def prompt_dataset() -> Dataset:
    return Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq="] * 4})


@pytest.fixture(scope="session")
def ddp_reference(tiny_model_path, tmp_path_factory) -> list[dict]:
    """tests/distributed_run.py's `reference` run under DDP (two CPU processes): what each process saved."""
    from helpers import DISTRIBUTED_RUN, launch, phase_results

    output_dir = tmp_path_factory.mktemp("ddp")
    launch("cpu_ddp.yaml", [DISTRIBUTED_RUN, output_dir, tiny_model_path, "--phases", "reference"])
    return phase_results(output_dir, "reference")
