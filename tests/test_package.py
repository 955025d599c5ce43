"""The public surface of the package."""

import trl_grpo_ext


def test_exports_exactly_the_public_names():
    assert sorted(trl_grpo_ext.__all__) == sorted(
        ["GRPOTrainerExt", "GRPOConfigExt", "grpo_loss", "group_relative_advantages"]
    )
    for name in trl_grpo_ext.__all__:
        assert getattr(trl_grpo_ext, name).__module__.startswith("trl_grpo_ext.")


def test_the_loss_modules_import_only_torch():
    import ast
    import inspect

    from trl_grpo_ext import fused, loss, numerics

    for module in (loss, fused, numerics):
        tree = ast.parse(inspect.getsource(module))
        absolute = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        absolute |= {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0
        }
        relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0}
        assert absolute <= {"__future__", "functools", "math", "typing", "warnings", "torch"}, module.__name__
        assert relative <= {"fused", "numerics"}, module.__name__


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
