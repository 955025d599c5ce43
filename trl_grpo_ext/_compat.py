"""The TRL versions this package is built against: `GRPOTrainerExt` overrides TRL's private loss hook."""

from __future__ import annotations

import warnings

from packaging.version import Version

__all__ = ["SUPPORTED_TRL", "check_trl_version"]

#: Tested: the hooks GRPOTrainerExt overrides (`_compute_loss`, `_calculate_rewards`, `_get_per_token_logps_and_
#: entropies`, the generation buffer) have these signatures and meanings.
SUPPORTED_TRL = (Version("1.16.0"), Version("1.17.0"))  # [lower, upper)
#: Before 1.0, `GRPOTrainer` computed its loss in a hook with another signature; nothing here would work.
BREAKING_BELOW = Version("1.0.0")


def check_trl_version(version: str) -> None:
    """Warn for an untested TRL version, raise for one known to break the overridden hooks.

    Raises:
        ImportError: for TRL below 1.0.
    """
    found = Version(version)
    supported = f">={SUPPORTED_TRL[0]},<{SUPPORTED_TRL[1]}"
    if found < BREAKING_BELOW:
        raise ImportError(
            f"trl_grpo_ext needs trl{supported}; trl {version} is installed, whose GRPOTrainer has a different loss "
            f"hook. Install a supported version: pip install 'trl{supported}'."
        )
    if not SUPPORTED_TRL[0] <= found < SUPPORTED_TRL[1]:
        warnings.warn(
            f"trl_grpo_ext is tested with trl{supported}; trl {version} is installed. GRPOTrainerExt overrides "
            "private TRL hooks that change between releases: run the tests, or install a supported version.",
            UserWarning,
            stacklevel=3,
        )
