"""Tiny model and tokenizer builders, built locally (no Hub access), for tests, the demo and CPU trials:
`save_tiny(folder)` writes a model and tokenizer that `from_pretrained` and TRL's trainers accept."""

from __future__ import annotations

import os
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

__all__ = ["DEFAULT_ALPHABET", "build_char_tokenizer", "build_tiny_model", "save_tiny"]

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " =+-*/:.,?!"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of `alphabet`, plus `<pad>`, `<eos>` and `<unk>`.

    Pads on the left (what generation needs). Decoding joins the characters back without spaces, so
    `decode(encode(text)) == text` for any text made of `alphabet`.

    Args:
        alphabet (`str`): the characters, each becoming one token (duplicates are ignored).
        vocab_size (`int`, *optional*): pad the vocabulary to this size with tokens `<extra_0>`, `<extra_1>`, ...
            so that it matches a model's embedding table (e.g. a real model's configuration). Encoding never
            produces them (text is split into single characters); a model that samples one decodes to its name.

    Returns:
        `transformers.PreTrainedTokenizerFast`
    """
    characters = list(dict.fromkeys(alphabet))
    if not characters:
        raise ValueError("`alphabet` is empty.")
    tokens = [PAD, EOS, UNK, *characters]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(
                f"`vocab_size` ({vocab_size}) is smaller than the {len(tokens)} tokens of the alphabet and specials."
            )
        tokens += [f"<extra_{index}>" for index in range(vocab_size - len(tokens))]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One pre-token per character: splitting on every single character, kept as its own piece.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        truncation_side="left",
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 32,
    intermediate_size: int | None = None,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 128,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 causal LM (Qwen2 plus query/key norms) sized for `tokenizer`, tied embeddings.

    Qwen3 rather than Qwen2: `AutoTokenizer` forces Qwen2's byte-level tokenizer class onto any `qwen2` checkpoint,
    which drops the spaces of a character vocabulary, while for `qwen3` it keeps the saved tokenizer as it is.

    Args:
        tokenizer: gives the vocabulary size and the pad/eos ids.
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
        max_position_embeddings: the Qwen3 configuration (intermediate size defaults to 4 * hidden, head_dim to
            hidden / heads as in Qwen2, where Qwen3's own default is 128).
        seed (`int`): seed of the weight initialisation; the same seed gives the same weights.

    Returns:
        `transformers.Qwen3ForCausalLM` in float32, eval mode.
    """
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model.eval()


def save_tiny(path: str | os.PathLike, alphabet: str = DEFAULT_ALPHABET, **model_kwargs) -> str:
    """Build the tokenizer and model and save both to `path`, a folder usable as a model id.

    TRL rebuilds the reference model from the policy's `name_or_path`, so an in-memory model needs a folder.

    Args:
        path: the output folder (created if needed).
        alphabet: see `build_char_tokenizer`.
        **model_kwargs: see `build_tiny_model`.

    Returns:
        `str`: `path`.
    """
    path = os.fspath(path)
    tokenizer = build_char_tokenizer(alphabet)
    model = build_tiny_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
