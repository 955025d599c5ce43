"""trl_grpo_ext: the GRPO objective of the DeepSeekMath paper as a Hugging Face TRL trainer, with diagnostics.

The public names are loaded on first use: `from trl_grpo_ext import grpo_loss` (or `import trl_grpo_ext.ops`) needs
torch only, while `GRPOTrainerExt` and `GRPOConfigExt` import TRL and transformers and check their versions.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

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


#: Modules that moved into subpackages: old name -> new name. Importing an old name still works, with a
#: `DeprecationWarning`, until the next release.
MOVED_MODULES = {
    "console": "report.console",
    "health": "report.health",
    "run_report": "report.command",
    "model_card": "card.builder",
    "card_config": "card.fields",
    "card_objective": "card.objective",
    "card_trl": "card.stock",
    "heldout": "sampling.heldout",
    "dynamic_sampling": "sampling.dynamic",
    "sampling_plan": "sampling.plan",
    "skipping": "sampling.skipping",
    "launch": "guardrails.launch",
    "recipes.cpu_engines": "testing",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `trl_grpo_ext.<old>` as the module it moved to (`MOVED_MODULES`), warning once per name."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(f"{__name__}.")
        if old == fullname or old not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        old = spec.name.removeprefix(f"{__name__}.")
        new = f"{__name__}.{MOVED_MODULES[old]}"
        warnings.warn(
            f"`{spec.name}` moved to `{new}`; the old name will be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the module it moved to is already executed


if not any(isinstance(finder, _MovedModule) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModule())
