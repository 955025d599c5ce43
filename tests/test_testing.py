"""The locally built tiny model and character tokenizer."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_grpo_ext.testing import DEFAULT_ALPHABET, build_char_tokenizer, build_tiny_model, save_tiny


def test_saved_tokenizer_round_trips_every_character_through_auto_tokenizer(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tokenizer(DEFAULT_ALPHABET).input_ids
    assert len(ids) == len(DEFAULT_ALPHABET)
    assert tokenizer.decode(ids) == DEFAULT_ALPHABET
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"


def test_unknown_characters_map_to_unk():
    tokenizer = build_char_tokenizer("ab")
    assert tokenizer("aXb").input_ids == [3, tokenizer.unk_token_id, 4]


def test_vocabulary_padded_to_a_model_size_encodes_as_before_and_decodes_the_extras():
    plain, padded = build_char_tokenizer("ab"), build_char_tokenizer("ab", vocab_size=100)
    assert len(plain) == 5 and len(padded) == 100
    assert padded("abba").input_ids == plain("abba").input_ids == [3, 4, 4, 3]
    assert padded.decode([3, 99, 4, padded.eos_token_id], skip_special_tokens=True) == "a<extra_94>b"
    with pytest.raises(ValueError, match=r"`vocab_size` \(4\) is smaller than the 5 tokens"):
        build_char_tokenizer("ab", vocab_size=4)


def test_empty_alphabet_is_refused():
    with pytest.raises(ValueError, match="`alphabet` is empty"):
        build_char_tokenizer("")


def test_same_seed_same_weights_and_the_global_rng_is_untouched():
    tokenizer = build_char_tokenizer("abc")
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = build_tiny_model(tokenizer, seed=7)
    assert torch.rand(1) == expected_next
    second = build_tiny_model(tokenizer, seed=7)
    other = build_tiny_model(tokenizer, seed=8)
    weight = "model.embed_tokens.weight"
    assert torch.equal(first.state_dict()[weight], second.state_dict()[weight])
    assert not torch.equal(first.state_dict()[weight], other.state_dict()[weight])


def test_saved_folder_loads_as_a_causal_lm_that_generates(tmp_path):
    path = save_tiny(tmp_path / "m", alphabet="abc", hidden_size=16)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) == 6
    out = model.generate(**tokenizer(["ab"], return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= 2 + 3
