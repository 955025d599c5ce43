"""The values of `GRPOConfigExt`'s choice fields, where the configuration that checks them and the features that act
on them both read them (`config.py` imports no feature module)."""

from __future__ import annotations

__all__ = ["CONSOLE_MODES", "NONFINITE_POLICIES"]

#: `console`: what the console shows per log step (`extras.console.ConsoleCallback`).
CONSOLE_MODES = ("compact", "raw")

#: `nonfinite_policy`: what happens to an optimizer step whose gradient norm is not finite
#: (`guardrails.nonfinite.NonFiniteGuard`).
NONFINITE_POLICIES = ("skip", "stop", "off")
