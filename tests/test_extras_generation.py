"""Held-out evaluation samples exactly as `trl.GRPOTrainer` does during training (`trl_grpo_ext.extras.generation`);
the recipe's held-out scores (`benchmarks.reversal.sampled_reward_means`) average over those samples."""

import pytest
from datasets import Dataset
from helpers import count_a_reward, make_trainer, tiny_grpo_args
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.reversal import sampled_reward_means
from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt
from trl_grpo_ext.extras.generation import SamplingSettings, eos_token_ids, generate_completions, tokenize_prompts
from trl_grpo_ext.testing import build_char_tokenizer, build_tiny_model

# Renders the messages, then "!" when the template variable `shout` is set, then "=" as the generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if shout %}!{% endif %}{% if add_generation_prompt %}={% endif %}"
)
PLAIN = ["abc=", "hello=", "xyz=", "qq="]
CHAT = [[{"role": "user", "content": prompt[:-1]}] for prompt in PLAIN]


@pytest.fixture(scope="module")
def bos_model_path(tmp_path_factory) -> str:
    """A tiny model whose tokenizer adds a BOS token to plain text (as Llama's does) and has a chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    path = str(tmp_path_factory.mktemp("bos_model"))
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("prompts", [PLAIN, CHAT], ids=["plain", "conversational"])
def test_prompts_reach_generate_as_trl_tokenises_them(prompts, bos_model_path, tmp_path):
    trainer = make_trainer(
        tmp_path,
        AutoModelForCausalLM.from_pretrained(bos_model_path),
        AutoTokenizer.from_pretrained(bos_model_path),
        Dataset.from_dict({"prompt": prompts * 4}),
        chat_template_kwargs={"shout": True},
    )
    tokenizer, model = trainer.processing_class, trainer.model
    expected = trainer._tokenize_prompts(prompts)[0]  # what training feeds `generate`
    if prompts is PLAIN:
        assert all(ids[0] == tokenizer.bos_token_id for ids in expected)  # the special token TRL adds
    else:
        assert tokenizer.decode(expected[0]) == "abc!="  # chat template, its variables, generation prompt
    settings = SamplingSettings.from_config(trainer.args)
    assert tokenize_prompts(tokenizer, prompts, settings.chat_template_kwargs) == expected

    seen = []
    original = model.generate

    def recording_generate(**kwargs):
        seen.extend(
            ids[mask.bool()].tolist() for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"], strict=True)
        )
        return original(**kwargs)

    model.generate = recording_generate
    generate_completions(model, tokenizer, prompts, settings, seed=0)
    assert seen == expected


def test_extras_settings_build_the_generation_config_trl_trains_with(tiny_model_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    end_of_turn = tokenizer.convert_tokens_to_ids("!")
    model.generation_config.eos_token_id = [end_of_turn]  # e.g. <|im_end|>, beside the tokenizer's EOS
    args = GRPOConfigExt(
        **tiny_grpo_args(
            tmp_path,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.05,
            repetition_penalty=1.3,
            generation_kwargs={"no_repeat_ngram_size": 3, "top_k": 7},
            max_completion_length=6,
        )
    )
    trainer = GRPOTrainerExt(
        model=model,
        reward_funcs=count_a_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PLAIN * 4}),
        processing_class=tokenizer,
    )
    ours = SamplingSettings.from_config(args).generation_config(model, tokenizer)
    assert ours.to_dict() == trainer.generation_config.to_dict()
    assert eos_token_ids(model, tokenizer) == trainer.eos_token_ids == [tokenizer.eos_token_id, end_of_turn]
    assert (ours.min_p, ours.repetition_penalty, ours.top_k, ours.no_repeat_ngram_size) == (0.05, 1.3, 7, 3)


def test_extras_settings_refuse_a_config_without_sampling_fields():
    with pytest.raises(ValueError, match="no field 'max_completion_length'"):
        SamplingSettings.from_config(object())


def test_generation_stops_at_the_models_end_of_turn_ids(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    vowels = "aeiou"
    prompts = [word + "=" for word in ("abc", "hello", "xyz", "qq", "tree", "moon", "sky", "dog")] * 4
    settings = SamplingSettings(max_completion_length=12)

    def vowel_inside(completions):
        return any(letter in completion[:-1] for completion in completions for letter in vowels)

    # With the tokenizer's EOS alone, this random model writes vowels mid-completion...
    assert vowel_inside(generate_completions(model, tokenizer, prompts, settings, seed=0))
    # ...so when the model declares them end-of-turn ids, a completion ends at its first vowel, as in training.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(list(vowels))
    ids_seen = []

    def record_ids(completions, completion_ids, **kwargs):
        ids_seen.extend(completion_ids)
        return [0.0] * len(completions)

    completions = generate_completions(model, tokenizer, prompts, settings, seed=0)
    assert not vowel_inside(completions)
    assert any(completion[-1:] in vowels for completion in completions)  # the stops were reached
    sampled_reward_means(model, tokenizer, [{"prompt": p} for p in prompts], [record_ids], settings, seed=0)
    stops = set(model.generation_config.eos_token_id)
    assert all(not stops & set(ids[:-1]) for ids in ids_seen)


def test_conversational_prompts_get_conversational_completions(bos_model_path):
    tokenizer = AutoTokenizer.from_pretrained(bos_model_path)
    model = AutoModelForCausalLM.from_pretrained(bos_model_path)
    settings = SamplingSettings(max_completion_length=8)
    completions = generate_completions(model, tokenizer, CHAT, settings, seed=0)
    assert all(
        isinstance(completion, list) and len(completion) == 1 and completion[0]["role"] == "assistant"
        for completion in completions
    )

    def content_length(completions, **kwargs):  # the TRL documentation's way to read a chat completion
        return [float(len(completion[0]["content"])) for completion in completions]

    def has_solution(completions, solution, trainer_state, log_metric, **kwargs):
        log_metric("seen", 1.0)
        return [
            float(answer in completion[0]["content"]) for completion, answer in zip(completions, solution, strict=True)
        ]

    rows = [{"prompt": prompt, "solution": "a"} for prompt in CHAT]
    means = sampled_reward_means(model, tokenizer, rows, [content_length, has_solution], settings, seed=0)
    lengths = [len(completion[0]["content"]) for completion in completions]
    assert means["content_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert means["has_solution"] == pytest.approx(
        sum("a" in completion[0]["content"] for completion in completions) / len(completions)
    )


def test_async_reward_functions_and_unscored_completions(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)

    async def half_scored(completions, **kwargs):
        return [1.0 if index % 2 else None for index in range(len(completions))]

    rows = [{"prompt": prompt} for prompt in PLAIN]
    means = sampled_reward_means(model, tokenizer, rows, [half_scored], SamplingSettings(max_completion_length=4))
    assert means == {"half_scored": 1.0}
    with pytest.raises(ValueError, match="No prompts"):
        generate_completions(model, tokenizer, [])
