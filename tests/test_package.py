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

    from trl_grpo_ext import fused, loss

    for module in (loss, fused):
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
        assert absolute <= {"__future__", "math", "warnings", "torch"}, module.__name__
        assert relative <= {"loss", "fused"}, module.__name__
