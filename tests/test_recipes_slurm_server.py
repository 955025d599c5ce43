"""The SLURM launcher's vLLM server: vLLM's own where the installed TRL deprecated `trl vllm-serve`, `trl vllm-serve`
elsewhere, loading the model as the recipe does. Checked through `--dry-run`."""

import os
import shlex

import pytest
from helpers import REPO
from trl.scripts import vllm_serve

from trl_grpo_ext.recipes import cli, slurm

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


def test_the_installed_trl_has_deprecated_trl_vllm_serve():
    """Every supported TRL (1.14-1.16) only runs vLLM's own server behind `trl vllm-serve`."""
    assert slurm.trl_vllm_serve_is_deprecated() and hasattr(vllm_serve, "build_command")


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


def test_trl_vllm_serve_where_trl_has_not_deprecated_it(job, capsys, monkeypatch):
    monkeypatch.setattr(slurm, "trl_vllm_serve_is_deprecated", lambda: False)
    server = job(
        "model_name_or_path: org/custom-model\ntrust_remote_code: true\ndtype: bfloat16\nmodel_revision: v2\n",
        "--vllm_tensor_parallel_size",
        "2",
        capsys=capsys,
    )
    assert server[4:6] == ["trl", "vllm-serve"]
    # The arguments parse as `trl vllm-serve`'s own (TRL's ScriptArguments for that command).
    from trl import TrlParser

    (parsed,) = TrlParser(vllm_serve.ScriptArguments).parse_args_and_config(server[6:])
    assert (parsed.model, parsed.revision, parsed.dtype) == ("org/custom-model", "v2", "bfloat16")
    assert parsed.trust_remote_code is True and parsed.tensor_parallel_size == 2 and parsed.port == 8000


def test_an_unknown_recipe_flag_names_the_nearest_field(job, capsys):
    with pytest.raises(ValueError, match=r"Unknown flag --max_step \(did you mean --max_steps\?\)"):
        job("model_name_or_path: m\n", "--max_step", "10", capsys=capsys)
