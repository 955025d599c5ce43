"""Two CPU processes (gloo) under `accelerate launch` with DDP: logged statistics are those of the pooled data."""

import pytest
from helpers import assert_logged_statistics_are_those_of_both_processes_pooled, assert_one_gather_per_log_step


@pytest.mark.slow
def test_logged_statistics_are_those_of_both_processes_pooled(ddp_reference):
    assert [rank["engine"]["num_processes"] for rank in ddp_reference] == [2, 2]
    assert {rank["engine"]["distributed_type"] for rank in ddp_reference} == {"DistributedType.MULTI_CPU"}
    assert_logged_statistics_are_those_of_both_processes_pooled(ddp_reference)


@pytest.mark.slow
def test_diagnostics_add_exactly_one_collective_per_log_step(ddp_reference):
    assert_one_gather_per_log_step(ddp_reference)
