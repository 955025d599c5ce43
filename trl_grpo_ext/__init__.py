"""trl_grpo_ext: the GRPO objective of the DeepSeekMath paper as a Hugging Face TRL trainer, with diagnostics.

The public names are loaded on first use: `from trl_grpo_ext import grpo_loss` (or `import trl_grpo_ext.ops`) needs
torch only, while `GRPOTrainerExt` and `GRPOConfigExt` import TRL and transformers and check their versions.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = ["GRPOTrainerExt", "GRPOConfigExt", "grpo_loss", "group_relative_advantages"]

_HOMES = {
    "GRPOTrainerExt": ".trainer",
    "GRPOConfigExt": ".config",
    "grpo_loss": ".ops",
    "group_relative_advantages": ".ops",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
