"""Two CPU processes (gloo) under `accelerate launch` with DDP: logged statistics are those of the pooled data."""

import pytest
from helpers import (
    assert_heldout_is_that_of_one_process,
    assert_logged_statistics_are_those_of_both_processes_pooled,
    assert_one_gather_per_log_step,
    assert_packed_is_padded,
    heldout_in_one_process,
    phase_results,
)


@pytest.mark.slow
def test_logged_statistics_are_those_of_both_processes_pooled(ddp_reference):
    assert [rank["engine"]["num_processes"] for rank in ddp_reference] == [2, 2]
    assert {rank["engine"]["distributed_type"] for rank in ddp_reference} == {"DistributedType.MULTI_CPU"}
    assert_logged_statistics_are_those_of_both_processes_pooled(ddp_reference)


@pytest.mark.slow
def test_diagnostics_add_exactly_one_collective_per_log_step(ddp_reference):
    assert_one_gather_per_log_step(ddp_reference)


@pytest.mark.slow
def test_padding_free_log_probs_train_as_trl_s_padded_forward(ddp_run, ddp_reference):
    assert_packed_is_padded(ddp_reference, phase_results(ddp_run, "padded"))


@pytest.mark.slow
def test_held_out_evaluation_in_two_processes_gives_the_numbers_of_one(ddp_run, tiny_model_path, tmp_path):
    ranks = phase_results(ddp_run, "heldout")
    assert [rank["engine"]["num_processes"] for rank in ranks] == [2, 2]
    assert_heldout_is_that_of_one_process(ranks, heldout_in_one_process(tiny_model_path, tmp_path))
