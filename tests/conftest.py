"""Shared fixtures: a tiny local model, a synthetic prompt dataset and a reward with spread inside each group."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

# Small ops ran several times faster on one thread than on two on 2-core machines.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def library_temporary_files(tmp_path_factory):
    """Keep what libraries write on their own under pytest's temporary folder, in this process and in the processes
    tests launch: torch.compile's kernels and precompiled headers and torchrun's `torchelastic_*` folders (all in the
    system temp folder, the headers even when `TORCHINDUCTOR_CACHE_DIR` is set), and the Arrow files that
    `datasets.load_dataset` makes of local files (in the home folder)."""
    import tempfile

    import datasets.config

    root = tmp_path_factory.mktemp("library_files")
    (root / "tmp").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(root / "tmp"))
        patch.setattr(tempfile, "tempdir", str(root / "tmp"))
        # Importing transformers already fixed torch's cache folder (in this variable) from the old temp folder.
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "tmp" / "torchinductor"))
        patch.setenv("HF_DATASETS_CACHE", str(root / "datasets"))
        # `datasets` read the variable when it was imported, before this fixture ran.
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
        yield root


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from trl_grpo_ext.testing import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def prompt_dataset() -> Dataset:
    return Dataset.from_dict({"prompt": ["abc=", "hello=", "xyz=", "qq="] * 4})


@pytest.fixture(scope="session")
def ddp_run(tiny_model_path, tmp_path_factory):
    """tests/launched.py's `reference`, `padded` and `heldout` phases under DDP (two CPU processes): their folder."""
    from helpers import launch

    output_dir = tmp_path_factory.mktemp("ddp")
    launch("cpu_ddp.yaml", output_dir, tiny_model_path, ["reference", "padded", "heldout"])
    return output_dir


@pytest.fixture(scope="session")
def ddp_reference(ddp_run) -> list[dict]:
    """The `reference` run under DDP: what each process saved."""
    from helpers import phase_results

    return phase_results(ddp_run, "reference")
