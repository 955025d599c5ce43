"""Loading recipe datasets from local folders and files, and turning rows into prompts."""

import json

import pytest

from trl_grpo_ext.tools.recipes.data import load_recipe_dataset
from trl_grpo_ext.tools.recipes.rewards import gsm8k_accuracy


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def reversal_folder(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "abc=", "solution": "cba"}, {"prompt": "ab=", "solution": "ba"}])
    write_jsonl(tmp_path / "test.jsonl", [{"prompt": "de=", "solution": "ed"}])
    return tmp_path


def test_a_local_folder_gives_its_splits(reversal_folder):
    dataset = load_recipe_dataset(str(reversal_folder))
    assert sorted(dataset) == ["test", "train"]
    assert dataset["train"][0] == {"prompt": "abc=", "solution": "cba"}


def test_a_single_file_is_the_train_split(reversal_folder):
    dataset = load_recipe_dataset(str(reversal_folder / "train.jsonl"))
    assert list(dataset) == ["train"] and len(dataset["train"]) == 2


def test_gsm8k_rows_become_prompt_and_solution(tmp_path):
    answer = "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"
    write_jsonl(tmp_path / "train.jsonl", [{"question": "How many apples?", "answer": answer}])
    dataset = load_recipe_dataset(str(tmp_path), dataset_format="gsm8k", system_prompt="Think, then answer.")
    row = dataset["train"][0]
    assert row["solution"] == "7"
    assert row["prompt"] == [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": "How many apples?"},
    ]
    assert gsm8k_accuracy(["<answer>7</answer>"], solution=[row["solution"]]) == [1.0]


@pytest.mark.parametrize(
    ("setup", "kwargs", "message"),
    [
        ("no_prompt", {}, r"has no column \['prompt'\].*its columns are \['text'\]"),
        ("empty", {}, "Cannot load dataset.*no data"),
        ("ok", {"dataset_format": "alpaca"}, "Unknown dataset_format"),
        ("ok", {"required_splits": ["validation"]}, "has no split 'validation'"),
        ("csv_name", {}, "Cannot read dataset file"),
    ],
)
def test_bad_datasets_get_a_clear_error(tmp_path, setup, kwargs, message):
    if setup == "no_prompt":
        write_jsonl(tmp_path / "train.jsonl", [{"text": "abc"}])
    elif setup == "empty":
        (tmp_path / "train.jsonl").write_text("")
        (tmp_path / "train.csv").write_text("prompt,solution\n")
        (tmp_path / "train.jsonl").unlink()
    elif setup == "ok":
        write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a"}])
    elif setup == "csv_name":
        (tmp_path / "data.txt").write_text("x")
    name = str(tmp_path / "data.txt") if setup == "csv_name" else str(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_recipe_dataset(name, **kwargs)


@pytest.mark.parametrize(
    ("row", "fix"),
    [
        (
            {"question": "2+2?", "answer": "#### 4"},
            "Fix: set dataset_format: gsm8k (it reads question, answer); rename the column that holds the prompts to "
            "`prompt` (e.g. `dataset.rename_column('question', 'prompt')` before saving it); or add a format of your "
            "own to DATASET_FORMATS (known: ['gsm8k', 'prompt']).",
        ),
        (
            {"instruction": "Say hi."},
            "Fix: rename the column that holds the prompts to `prompt` (e.g. `dataset.rename_column('instruction', "
            "'prompt')` before saving it); or add a format of your own to DATASET_FORMATS (known: ['gsm8k', "
            "'prompt']).",
        ),
    ],
)
def test_a_dataset_without_a_prompt_column_names_the_fix(tmp_path, row, fix):
    """The error named the missing column only, not what to do: rename a column, or pick the format that reads it."""
    write_jsonl(tmp_path / "train.jsonl", [row])
    with pytest.raises(ValueError) as error:
        load_recipe_dataset(str(tmp_path))
    assert str(error.value).endswith(fix)


def test_a_missing_name_is_an_error():
    with pytest.raises(ValueError, match="Set `dataset_name`"):
        load_recipe_dataset(None)
