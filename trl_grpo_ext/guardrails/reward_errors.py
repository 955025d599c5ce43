"""`GuardedReward`: a reward function whose exceptions and bad values (anything but one finite number, `None` or NaN
per completion) name the function and the completion; `check_reward_signature`: a function that cannot take the
keyword arguments TRL passes it is refused when the trainer is built.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

__all__ = [
    "GuardedAsyncReward",
    "GuardedReward",
    "RewardFunctionError",
    "check_reward_signature",
    "check_rewards",
    "guard_reward_funcs",
    "reward_kwarg_names",
]

#: The keyword arguments `GRPOTrainer._calculate_rewards` passes every reward function, besides the dataset's columns.
_TRL_REWARD_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
#: The `GRPOTrainer` methods passed as `log_extra` and `log_metric`: passed where the installed TRL has them.
_TRL_LOGGING_KWARGS = {"log_extra": "_log_completion_extra", "log_metric": "_log_metric"}
#: The dataset columns TRL does not pass on (`_calculate_rewards`).
_COLUMNS_NOT_PASSED = ("prompt", "completion", "completion_ids")


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned a bad value; the message names it and the completion concerned."""


def check_rewards(name: str, rewards, kwargs: dict, kind: str = "Reward function") -> None:
    """Raise `RewardFunctionError` unless `rewards` holds one finite number, `None` or NaN per completion.

    Args:
        name (`str`): the function's name, as TRL logs it.
        rewards: what it returned.
        kwargs (`dict`): what it was called with (`prompts`, `completions`, ...).
        kind (`str`): what the function is, in the message (`"Held-out metric"` for those).
    """
    completions = kwargs.get("completions", [])
    if isinstance(rewards, (str, bytes)) or not hasattr(rewards, "__len__") or not hasattr(rewards, "__iter__"):
        raise RewardFunctionError(
            f"{kind} '{name}' returned {type(rewards).__name__} {rewards!r} for {len(completions)} "
            "completions: it must return a list with one reward (a number, or None or NaN for a completion it "
            "cannot score) per completion."
        )
    if len(rewards) != len(completions):
        raise RewardFunctionError(
            f"{kind} '{name}' returned {len(rewards)} rewards for {len(completions)} completions: it must "
            "return one reward (a number, or None or NaN) per completion."
        )
    prompts = kwargs.get("prompts") or [None] * len(completions)
    for index, reward in enumerate(rewards):
        if reward is None or (isinstance(reward, float) and math.isnan(reward)):
            continue
        try:
            value = float(reward)
        except (TypeError, ValueError):
            value = None
        if value is None or math.isinf(value):
            what = "an infinite reward" if value is not None and math.isinf(value) else f"a {type(reward).__name__}"
            raise RewardFunctionError(
                f"{kind} '{name}' returned {what}, {reward!r}, for completion {index} of the batch (prompt "
                f"{prompts[index]!r}, completion {completions[index]!r}): rewards must be finite numbers, or None or "
                "NaN for a completion it cannot score."
            )


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
            rewards = self.func(**kwargs)
        except Exception as error:
            raise self._error(error, kwargs) from error
        check_rewards(self.__name__, rewards, kwargs)
        return rewards


class GuardedAsyncReward(GuardedReward):
    """`GuardedReward` for `async` reward functions."""

    async def __call__(self, **kwargs):
        try:
            rewards = await self.func(**kwargs)
        except Exception as error:
            raise RewardFunctionError(
                f"Reward function '{self.__name__}' raised {type(error).__name__}: {error} on a batch of "
                f"{len(kwargs.get('completions', []))} completions."
            ) from error
        check_rewards(self.__name__, rewards, kwargs)
        return rewards


def reward_kwarg_names(train_dataset=None, environments: bool = False) -> list[str]:
    """The keyword arguments the installed TRL passes a reward function in a run on `train_dataset`.

    Args:
        train_dataset (`datasets.Dataset`, *optional*): the training set; its columns other than `prompt`,
            `completion` and `completion_ids` are passed, one list each. A dataset without `column_names` (an
            `IterableDataset` whose features are unknown) adds none.
        environments (`bool`): whether the run has an `environment_factory` (TRL then passes `environments`).

    Returns:
        `list[str]`: the names, TRL's own first.
    """
    from trl import GRPOTrainer

    names = [
        name
        for name in _TRL_REWARD_KWARGS
        if name not in _TRL_LOGGING_KWARGS or hasattr(GRPOTrainer, _TRL_LOGGING_KWARGS[name])
    ]
    names += ["environments"] if environments else []
    columns = getattr(train_dataset, "column_names", None) or []
    if isinstance(columns, dict):  # a DatasetDict: the columns of each split
        columns = [column for split in columns.values() for column in split]
    names += [column for column in columns if column not in _COLUMNS_NOT_PASSED and column not in names]
    return names


def check_reward_signature(func: Callable, name: str, kwarg_names: list[str]) -> None:
    """Raise `TypeError` if `func` cannot be called with the keyword arguments `kwarg_names`, in one line that says
    which ones it lacks and to add `**kwargs`. A function with `**kwargs`, or whose signature cannot be read, passes.

    Args:
        func (`Callable`): the reward function.
        name (`str`): its name, as TRL logs it.
        kwarg_names (`list[str]`): what TRL will pass it (`reward_kwarg_names`).
    """
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or an extension type: nothing to read
        return
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return
    accepted = {
        parameter.name
        for parameter in parameters
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    missing = [kwarg for kwarg in kwarg_names if kwarg not in accepted]
    if missing:
        raise TypeError(
            f"Reward function '{name}' does not take the keyword arguments TRL passes it ({', '.join(missing)}): add "
            f"`**kwargs` to its parameters, e.g. `def {name}(completions, **kwargs)`."
        )


def guard_reward_funcs(reward_funcs, kwarg_names: list[str] | None = None):
    """`reward_funcs` (as `GRPOTrainer` takes them) with every plain or async callable wrapped, so that its errors
    name the function and the failing completion; model ids, models and already guarded functions are kept.

    Args:
        reward_funcs: a reward function, model id or model, or a list of them; `None` is returned as it is.
        kwarg_names (`list[str]`, *optional*): the keyword arguments TRL will pass (`reward_kwarg_names`); each
            callable is checked to take them (`check_reward_signature`). Default: TRL's own, without the dataset's
            columns.

    Raises:
        TypeError: for a callable without `**kwargs` that lacks a keyword argument TRL will pass.
    """
    import torch
    from trl.trainer.utils import get_callable_name, is_async_callable

    if reward_funcs is None:
        return None
    kwarg_names = reward_kwarg_names() if kwarg_names is None else kwarg_names
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    guarded = []
    for func in funcs:
        if isinstance(func, (str, torch.nn.Module)) or not callable(func) or isinstance(func, GuardedReward):
            guarded.append(func)
            continue
        check_reward_signature(func, get_callable_name(func), kwarg_names)
        if is_async_callable(func):
            guarded.append(GuardedAsyncReward(func, get_callable_name(func)))
        else:
            guarded.append(GuardedReward(func, get_callable_name(func)))
    return guarded
