"""The SLURM launcher's vLLM server: vLLM's own `vllm serve`, with the arguments TRL's deprecated `trl vllm-serve`
passes, loading the model as the recipe does, and composed without TRL's script (which TRL 2.0 removes). Checked
through `--dry-run`."""

import os
import shlex
import sys

import pytest
from helpers import REPO
from trl.scripts import vllm_serve

from trl_grpo_ext.tools import cli
from trl_grpo_ext.tools.recipes import slurm

ZERO2 = os.path.join("recipes", "accelerate_configs", "zero2.yaml")
THREE_NODES = {"SLURM_JOB_NODELIST": "node[01-03]", "SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "8"}


@pytest.fixture
def job(monkeypatch, tmp_path):
    """A fake allocation of three nodes; returns a function that writes a recipe config and dry-runs the launcher
    on it, giving the server command split as a shell splits it."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)  # no scontrol: the launcher reads the host list
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    for name, value in THREE_NODES.items():
        monkeypatch.setenv(name, value)

    def server_command(config: str, *flags: str, capsys) -> list[str]:
        path = tmp_path / "recipe.yaml"
        path.write_text(config)
        assert cli.main(["slurm", "--dry-run", "--config", str(path), "--accelerate_config", ZERO2, *flags]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "# vLLM server on node03"
        return shlex.split(lines[1])

    return server_command


def test_the_server_is_vllm_serve_as_trl_runs_it(job, capsys):
    server = job("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\n", capsys=capsys)
    assert server[:4] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=node03"]
    assert server[4:9] == ["env", "VLLM_SERVER_DEV_MODE=1", "vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct"]
    # What TRL's deprecated `trl vllm-serve` would exec for the same arguments, from `serve` on.
    trl_command = vllm_serve.build_command(vllm_serve.ScriptArguments(model="Qwen/Qwen2.5-0.5B-Instruct", port=8000))
    assert server[6:] == ["vllm", *trl_command[trl_command.index("serve") :]]
    assert server[server.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert server[server.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert server[server.index("--max-logprobs") + 1] == "-1"
    # Nothing the recipe does not set: the server's own defaults.
    assert "--trust-remote-code" not in server and "--revision" not in server and "--max-model-len" not in server
    assert server[server.index("--dtype") + 1] == "auto"


@pytest.mark.parametrize("vllm_version", [None, "0.22.0", "0.30.0", "0.31.0"])
@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"revision": "v2", "trust_remote_code": True, "dtype": "bfloat16", "max_model_len": 4096},
        {"tensor_parallel_size": 2, "data_parallel_size": 4, "vllm_model_impl": "transformers"},
    ],
)
def test_the_command_is_the_one_trl_s_wrapper_composes(arguments, vllm_version, monkeypatch):
    """`trl vllm-serve`'s `build_command` (TRL 1.12 to 1.x), with the same arguments and vLLM release (it adds
    `--enable-scale-out` from vLLM 0.30): the same command from `serve` on."""
    monkeypatch.setattr(vllm_serve, "is_vllm_available", lambda min_version=None: vllm_version is not None and (
        tuple(map(int, vllm_version.split("."))) >= tuple(map(int, min_version.split(".")))
    ))  # fmt: skip
    arguments = {"model": "org/model", "port": 8123, **arguments}
    ours = slurm.vllm_server_command(arguments, vllm_version=vllm_version)
    trl_command = vllm_serve.build_command(vllm_serve.ScriptArguments(**arguments))
    assert ours[:3] == ["env", "VLLM_SERVER_DEV_MODE=1", "vllm"]
    assert ours[3:] == trl_command[trl_command.index("serve") :]


def test_the_server_command_needs_no_trl_script(job, capsys, monkeypatch):
    """TRL 2.0 removes `trl vllm-serve` (`trl/scripts/vllm_serve.py`): the launcher composes the same command."""
    with_script = job("model_name_or_path: org/custom-model\ntrust_remote_code: true\n", capsys=capsys)
    monkeypatch.setitem(sys.modules, "trl.scripts.vllm_serve", None)  # `import` of it now fails
    with pytest.raises(ImportError):
        import trl.scripts.vllm_serve  # noqa: F401
    assert job("model_name_or_path: org/custom-model\ntrust_remote_code: true\n", capsys=capsys) == with_script


def test_the_server_loads_the_model_as_the_config_says(job, capsys):
    config = (
        "model_name_or_path: org/custom-model\n"
        "model_revision: v2\n"
        "trust_remote_code: true\n"
        "dtype: bfloat16\n"
        "vllm_model_impl: transformers\n"
        "vllm_max_model_length: 4096\n"
    )
    server = job(config, capsys=capsys)
    assert server[8] == "org/custom-model" and "--trust-remote-code" in server
    for flag, value in (
        ("--revision", "v2"),
        ("--dtype", "bfloat16"),
        ("--model-impl", "transformers"),
        ("--max-model-len", "4096"),
    ):
        assert server[server.index(flag) + 1] == value, flag


def test_flags_set_the_server_as_they_set_the_recipe(job, capsys):
    server = job(
        "model_name_or_path: org/custom-model\ntrust_remote_code: false\n",
        "--trust_remote_code",
        "--dtype",
        "float16",
        "--model_revision=abc",
        capsys=capsys,
    )
    assert "--trust-remote-code" in server  # a standalone boolean flag is true, as the recipe parses it
    assert server[server.index("--dtype") + 1] == "float16" and server[server.index("--revision") + 1] == "abc"


def test_an_unknown_recipe_flag_names_the_nearest_field(job, capsys):
    with pytest.raises(ValueError, match=r"Unknown flag --max_step \(did you mean --max_steps\?\)"):
        job("model_name_or_path: m\n", "--max_step", "10", capsys=capsys)


def test_the_configs_and_docs_start_the_server_with_vllm_serve_and_what_trl_s_trainer_needs():
    """The real-model configs and docs/recipes.md show the server as `vllm serve`, with the arguments TRL's wrapper
    passes, not `trl vllm-serve` (deprecated, removed in TRL 2.0)."""
    import glob

    import yaml

    configs = sorted(glob.glob(os.path.join(REPO, "recipes", "*", "grpo", "*.yaml")))
    shown = 0
    for path in configs:
        with open(path) as handle:
            text = handle.read()
        flowing = " ".join(text.replace("\\\n#", " ").replace("\n#", " ").split())
        assert "trl vllm-serve" not in text, path
        if "vllm_mode: server" not in text:
            continue
        shown += 1
        model = yaml.safe_load(text)["model_name_or_path"]
        command = f"VLLM_SERVER_DEV_MODE=1 vllm serve {model} {shlex.join(slurm.TRAINER_SERVER_FLAGS)}"
        assert command in flowing, path
    assert shown >= 2
    with open(os.path.join(REPO, "docs", "recipes.md")) as handle:
        docs = " ".join(handle.read().split())
    command = f"VLLM_SERVER_DEV_MODE=1 vllm serve <model> {shlex.join(slurm.TRAINER_SERVER_FLAGS)}"
    assert command in docs.replace("`", "")
