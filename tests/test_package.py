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
