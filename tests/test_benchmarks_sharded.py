"""`benchmarks.sharded`: the GPU script's check of the sharded engines, run here on CPU processes."""

import json

import pytest
import torch

from benchmarks.sharded import _verdict, run_sharded_checks


def test_an_unknown_engine_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Unknown engines \\['zero4'\\]"):
        run_sharded_checks(str(tmp_path), engines=("zero4",))


def passing_report(**nan_skip) -> dict:
    return {
        "engine": {"distributed_type": "DistributedType.FSDP", "num_processes": 2, "local": 800, "full": 1600},
        "losses": [0.0, -0.1],
        "grad_norms": [0.7, 0.3],
        "nan_skip": {"error": None, "skipped": 1, "weights_unchanged": True, "final_finite": True} | nan_skip,
    }


def test_the_verdict_names_what_went_wrong():
    assert _verdict("fsdp2", passing_report()) == []
    unsharded = passing_report()
    unsharded["engine"] |= {"distributed_type": "DistributedType.MULTI_CPU", "local": 1600}
    assert _verdict("fsdp2", unsharded) == [
        "accelerate ran DistributedType.MULTI_CPU, not DistributedType.FSDP",
        "local shard 1600 of 1600 with 2 processes",
    ]
    assert _verdict("fsdp2", passing_report(weights_unchanged=False)) == ["the NaN step changed the weights"]
    assert "not skipped once" in _verdict("fsdp2", passing_report(skipped=0, error="stopped"))[0]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine this is the GPU check itself")
def test_the_checks_pass_for_fsdp2_on_cpu_processes(tmp_path):
    results = run_sharded_checks(str(tmp_path), engines=("fsdp2",))
    assert results["fsdp2"]["status"] == "ok", results["fsdp2"]["problems"]
    assert results["ok"] is True
    report = results["fsdp2"]["report"]
    assert report["engine"]["local"] * 2 == report["engine"]["full"] and len(report["losses"]) == 4
    with open(tmp_path / "sharded.json") as handle:
        assert json.load(handle)["fsdp2"]["status"] == "ok"
