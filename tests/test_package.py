"""The public surface of the package."""

import trl_grpo_ext


def test_exports_exactly_the_public_names():
    assert sorted(trl_grpo_ext.__all__) == sorted(
        ["GRPOTrainerExt", "GRPOConfigExt", "grpo_loss", "group_relative_advantages"]
    )
    for name in trl_grpo_ext.__all__:
        assert getattr(trl_grpo_ext, name).__module__.startswith("trl_grpo_ext.")


def test_loss_module_does_not_import_trl():
    import ast
    import inspect

    from trl_grpo_ext import loss

    tree = ast.parse(inspect.getsource(loss))
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported <= {"__future__", "math", "dataclasses", "torch"}
