"""trl_grpo_ext: the GRPO objective of the DeepSeekMath paper as a Hugging Face TRL trainer, with diagnostics.

The public names are loaded on first use: `from trl_grpo_ext import grpo_loss` (or `import trl_grpo_ext.ops`) needs
torch only, while `GRPOTrainerExt` and `GRPOConfigExt` import TRL and transformers and check their versions.
"""

from __future__ import annotations

import importlib
import sys

__version__ = "0.1.0"

__all__ = ["GRPOTrainerExt", "GRPOConfigExt", "grpo_loss", "group_relative_advantages"]

_HOMES = {
    "GRPOTrainerExt": ".trainer",
    "GRPOConfigExt": ".config",
    "grpo_loss": ".ops",
    "group_relative_advantages": ".ops",
}


def _exported_lazily(package: str, homes: dict[str, str]):
    """The `__getattr__` and `__dir__` of a package whose public names are loaded on first use (PEP 562).

    Args:
        package: the package's `__name__`.
        homes: each public name -> the module that defines it, relative to `package` (`".trainer"`).
    """

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], package), name)
        setattr(sys.modules[package], name, value)  # found without this function from now on
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__


__getattr__, __dir__ = _exported_lazily(__name__, _HOMES)
