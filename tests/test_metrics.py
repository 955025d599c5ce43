"""The metric names of `trl_grpo_ext.metrics`: written there once, read from there by the rest of the package."""

import ast
import pathlib

import trl_grpo_ext
from trl_grpo_ext import metrics

#: The string literals equal to a metric name that stay, by module: (module, literal) -> why.
NOT_METRIC_NAMES = {
    ("_compat", "grad_norm"): "an argument of transformers' `Trainer._get_grad_norm`, pinned by the drift test",
    ("tools.card.fields", "learning_rate"): "a configuration field the card lists",
    ("tools.recipes.arguments", "learning_rate"): "a configuration field the recipe sets",
    ("tools.report.health", "reward"): "a signal's title",
    ("tools.report.health", "entropy"): "a signal's title",
    ("tools.report.figure", "reward"): "a panel's title and axis label",
    ("tools.report.figure", "entropy"): "a panel's title",
    ("tools.report.figure", "loss"): "a panel's axis label",
    ("extras.console", "reward"): "a label on the console's line",
    ("extras.console", "kl"): "a label on the console's line",
    ("extras.console", "entropy"): "a label on the console's line",
    ("ops.loss_types", "vespo/phi_seq_mean"): "VESPO's record, in the ops layer, which imports nothing of the package",
}
#: Modules that do not read their metric names from `metrics` yet (their literals are not checked).
NOT_YET: dict[str, str] = {}


def _names() -> dict[str, str]:
    return {
        value: name
        for name, value in vars(metrics).items()
        if name.isupper() and isinstance(value, str) and not name.startswith("_")
    }


def _literals(tree: ast.Module):
    """The module's string constants but its docstrings, with their line."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value, node.lineno


def test_every_metric_name_is_written_once():
    names = _names()
    assert len(names) == len([name for name in vars(metrics) if name.isupper()]), "two constants share a name"
    assert all(value and value == value.strip() for value in names)


def _literal_names() -> dict[tuple[str, str], list[int]]:
    """Every string literal of the package equal to a metric name but in `metrics`: (module, literal) -> lines."""
    names = _names()
    root = pathlib.Path(trl_grpo_ext.__file__).parent
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        if module == "metrics":
            continue
        for value, line in _literals(ast.parse(path.read_text())):
            if value in names:
                found.setdefault((module, value), []).append(line)
    return found


def test_no_module_writes_a_metric_name_as_a_literal():
    """A metric name is read from `metrics`, so a renamed metric is one edit: a literal equal to one (an f-string's
    constant part too, e.g. `f"ratio/{name}"`) fails here but for the recorded exceptions."""
    names = _names()
    found = [
        f"{module}:{lines}: {value!r} (metrics.{names[value]})"
        for (module, value), lines in _literal_names().items()
        if module not in NOT_YET and (module, value) not in NOT_METRIC_NAMES
    ]
    assert not found, "\n".join(found)


def test_every_exception_is_still_needed():
    found = _literal_names()
    assert set(NOT_METRIC_NAMES) <= set(found), set(NOT_METRIC_NAMES) - set(found)
    assert {module for module, _ in found} >= set(NOT_YET), set(NOT_YET) - {module for module, _ in found}


def test_the_families_build_their_members():
    assert metrics.reward_function_metric("accuracy") == "rewards/accuracy/mean"
    assert metrics.reward_function_metric("accuracy", "std") == "rewards/accuracy/std"
    assert metrics.reward_function_of("rewards/accuracy/mean") == "accuracy"
    assert metrics.reward_function_of("rewards/accuracy/std") is None
    assert metrics.reward_function_of("reward") is None
    assert metrics.alarm_metric("kl_jump") == "alarms/kl_jump"
    assert metrics.heldout_metric("exact", "pass", 4) == "heldout/exact/pass@4"
