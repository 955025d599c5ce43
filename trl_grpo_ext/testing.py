"""What tests, the demo and CPU trials need, built locally (no Hub access):

- tiny model and tokenizer builders: a causal LM and a character-level tokenizer;

      from trl_grpo_ext.testing import build_char_tokenizer, build_tiny_model, save_tiny
      path = save_tiny("/tmp/tiny")          # a folder that `from_pretrained` and TRL's trainers accept

- `reuse_vllm_engine`, which lets trainers built one after another in a process share TRL's colocated engine (tests
  and CPU trials);
- the CPU shims of `cpu_engines`, for tests and benchmarks: `enable_sharded_engines_on_cpu` (FSDP2 and DeepSpeed ZeRO
  on CPU processes) and `enable_vllm_on_cpu` (TRL's weight sync into vLLM's CPU engine).

A GPU run never needs the CPU shims.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import string
from collections.abc import Iterator

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from .cpu_engines import VLLM_ON_CPU_ENV, enable_sharded_engines_on_cpu, enable_vllm_on_cpu, requested_engine

__all__ = [
    "DEFAULT_ALPHABET",
    "VLLM_ON_CPU_ENV",
    "build_char_tokenizer",
    "build_tiny_model",
    "enable_sharded_engines_on_cpu",
    "enable_vllm_on_cpu",
    "requested_engine",
    "reuse_vllm_engine",
    "save_tiny",
]

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


#: The engine that `reuse_vllm_engine` shares, with the settings it was built with: at most one per process.
_SHARED_ENGINE: dict = {}
_SHARING = "_trl_grpo_ext_shared_engine"


@contextlib.contextmanager
def reuse_vllm_engine(max_num_seqs: int = 256) -> Iterator[None]:
    """Inside the block, TRL trainers in colocate mode (`use_vllm=True, vllm_mode="colocate"`) share one vLLM engine.

    TRL builds a `vllm.LLM` in each trainer's constructor, and a colocated engine can be built only once per process
    (a second one fails with `Default process group has not been initialized`). For tests and CPU trials that train
    several runs in one process: the first trainer builds the engine, later ones get the same engine, and each pushes
    its own weights into it at its first generation (TRL syncs before a trainer's first generation), so a run sees
    the weights of its own policy only. Generation settings (temperature, `top_p`, ...) travel with each request and
    may differ between trainers; engine settings may not, except the number of sequences per batch, up to
    `max_num_seqs`. The engine outlives the block: a later block in the process shares it too.

    Args:
        max_num_seqs (`int`): the batch capacity the shared engine is built with (TRL asks for the trainer's batch
            size); a larger request than this is refused.

    Raises:
        ImportError: vLLM is not installed.
        RuntimeError: inside the block, a trainer asks for other engine settings than the shared engine's (they
            are named), or TRL builds its engine somewhere this helper does not know (another TRL release).
    """
    try:
        import vllm  # noqa: F401

        generation = importlib.import_module("trl.generation.vllm_generation")
    except ImportError as error:
        raise ImportError("reuse_vllm_engine() needs vLLM and TRL's vLLM generation module.") from error
    engine_class = getattr(generation, "LLM", None)
    if engine_class is None:
        raise RuntimeError(
            "reuse_vllm_engine(): trl.generation.vllm_generation has no `LLM`: this TRL release builds its vLLM "
            "engine elsewhere."
        )
    if getattr(engine_class, _SHARING, False):  # nested: the outer block already shares
        yield
        return

    def shared_engine(**settings):
        requested = settings.pop("max_num_seqs", None) or 0
        if not _SHARED_ENGINE:
            engine = engine_class(**settings, max_num_seqs=max(requested, max_num_seqs))
            _SHARED_ENGINE.update(engine=engine, settings=settings, max_num_seqs=max(requested, max_num_seqs))
        differing = sorted(
            name
            for name in settings.keys() | _SHARED_ENGINE["settings"].keys()
            if settings.get(name) != _SHARED_ENGINE["settings"].get(name)
        )
        if requested > _SHARED_ENGINE["max_num_seqs"]:
            differing.append(f"max_num_seqs ({requested} > {_SHARED_ENGINE['max_num_seqs']})")
        if differing:
            raise RuntimeError(
                "reuse_vllm_engine(): this trainer asks for other vLLM engine settings than the engine this process "
                f"shares ({', '.join(differing)}), and a second colocated engine cannot be built in the process."
            )
        return _SHARED_ENGINE["engine"]

    setattr(shared_engine, _SHARING, True)
    generation.LLM = shared_engine
    try:
        yield
    finally:
        generation.LLM = engine_class
