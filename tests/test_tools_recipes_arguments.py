"""The recipe's `--help`: short (the recipe's and this package's fields, the usual ones of TRL, transformers and the
model, each once), ending with how to see everything; `--help-all`: every flag in full; parsing the same for all;
the check of `model_name_or_path` that fails before any Hub request."""

import os
import re
from dataclasses import fields

import pytest
from trl import ModelConfig

from trl_grpo_ext import GRPOConfigExt
from trl_grpo_ext.tools import cli
from trl_grpo_ext.tools.recipes import grpo
from trl_grpo_ext.tools.recipes.arguments import (
    USUAL_MODEL_FIELDS,
    USUAL_TRAINING_FIELDS,
    ConfigError,
    check_model_is_local_or_hub,
    make_parser,
)

#: The fields declared by GRPOConfigExt itself (its own, and TRL's whose default it changes).
OWN_FIELDS = set(vars(GRPOConfigExt)["__annotations__"])
RECIPE_FIELDS = {field.name for field in fields(grpo.GRPOScriptArguments)}


@pytest.fixture(autouse=True)
def terminal_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width


def listed_flags(text: str) -> list[str]:
    """The flags a help text lists, in order: those that begin a line."""
    return re.findall(r"^ +(--[\w-]+)", text, flags=re.MULTILINE)


def help_of(command: str, flag: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, flag])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_each_usual_field_is_a_field_of_its_config_once():
    assert set(USUAL_TRAINING_FIELDS) <= {field.name for field in fields(GRPOConfigExt)}
    assert set(USUAL_MODEL_FIELDS) <= {field.name for field in fields(ModelConfig)}
    assert len(set(USUAL_TRAINING_FIELDS)) == len(USUAL_TRAINING_FIELDS)
    assert len(set(USUAL_MODEL_FIELDS)) == len(USUAL_MODEL_FIELDS)


@pytest.mark.parametrize("command", ["grpo", "demo"])
def test_help_is_short_lists_the_recipe_this_package_and_the_usual_fields_once_and_ends_with_help_all(command, capsys):
    text = help_of(command, "--help", capsys)
    # every flag, in full, is about 1,400 lines; these ~100 fields with their first sentences whole, about 380 at 80
    # columns (pytest's width)
    assert len(text.splitlines()) < 420
    flags = listed_flags(text)
    assert len(flags) == len(set(flags))
    # Each field by its own name: a boolean is not listed again as --no_<field>.
    expected = RECIPE_FIELDS | OWN_FIELDS | set(USUAL_TRAINING_FIELDS) | set(USUAL_MODEL_FIELDS)
    assert set(flags) == {f"--{name}" for name in expected} | {"--help-all"}
    assert text.splitlines()[-1] == f"Every field, in full: trl-grpo-ext {command} --help-all"


def test_help_all_lists_every_flag_with_its_whole_help_text(capsys):
    short = help_of("grpo", "--help", capsys)
    text = help_of("grpo", "--help-all", capsys)
    parser = make_parser(grpo.GRPOScriptArguments)
    every_flag = {action.option_strings[0] for action in parser._actions if action.option_strings} - {"-h"}
    assert set(listed_flags(text)) == every_flag and len(text.splitlines()) > 1000
    assert {"--no_padding_free", "--weight_decay", "--lora_dropout"} <= every_flag - set(listed_flags(short))
    whole = next(field for field in fields(GRPOConfigExt) if field.name == "console").metadata["help"]
    assert " ".join(whole.split()) in " ".join(text.split())
    assert " ".join(whole.split()) not in " ".join(short.split())


def test_a_flag_left_out_of_help_still_parses_and_help_all_is_no_field():
    script_args, training_args, model_args = grpo.parse_args(
        ["--weight_decay", "0.1", "--no_padding_free", "--lora_dropout", "0.2", "--padding_free_row_tokens", "64"]
    )
    assert (training_args.weight_decay, training_args.padding_free, model_args.lora_dropout) == (0.1, False, 0.2)
    assert training_args.padding_free_row_tokens == 64
    assert "help_all" not in make_parser(grpo.GRPOScriptArguments).known_keys()


def _no_hub(monkeypatch):
    """Make every Hub request fail the test: the checks below must decide without one."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("a Hub request was attempted")

    for name in ("hf_hub_download", "snapshot_download", "model_info"):
        monkeypatch.setattr(huggingface_hub, name, refuse)
        monkeypatch.setattr(f"huggingface_hub.file_download.{name}", refuse, raising=False)
        monkeypatch.setattr(f"transformers.utils.hub.{name}", refuse, raising=False)


def _isolated_hub(tmp_path, monkeypatch, offline: bool):
    """No Hub request (`_no_hub`), an empty Hub cache, `tmp_path` as the working folder, `HF_HUB_OFFLINE` as given."""
    _no_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", offline)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))


def test_a_relative_model_path_missing_from_the_working_folder_fails_at_once_naming_it(tmp_path, monkeypatch):
    _no_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    with pytest.raises(ConfigError) as error:
        check_model_is_local_or_hub("trl_grpo_ext/tools/recipes/tiny/base_model")
    message = str(error.value)
    assert "'trl_grpo_ext/tools/recipes/tiny/base_model'" in message and f"resolved against {tmp_path}" in message
    assert "absolute path" in message


def test_offline_a_name_neither_local_nor_cached_fails_at_once(tmp_path, monkeypatch):
    _no_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        check_model_is_local_or_hub("tiny/base_model")


def test_a_name_neither_local_nor_cached_fails_at_once_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    _isolated_hub(tmp_path, monkeypatch, offline=False)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)

    def unreachable(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr("socket.create_connection", unreachable)
    with pytest.raises(ConfigError, match=r"the Hub \(https://huggingface.co\) cannot be reached"):
        check_model_is_local_or_hub("tiny/base_model")


def test_a_hub_id_online_and_a_local_folder_pass_untouched(tmp_path, monkeypatch):
    _isolated_hub(tmp_path, monkeypatch, offline=False)
    monkeypatch.setattr("trl_grpo_ext.tools.recipes.arguments._hub_reachable", lambda endpoint: True)
    check_model_is_local_or_hub("Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "models" / "mine").mkdir(parents=True)
    check_model_is_local_or_hub("models/mine")
    check_model_is_local_or_hub("./models/mine")


def test_the_recipe_refuses_a_missing_relative_model_path_before_transformers_loads_it(tmp_path, monkeypatch, capsys):
    _no_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    data = os.path.join(os.path.dirname(grpo.__file__), "tiny", "data")
    argv = ["--model_name_or_path", "trl_grpo_ext/tools/recipes/tiny/base_model", "--dataset_name", data]
    argv += ["--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert grpo.run(argv, prog="grpo") == 2
    err = capsys.readouterr().err
    assert "No model folder at model_name_or_path='trl_grpo_ext/tools/recipes/tiny/base_model'" in err
