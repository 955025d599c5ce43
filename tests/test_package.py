"""The public surface of the package and its import structure."""

import trl_grpo_ext


def test_exports_exactly_the_public_names():
    assert sorted(trl_grpo_ext.__all__) == sorted(
        ["GRPOTrainerExt", "GRPOConfigExt", "grpo_loss", "group_relative_advantages"]
    )
    for name in trl_grpo_ext.__all__:
        assert getattr(trl_grpo_ext, name).__module__.startswith("trl_grpo_ext.")


_WITHOUT_TRL = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("trl", "transformers", "peft", "accelerate", "datasets"):
            raise ImportError(f"{name} is made unimportable for this test")

sys.meta_path.insert(0, Refuse())
import torch
from trl_grpo_ext import grpo_loss, group_relative_advantages
import trl_grpo_ext.ops
logps = torch.zeros(2, 3, requires_grad=True)
out = grpo_loss(logps, None, None, torch.tensor([1.0, -1.0]), torch.ones(2, 3), beta=0.0)
out.loss.backward()
print(sorted(name for name in sys.modules if name.split(".")[0] in ("trl", "transformers")))
"""


def test_the_ops_layer_imports_without_trl_or_transformers():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRL], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


_CONFIG_ALONE = """
import sys
import trl_grpo_ext.config
print(*sorted(name for name in sys.modules if name.startswith("trl_grpo_ext.guardrails.")))
"""


def test_the_config_loads_the_alarms_not_the_guardrails_that_act_on_them():
    """`config` reads `guardrails.alarms` (the alarms' defaults and ranges); the guardrails package exports its names
    lazily, so that importing the configuration does not load the monitor, the non-finite guard or the reward
    guards."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _CONFIG_ALONE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert "trl_grpo_ext.guardrails.alarms" in loaded
    assert not {f"trl_grpo_ext.guardrails.{name}" for name in ("anomaly", "nonfinite", "reward_errors")} & set(loaded)


def test_the_guardrails_export_their_names_on_first_use():
    from trl_grpo_ext import guardrails
    from trl_grpo_ext.guardrails import AnomalyMonitor, alarms, anomaly, nonfinite, reward_errors

    assert AnomalyMonitor is anomaly.AnomalyMonitor
    assert set(guardrails.__all__) <= set(dir(guardrails))
    for name in guardrails.__all__:
        value = getattr(guardrails, name)
        assert any(getattr(home, name, None) is value for home in (alarms, anomaly, nonfinite, reward_errors)), name
    assert not hasattr(guardrails, "NoSuchName")


def test_the_package_has_no_import_cycles():
    import ast
    import pathlib

    root = pathlib.Path(trl_grpo_ext.__file__).parent
    modules = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module] if node.module else base)
                targets |= {target} if target in modules else {f"{target}.{alias.name}" for alias in node.names}
        graph[name] = {target for target in targets if target in modules and target != name}

    def visit(name, trail):
        assert name not in trail, "import cycle: " + " -> ".join([*trail, name])
        for target in graph[name]:
            visit(target, [*trail, name])

    for name in graph:
        if name:  # the package's own __init__ imports its modules, which is no cycle
            visit(name, [])


def _package_imports() -> list[tuple[str, str, bool]]:
    """Every import of one of the package's modules: (importing module, imported module, at function level), module
    names relative to the package ("" for its `__init__`); `from .x import y` counts `x.y` where that is a module."""
    import ast
    import pathlib

    root = pathlib.Path(trl_grpo_ext.__file__).parent
    modules = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        in_function = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(function)
        }
        type_checking = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in type_checking:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    target = ".".join([*base, node.module] if node.module else base)
                elif (node.module or "").split(".")[0] == "trl_grpo_ext":
                    target = node.module.removeprefix("trl_grpo_ext").removeprefix(".")
                else:
                    continue
                submodules = [f"{target}.{alias.name}".lstrip(".") for alias in node.names]
                targets = [module for module in submodules if module in modules] or [target]
            elif isinstance(node, ast.Import):
                targets = [
                    alias.name.removeprefix("trl_grpo_ext").removeprefix(".")
                    for alias in node.names
                    if alias.name.split(".")[0] == "trl_grpo_ext"
                ]
            else:
                continue
            found += [(name, target, id(node) in in_function) for target in targets]
    return found


def _under(module: str, *layers: str) -> bool:
    return any(module == layer or module.startswith(f"{layer}.") for layer in layers)


def test_the_config_imports_only_records_and_the_ops_layer():
    """`config` is a leaf that every feature module may import: it reads the values it checks from the records that
    the features read too (`choices`, the alarms' defaults and ranges, the loss types of `ops`), never from a feature
    module. Its checks (`config_checks`) read the same and nothing of `config`."""
    imported = {(module, target) for module, target, _ in _package_imports() if module in ("config", "config_checks")}
    assert imported and all(
        _under(target, "ops", "choices", "guardrails.alarms", NAMES) or (module, target) == ("config", "config_checks")
        for module, target in imported
    ), imported


def test_the_diagnostics_only_observe():
    """Nothing in `diagnostics` computes what trains: it imports the ops layer, the metric names and itself only (not
    the samplers, the trainer, the forward or the configuration)."""
    imported = {(module, target) for module, target, _ in _package_imports() if _under(module, "diagnostics")}
    assert all(_under(target, "diagnostics", "ops", NAMES) for _, target in imported), imported


def test_the_ops_layer_imports_nothing_of_the_package_above_it():
    imported = {(module, target) for module, target, _ in _package_imports() if _under(module, "ops")}
    assert all(_under(target, "ops") for _, target in imported), imported


#: The metric names (`metrics.py`): the one module below every layer, which any module may import.
NAMES = "metrics"
#: The alarms (`guardrails.alarms` and its family modules): they import one another and the metric names only.
ALARMS = "guardrails.alarms"


def test_the_records_import_nothing_of_the_package():
    """What `config` and the features read their values from imports none of them (the alarms one another and the
    metric names only)."""
    records = ("choices", "_compat")
    imported = {
        (module, target) for module, target, _ in _package_imports() if module in records or _under(module, ALARMS)
    }
    assert all(_under(target, ALARMS) or target == NAMES for _, target in imported), imported
    assert ("guardrails.alarms.kl", "metrics") in imported  # the check sees the alarms' imports


def test_the_metric_names_import_nothing_of_the_package():
    """Every layer may read the metric names (the diagnostics and the alarm rules too), so they read nothing."""
    imported = {(module, target) for module, target, _ in _package_imports() if module == NAMES}
    assert not imported, imported


def test_only_the_entry_points_reach_the_trainer():
    """The trainer is the top of the library: no module of the package imports it (the recipe and the command line
    take `GRPOTrainerExt` from the package's public names)."""
    importers = {module for module, target, _ in _package_imports() if target == "trainer"}
    assert not importers, importers


#: The imports of the package's modules made inside a function, each with why it waits: none gets around a cycle.
DEFERRED_IMPORTS = {
    # The recipe's command line (`--help`, a mistake in a flag or the config file) answers before the training stack
    # (the trainer, datasets, the reward functions) is imported.
    ("tools.recipes.grpo", ""): "the trainer, through the package's lazy public names",
    ("tools.recipes.grpo", "tools.recipes.data"): "datasets, loaded only to train",
    ("tools.recipes.grpo", "tools.recipes.rewards"): "the reward functions, resolved only to train",
    # The SLURM launcher plans and prints its commands on a login node without TRL or torch; only the check of the
    # recipe's flags reads the recipe's fields.
    ("tools.recipes.slurm", "config"): "TRL's GRPOConfig, for the flags' check only",
    ("tools.recipes.slurm", "tools.recipes.arguments"): "TRL's parser, for the flags' check only",
    ("tools.recipes.slurm", "tools.recipes.grpo"): "the recipe, for the flags' check only",
    # The tools are never imported with the trainer: the model card loads them when it is written.
    ("trainer", "tools.card"): "the model card's sections, when a card is written",
    # The extras: a run imports those its options turn on (tests/test_extras.py).
    ("trainer", "extras.heldout"): "held-out evaluation, where asked for",
    ("trainer", "extras.skipping"): "skip_zero_advantage_rows",
    ("trainer", "extras.vllm.mismatch"): "use_vllm",
    ("trainer", "extras.selective"): "selective_rollouts",
    ("trainer", "extras.dynamic"): "dynamic_sampling",
    ("trainer", "extras.alerts"): "warn_on_anomalies",
    ("trainer", "extras.console"): 'console="compact"',
    ("extras.console", "tools.report.sampling"): "the report's sampling line, at the end of training",
}


def test_the_package_s_modules_are_imported_at_module_level_but_for_recorded_reasons():
    deferred = {(module, target) for module, target, in_function in _package_imports() if in_function}
    assert deferred <= set(DEFERRED_IMPORTS), sorted(deferred - set(DEFERRED_IMPORTS))


def test_the_module_level_imports_point_one_way():
    """No cycle among the imports that run when a module is imported, counting the `__init__` of every package a
    module imports from (which Python runs first), but for the packages that hold the importing module."""
    graph: dict[str, set[str]] = {}
    for module, target, in_function in _package_imports():
        if in_function:
            continue
        parts = target.split(".") if target else []
        own = {".".join(module.split(".")[:depth]) for depth in range(module.count(".") + 2)} | {""}
        reached = {target} | {".".join(parts[:depth]) for depth in range(1, len(parts))}
        graph.setdefault(module, set()).update(name for name in reached - own if name != module)

    def visit(name, trail):
        assert name not in trail, "import cycle: " + " -> ".join([*trail, name])
        for target in graph.get(name, ()):
            visit(target, [*trail, name])

    for name in graph:
        visit(name, [])


_TRAINER_ALONE = """
import sys
import trl_grpo_ext.trainer
print(*sorted(name for name in sys.modules if name.startswith("trl_grpo_ext.")))
"""


def test_the_trainer_loads_no_module_of_the_tools_or_the_extras():
    """The command, the report, the model card and the recipes load when they run (a card when it is written), an
    extra when its option is on, never with `import trl_grpo_ext.trainer`."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _TRAINER_ALONE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert "trl_grpo_ext.trainer" in loaded
    assert not [name for name in loaded if name.startswith(("trl_grpo_ext.tools", "trl_grpo_ext.extras"))], loaded


def test_the_tools_name_no_file_of_the_checkout_that_the_wheel_leaves_out():
    """The tools speak of themselves: no `tests/` or `benchmarks/` path, no peer tool (their comparisons are in
    docs/)."""
    import pathlib
    import re

    root = pathlib.Path(trl_grpo_ext.__file__).parent / "tools"
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\btests/|\bbenchmarks\b|\b(rldoctor|rl_doctor|rlprobe|rlwatch|verl)\b", line)
    ]
    assert not found, found
