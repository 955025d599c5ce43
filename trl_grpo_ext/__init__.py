"""trl_grpo_ext: the GRPO objective of the DeepSeekMath paper as a Hugging Face TRL trainer, with diagnostics."""

import transformers as _transformers
import trl as _trl

from ._compat import check_transformers_version as _check_transformers_version
from ._compat import check_trl_version as _check_trl_version

_check_trl_version(_trl.__version__)
_check_transformers_version(_transformers.__version__)

from .config import GRPOConfigExt  # noqa: E402
from .loss import group_relative_advantages, grpo_loss  # noqa: E402
from .trainer import GRPOTrainerExt  # noqa: E402

__version__ = "0.1.0"

__all__ = ["GRPOTrainerExt", "GRPOConfigExt", "grpo_loss", "group_relative_advantages"]
