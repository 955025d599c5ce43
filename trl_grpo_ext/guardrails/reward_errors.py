"""`GuardedReward`: a reward function whose exceptions name the function and the completion it failed on."""

from __future__ import annotations

import inspect
from collections.abc import Callable

__all__ = ["GuardedAsyncReward", "GuardedReward", "RewardFunctionError", "guard_reward_funcs"]


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it and the completion it failed on."""


def _is_batch_list(value, size: int) -> bool:
    return isinstance(value, list) and len(value) == size


class GuardedReward:
    """A reward function whose exceptions say which function failed and on which completion.

    On an exception, the function is called again on one completion at a time to find the first one that
    fails; the error names the function, that completion's index in the batch, its prompt and its text. Keeps the
    wrapped function's name (TRL logs `rewards/<name>/mean`).
    """

    def __init__(self, func: Callable, name: str):
        self.func = func
        self.__name__ = name

    def _failing_index(self, kwargs: dict) -> int | None:
        size = len(kwargs["completions"])
        for index in range(size):
            single = {key: [value[index]] if _is_batch_list(value, size) else value for key, value in kwargs.items()}
            try:
                result = self.func(**single)
                if inspect.iscoroutine(result):
                    result.close()
                    return None
            except Exception:  # noqa: BLE001 - looking for the completion that reproduces the error
                return index
        return None

    def _error(self, error: Exception, kwargs: dict) -> RewardFunctionError:
        index = self._failing_index(kwargs)
        if index is None:
            where = "on the batch (no single completion reproduces it)"
        else:
            prompt = kwargs.get("prompts", [None] * (index + 1))[index]
            where = (
                f"on completion {index} of the batch (prompt {prompt!r}, completion {kwargs['completions'][index]!r})"
            )
        return RewardFunctionError(
            f"Reward function '{self.__name__}' raised {type(error).__name__}: {error} {where}."
        )

    def __call__(self, **kwargs):
        try:
            return self.func(**kwargs)
        except Exception as error:
            raise self._error(error, kwargs) from error


class GuardedAsyncReward(GuardedReward):
    """`GuardedReward` for `async` reward functions."""

    async def __call__(self, **kwargs):
        try:
            return await self.func(**kwargs)
        except Exception as error:
            raise RewardFunctionError(
                f"Reward function '{self.__name__}' raised {type(error).__name__}: {error} on a batch of "
                f"{len(kwargs.get('completions', []))} completions."
            ) from error


def guard_reward_funcs(reward_funcs):
    """`reward_funcs` (as `GRPOTrainer` takes them) with every plain or async callable wrapped, so that its errors
    name the function and the failing completion; model ids, models and already guarded functions are kept."""
    import torch
    from trl.trainer.utils import get_callable_name, is_async_callable

    if reward_funcs is None:
        return None
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    guarded = []
    for func in funcs:
        if isinstance(func, (str, torch.nn.Module)) or not callable(func) or isinstance(func, GuardedReward):
            guarded.append(func)
        elif is_async_callable(func):
            guarded.append(GuardedAsyncReward(func, get_callable_name(func)))
        else:
            guarded.append(GuardedReward(func, get_callable_name(func)))
    return guarded
