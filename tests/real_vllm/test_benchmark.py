"""`python -m benchmarks truncation` on the real engine: stock TRL's correction under truncated sampling measures the
kept probability mass, not the engine's mismatch (TRL issue #6789)."""

import pytest

from benchmarks import truncation

pytestmark = pytest.mark.usefixtures("shared_engine")


def test_settings_parse_into_sampling_fields():
    assert truncation.parse_settings("top_p=1.0;top_k=3,top_p=0.9") == [{"top_p": 1.0}, {"top_k": 3, "top_p": 0.9}]
    with pytest.raises(ValueError, match="temperature"):
        truncation.parse_settings("temperature=0.5")


def test_truncated_sampling_pulls_stock_trl_s_ratio_below_one():
    results = truncation.run(settings=[{"top_p": 1.0}, {"top_k": 3}], sides=("trl",), steps=2, mode="token_truncate")
    untruncated, top_k = results["runs"]
    assert all(abs(value - 1) < 0.02 for value in untruncated["token_mean"])
    # Every token's ratio carries the kept mass (<= 1): far more of them leave [0.9, 1.1].
    assert all(value < min(untruncated["token_mean"]) - 0.01 for value in top_k["token_mean"])
    assert min(top_k["token_outside"]) > max(untruncated["token_outside"])
    assert results["runs"][0]["logged_mean"] and "top_k=3" in truncation.table(results)
