"""Tests write only under pytest's temporary folders: not in the system temp folder, not in the home folder."""

import os
import tempfile

import datasets.config
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from benchmarks import comm
from trl_grpo_ext.tools.recipes.data import load_recipe_dataset


def test_library_caches_are_under_pytest_temporary_folder(tmp_path_factory, tmp_path):
    base = tmp_path_factory.getbasetemp()
    assert os.path.commonpath([cache_dir(), base]) == str(base)  # torch.compile's kernels
    assert os.path.commonpath([default_cache_dir(), base]) == str(base)  # its precompiled headers
    assert os.path.commonpath([os.environ["TMPDIR"], base]) == str(base)  # in launched processes too
    (tmp_path / "train.jsonl").write_text('{"prompt": "abc="}\n')
    load_recipe_dataset(str(tmp_path))
    cache = str(datasets.config.HF_DATASETS_CACHE)
    assert os.path.commonpath([cache, base]) == str(base) and os.listdir(cache)  # the Arrow files went there


def test_the_communication_benchmark_removes_its_temporary_folder(tmp_path, monkeypatch):
    system_temp = tmp_path / "system_temp"
    system_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_temp))
    monkeypatch.setenv("TMPDIR", str(system_temp))
    results = comm.run(batch_sizes=())  # no runs: only the tiny model is written
    assert results["runs"] == [] and list(system_temp.iterdir()) == []
