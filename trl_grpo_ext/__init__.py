"""trl_grpo_ext: the GRPO objective of the DeepSeekMath paper as a Hugging Face TRL trainer, with diagnostics."""

from .config import GRPOConfigExt
from .loss import group_relative_advantages, grpo_loss
from .trainer import GRPOTrainerExt

__version__ = "0.1.0"

__all__ = ["GRPOTrainerExt", "GRPOConfigExt", "grpo_loss", "group_relative_advantages"]
