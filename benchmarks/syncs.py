"""Host synchronisations during training, counted and attributed to the code that caused them.

On a GPU, `torch.cuda.set_sync_debug_mode("warn")` makes every synchronising CUDA call (`.item()`, a copy between
host and device such as `torch.tensor(x, device="cuda")`, `nonzero`, ...) issue a warning; each one is counted
here at the moment it is issued, with the Python stack of its caller. On a CPU nothing synchronises, so the count
is of the operations that would on a GPU, seen through a `TorchDispatchMode`: reads of tensor values on the host
(`aten._local_scalar_dense`, i.e. `.item()`/`float()`/`bool()`), data-dependent shapes (`nonzero`,
`masked_select`, boolean indexing) and tensors made from host data (`aten.lift_fresh`: `torch.tensor(...)`,
`new_tensor`); `.tolist()` and `.numpy()`, which never reach the dispatcher for a CPU tensor, are counted where they
are called. It misses `.cpu()` and `.to(device)`, and counts `torch.tensor(...)` calls that a GPU run would keep on
the host or upload asynchronously (the packed forward's `upload`: its site says so).

Each event is attributed twice:

- its *owner*: the innermost frame outside torch: `trl_grpo_ext`, `trl`, `transformers`, `accelerate`, `peft` or
  `other`;
- its *phase*: the innermost trainer method on the stack: `loss` (`_compute_loss`, `compute_loss`: the loss and the
  per-micro-batch diagnostics), `micro_batch` (the rest of `training_step`, e.g. the backward pass), `generation`
  (`_prepare_inputs`, `_generate_and_score_completions`, rewards), `log`, `optimizer_step` (`_get_grad_norm`), or
  `other` (the training loop itself).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter"]

# Frames of these modules are the machinery between the caller and the event, not its cause.
_SKIPPED_MODULES = ("torch", "warnings", __name__)
_OWNERS = ("trl", "transformers", "accelerate", "peft")
_PHASES = {
    "_compute_loss": "loss",
    "compute_loss": "loss",
    "training_step": "micro_batch",
    "_generate_and_score_completions": "generation",
    "_prepare_inputs": "generation",
    "_calculate_rewards": "generation",
    "log": "log",
    "_get_grad_norm": "optimizer_step",
}
# Reads of tensor values on the host, data-dependent shapes, and tensors made from host data (`torch.tensor(x,
# device=...)`, `new_tensor`: a blocking host-to-device copy on a GPU).
_HOST_READ_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "is_nonzero",
    "equal",
    "_unique2",
    "unique_dim",
    "lift_fresh",
)


def _owner(module: str) -> str:
    """`trl_grpo_ext`, `bench` (these benchmarks), one of `_OWNERS`, or `other`, from a module name."""
    if module == "benchmarks" or module.startswith("benchmarks."):
        return "bench"
    top = module.split(".")[0]
    return top if top in ("trl_grpo_ext", *_OWNERS) else "other"


def _skipped(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in _SKIPPED_MODULES)


def _is_trainer(value) -> bool:
    from transformers import Trainer

    return isinstance(value, Trainer)


class SyncCounter:
    """Counts host synchronisations (or, on a CPU, host reads of tensor values) while the context is active.

    Args:
        device (`str`): `"cuda"` uses the CUDA sync debug mode; `"cpu"` the host-read count described above.

    Attributes:
        counts (`Counter`): `(owner, phase) -> events`.
        sites (`Counter`): `(owner, phase, "file:line function") -> events`, the innermost frame outside torch.
        method (`str`): what was counted.
    """

    def __init__(self, device: str):
        if device not in ("cuda", "cpu"):
            raise ValueError(f"`device` must be 'cuda' or 'cpu', got {device!r}.")
        self.device = device
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self.method = (
            "torch.cuda.set_sync_debug_mode('warn'): synchronising CUDA calls"
            if device == "cuda"
            else "host reads of tensor values seen by a TorchDispatchMode (a CPU has no device synchronisation)"
        )
        self._stack = []

    def record(self) -> None:
        """Attribute one event to the Python stack of its caller."""
        frame = sys._getframe(1)
        site, phase = None, "other"
        while frame is not None:
            module = frame.f_globals.get("__name__") or ""
            if site is None and not _skipped(module):
                filename = os.path.basename(frame.f_code.co_filename)
                site = (_owner(module), f"{filename}:{frame.f_lineno} {frame.f_code.co_name}")
            name = frame.f_code.co_name
            if site is not None and name in _PHASES and _is_trainer(frame.f_locals.get("self")):
                phase = _PHASES[name]
                break
            frame = frame.f_back
        owner, where = site if site is not None else ("torch", "torch")
        self.counts[(owner, phase)] += 1
        self.sites[(owner, phase, where)] += 1

    def __enter__(self) -> SyncCounter:
        if self.device == "cuda":
            catcher = warnings.catch_warnings()
            catcher.__enter__()
            self._stack.append(catcher.__exit__)
            warnings.filterwarnings("always", message=".*synchroniz", category=UserWarning)
            original = warnings.showwarning

            def showwarning(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message):
                    self.record()
                else:
                    original(message, category, filename, lineno, file, line)

            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("warn")
            self._stack.append(lambda *exc: torch.cuda.set_sync_debug_mode(0))
        else:  # what a GPU would synchronise
            mode = _HostReadMode(self)
            mode.__enter__()
            self._stack.append(mode.__exit__)
            for name in ("tolist", "numpy"):
                self._count_calls(name)
        return self

    def _count_calls(self, name: str) -> None:
        """Count each call of the tensor method `name` (a read on the host that the dispatcher does not see)."""
        original = getattr(torch.Tensor, name)
        counter = self

        def counted(tensor, *args, **kwargs):
            counter.record()
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
        self._stack.append(lambda *exc: setattr(torch.Tensor, name, original))

    def __exit__(self, *exc) -> None:
        while self._stack:
            self._stack.pop()(*exc)

    def total(self, owner: str | None = None, phase: str | None = None) -> int:
        """Events of `owner` in `phase` (`None`: any)."""
        return sum(n for (o, p), n in self.counts.items() if owner in (None, o) and phase in (None, p))

    def as_dict(self, top: int = 12) -> dict:
        """For a JSON report: `method`, `by_owner_and_phase` (`{"owner/phase": n}`), the `top` most frequent sites,
        and every site of `trl_grpo_ext`."""

        def rows(items):
            return [{"owner": o, "phase": p, "site": s, "count": n} for (o, p, s), n in items]

        return {
            "method": self.method,
            "by_owner_and_phase": {f"{o}/{p}": n for (o, p), n in sorted(self.counts.items())},
            "top_sites": rows(self.sites.most_common(top)),
            "trl_grpo_ext_sites": rows(item for item in self.sites.most_common() if item[0][0] == "trl_grpo_ext"),
        }


class _HostReadMode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        reads = name in _HOST_READ_OPS
        if name == "index" and len(args) > 1:  # boolean-mask indexing has a data-dependent shape
            reads = any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1] or ())
        if reads:
            self.counter.record()
        return func(*args, **(kwargs or {}))
