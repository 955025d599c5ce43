"""The build of torch the set-up installs: the CPU build where no NVIDIA driver is found, PyPI's CUDA build if one is.

    python3 tools/torch_build.py pip       # the arguments of `pip install` that install that build of torch
    python3 tools/torch_build.py uv-run    # the arguments of `uv run` that give a script's environment that build
    python3 tools/torch_build.py explain   # one line: what was found, what is installed

On Linux, PyPI's `torch` wheel is a CUDA build that pulls about 2.7 GB of `nvidia-*` packages, of no use on a machine
without a GPU; PyTorch's CPU index has the same release as `+cpu` (about 200 MB). uv's `--torch-backend=auto` makes
the same choice for `uv pip`, but `uv run` and the PEP 723 headers it reads have no such setting (PEP 508 markers
name the platform, not its devices), hence these arguments. A CPU wheel of the release that pip already finds in a
local folder (`PIP_FIND_LINKS`) is installed from there, without the index.

Settings (environment variables, as the Makefile passes them):
    TORCH_BACKEND   `auto` (default: look for a driver), `cpu` or `cuda`.
    TORCH_INDEX     an index to take torch from, whatever the machine (e.g. https://download.pytorch.org/whl/cu128).

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass

TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Where a loaded NVIDIA kernel driver shows itself on Linux, and its command-line tool.
DRIVER_PROC = "/proc/driver/nvidia"
DRIVER_TOOL = "nvidia-smi"
BACKENDS = ("auto", "cpu", "cuda")
#: uv's `--exclude-newer-package` value that leaves no registry release of torch: the one in `--find-links` only.
LOCAL_ONLY = "torch=1970-01-01T00:00:00Z"


@dataclass(frozen=True)
class TorchBuild:
    """One build of torch and where it comes from.

    Args:
        requirement (`str`): what pip is asked for, e.g. `torch==2.13.0+cpu`.
        index_url (`str`, *optional*): the index that replaces PyPI for torch and its dependencies; `None` keeps the
            configured index.
        find_links (`str`, *optional*): a local folder that holds the wheel (no index needed).
        reason (`str`): why this build, in a few words.
    """

    requirement: str
    index_url: str | None
    find_links: str | None
    reason: str

    def pip_args(self) -> list[str]:
        """The arguments of `pip install` for this build."""
        return [self.requirement] + (["--index-url", self.index_url] if self.index_url else [])

    def uv_run_args(self) -> list[str]:
        """The arguments of `uv run` that resolve a script's torch to this build (none for PyPI's).

        uv keeps PyPI for everything else; the best match over both indexes takes `+cpu`, a higher version than
        PyPI's build of the same release. A local folder holds one release, and uv takes the highest it finds: every
        release of torch on a registry is excluded (an upload date before any), so that PyPI's newer CUDA builds do
        not win over the folder's CPU wheel.
        """
        if self.find_links:
            return ["--find-links", self.find_links, "--exclude-newer-package", LOCAL_ONLY]
        if self.index_url:
            return ["--index", self.index_url, "--index-strategy", "unsafe-best-match"]
        return []


def find_nvidia_driver(path: str | None = None, proc_dir: str = DRIVER_PROC) -> str | None:
    """Where an NVIDIA driver shows itself, or `None`.

    Args:
        path (`str`, *optional*): the search path for `nvidia-smi` (default: `PATH`).
        proc_dir (`str`): the kernel driver's folder under `/proc`.

    Returns:
        `str` or `None`: the path that gave the driver away.
    """
    if os.path.isdir(proc_dir):
        return proc_dir
    return shutil.which(DRIVER_TOOL, path=path)


def find_local_cpu_wheel(find_links: str | None, version: str = TORCH_VERSION) -> str | None:
    """The folder among `find_links` (pip's `PIP_FIND_LINKS`, space-separated) with a CPU wheel of torch `version`
    for this Python, or `None`."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in (find_links or "").split():
        folder = folder.removeprefix("file://")
        if os.path.isdir(folder) and glob.glob(os.path.join(folder, f"torch-{version}+cpu-{tag}-*.whl")):
            return folder
    return None


def choose(
    backend: str = "auto",
    index_url: str | None = None,
    find_links: str | None = None,
    system: str | None = None,
    driver: str | None = None,
    version: str = TORCH_VERSION,
) -> TorchBuild:
    """The build of torch for a machine.

    Args:
        backend (`str`): `auto` (CUDA where `driver` is set), `cpu` or `cuda`.
        index_url (`str`, *optional*): an index chosen by hand; it wins over everything else.
        find_links (`str`, *optional*): pip's local folders (`PIP_FIND_LINKS`).
        system (`str`, *optional*): `platform.system()` (default: this machine's).
        driver (`str`, *optional*): where an NVIDIA driver was found (`find_nvidia_driver()`), `None` for none.
        version (`str`): the torch release.

    Returns:
        `TorchBuild`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"TORCH_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
    pinned = f"torch=={version}"
    if index_url:
        return TorchBuild(pinned, index_url, None, f"TORCH_INDEX={index_url}")
    system = system or platform.system()
    if system != "Linux":
        # PyPI's macOS and Windows wheels are CPU builds already.
        return TorchBuild(pinned, None, None, f"{system}: PyPI's build")
    if backend == "cuda" or (backend == "auto" and driver):
        why = "TORCH_BACKEND=cuda" if backend == "cuda" else f"NVIDIA driver found ({driver})"
        return TorchBuild(pinned, None, None, f"{why}: PyPI's CUDA build")
    why = "TORCH_BACKEND=cpu" if backend == "cpu" else f"no NVIDIA driver found ({DRIVER_TOOL}, {DRIVER_PROC})"
    local = find_local_cpu_wheel(find_links, version)
    if local:
        return TorchBuild(f"{pinned}+cpu", None, local, f"{why}: the CPU build in {local}")
    return TorchBuild(f"{pinned}+cpu", CPU_INDEX, None, f"{why}: the CPU build from {CPU_INDEX}")


def build_from_environment(environ: Mapping[str, str] = os.environ) -> TorchBuild:
    """`choose()` for this machine, with `TORCH_BACKEND`, `TORCH_INDEX` and `PIP_FIND_LINKS` from `environ`."""
    backend = environ.get("TORCH_BACKEND") or "auto"
    driver = find_nvidia_driver(environ.get("PATH")) if backend == "auto" else None
    return choose(backend, environ.get("TORCH_INDEX") or None, environ.get("PIP_FIND_LINKS"), driver=driver)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module's docstring); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ("pip", "uv-run", "explain"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        build = build_from_environment()
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if argv[0] == "explain":
        print(f"torch: {build.requirement}, {build.reason}")
    else:
        print(" ".join(build.pip_args() if argv[0] == "pip" else build.uv_run_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
