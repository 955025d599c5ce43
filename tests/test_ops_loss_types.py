"""The loss-type records (`trl_grpo_ext.ops.loss_types`): one's own policy term and loss type, added by
`register_policy_term` and `register_loss_type`, train through `GRPOTrainerExt` and show on the model card."""

import math

import pytest
import torch
from helpers import make_trainer, model_card

from trl_grpo_ext.ops import loss_types
from trl_grpo_ext.ops.loss_types import LossType, register_loss_type, register_policy_term
from trl_grpo_ext.ops.terms import POLICY_TERMS

TOY_FORMULA = "S_it = r_it * A_i   (toy: the ratio unclipped)"


def unclipped(ratio, advantages, logp, **_):
    """`P = -r A`: the surrogate without its clip, so without a flat region."""
    return -ratio * advantages, None, None


@pytest.fixture
def toy_loss_type():
    """`loss_type="toy"` for the test, taken out of the registries afterwards."""
    register_policy_term("toy_unclipped", unclipped, TOY_FORMULA)
    record = register_loss_type(LossType("toy", "toy_unclipped", "sequence_mean", clip_metrics="none"))
    yield record
    loss_types.LOSS_TYPES.pop("toy", None)
    for registry in (POLICY_TERMS, loss_types.TERM_FORMULAS, loss_types.TERM_CLIP_FIELDS):
        registry.pop("toy_unclipped", None)


def test_a_registered_loss_type_trains_two_steps_and_shows_on_the_card(
    toy_loss_type, tmp_path, tiny_model_path, prompt_dataset
):
    trainer = make_trainer(tmp_path, tiny_model_path, None, prompt_dataset, loss_type="toy", max_steps=2)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[name], after[name]) for name in before)  # it trained
    text = model_card(is_adapter=False, config={"loss_type": "toy", "beta": 0.04}, metrics={})
    objective = text.split("## Objective")[1].split("## Training configuration")[0]
    assert TOY_FORMULA in objective and "clip(" not in objective


def test_a_taken_name_or_an_unknown_part_is_refused(toy_loss_type):
    with pytest.raises(ValueError, match="'grpo' exists already"):
        register_loss_type(LossType("grpo", "clipped", "sequence_mean"))
    with pytest.raises(ValueError, match="'toy_unclipped' exists already"):
        register_policy_term("toy_unclipped", unclipped, TOY_FORMULA)
    with pytest.raises(ValueError, match="must be callable"):
        register_policy_term("not_a_function", "P = 0", TOY_FORMULA)
    with pytest.raises(ValueError, match="unknown policy term 'nowhere'"):
        LossType("other", "nowhere", "sequence_mean")


def test_the_loss_type_table_has_a_row_per_record_with_its_term_aggregation_and_divisor():
    """docs/objective.md's table, written by `python -m benchmarks tables` from the built-in records."""
    from benchmarks import tables

    records = [loss_types.LOSS_TYPES[name] for name in loss_types.BUILTIN_LOSS_TYPES]
    rows = tables.render("loss-types").splitlines()
    assert rows[:2] == ["| `loss_type` | policy term `P` | aggregation |", "| --- | --- | --- |"]
    assert len(rows) == 2 + len(records)
    for row, record in zip(rows[2:], records, strict=True):
        name, term, aggregation = (cell.strip() for cell in row.strip("|").split("|"))
        assert name.split(" ")[0] == f"`{record.name}`" and term == f"`{record.policy_term}`"
        assert aggregation.split(",")[0] == f"`{record.aggregation}`"
        assert (record.divisor is not None) == (tables.DIVISOR_NOTES.get(record.divisor, "-") in aggregation)
    assert rows[2] == "| `grpo` (this package's default) | `clipped` | `sequence_mean` |"
    assert set(tables.DIVISOR_NOTES) == set(loss_types.DIVISORS)


def test_a_registered_loss_type_is_not_built_in_but_has_its_row(toy_loss_type):
    from benchmarks.tables import loss_type_row

    assert "toy" in loss_types.LOSS_TYPES and "toy" not in loss_types.BUILTIN_LOSS_TYPES
    assert loss_type_row(toy_loss_type) == "| `toy` | `toy_unclipped` | `sequence_mean` |"


def test_a_loss_type_table_cell_that_would_break_the_row_is_refused():
    from benchmarks.tables import loss_type_row

    with pytest.raises(ValueError, match="loss type grpo: a table cell"):
        loss_type_row(loss_types.LOSS_TYPES["grpo"], "default | of TRL")
