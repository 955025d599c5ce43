"""What the sections of `python -m benchmarks gpu` share: sizes, the run's context, the local models, trainers.

The models are randomly initialised from published configurations and saved locally with a character tokenizer
padded to their vocabulary (no Hub access): Qwen2.5-1.5B's for the log-prob forward's sections (`Sizes.check_model`),
Qwen2.5-0.5B's for the training sections (`Sizes.model`); at `QUICK` sizes (no CUDA device, or `--quick`) both are a
two-layer model of width 32 and every section runs in seconds.
"""

from __future__ import annotations

import gc
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "Context",
    "GPU",
    "QUICK",
    "QWEN25_05B_CONFIG",
    "QWEN25_15B_CONFIG",
    "STOCK_EQUIVALENT",
    "SectionTimeout",
    "Sizes",
    "build_model_folder",
    "free_memory",
    "loss_logs",
    "make_trainer",
    "prompts",
    "text_hash_reward",
]

# Qwen2.5-0.5B's published configuration, written out (no Hub access): 494M parameters.
QWEN25_05B_CONFIG = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
# Qwen2.5-1.5B's published configuration, written out: 1,543M parameters.
QWEN25_15B_CONFIG = dict(
    QWEN25_05B_CONFIG,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
)
ALPHABET = "abcdefghij="
# A random model puts ~1/vocab of its mass on <eos>: completions would all run to the length limit, and the
# per-sequence normalisation would go untested. A 10x larger <eos> embedding row ends about half of them earlier.
EOS_SCALE = 10.0
# DeepSeekMath's GRPO objective, spelled out for stock TRL (GRPOConfigExt's defaults).
STOCK_EQUIVALENT = dict(loss_type="grpo", beta=0.04, epsilon=0.2, use_bias_correction_kl=False)


class SectionTimeout(BaseException):
    """The run's time budget ran out during a section.

    A `BaseException`, like `KeyboardInterrupt`, so that the `except Exception` of a section's own error handling (or
    of the libraries it calls) does not swallow it and carry on past the budget.
    """


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one kind of run."""

    label: str
    model: dict  # the training sections' model
    check_model: dict  # the log-prob forward's sections' model (`gpu_packing`)
    completion_length: int  # max_completion_length of the equivalence, sync and end-to-end runs
    batch: int  # per_device_train_batch_size of the equivalence and sync runs
    num_generations: int
    learning_rates: dict  # mode -> learning rate of the equivalence runs
    e2e_batch: int
    e2e_steps: tuple[int, int]  # fewest and most steps of one end-to-end run, warm-up included
    e2e_warmup: int
    kernel_shapes: tuple
    kernel_dtypes: tuple
    kernel_repeats: int
    kernel_inner: int  # back-to-back calls per timed block
    agreement_shape: tuple[int, int]


GPU = Sizes(
    label="Qwen2.5-1.5B configuration (forward sections), Qwen2.5-0.5B (training sections)",
    model=QWEN25_05B_CONFIG,
    check_model=QWEN25_15B_CONFIG,
    completion_length=64,
    batch=8,
    num_generations=8,
    learning_rates={"full": 2e-5, "lora": 2e-4},
    e2e_batch=32,
    e2e_steps=(5, 12),
    e2e_warmup=2,
    kernel_shapes=((64, 4096), (256, 8192)),
    kernel_dtypes=(torch.float32, torch.bfloat16),
    kernel_repeats=20,
    kernel_inner=10,
    agreement_shape=(64, 4096),
)
_TINY = dict(
    QWEN25_05B_CONFIG,
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
QUICK = Sizes(
    label="quick: 2 layers, width 32, vocabulary 256",
    model=_TINY,
    check_model=_TINY,
    completion_length=8,
    batch=8,
    num_generations=4,
    # LoRA r=16 at 5e-2 (the CPU test's r=4 rate) reaches KL ~2 by step 6, where float32 rounding is amplified.
    learning_rates={"full": 1e-2, "lora": 1e-2},
    e2e_batch=8,
    e2e_steps=(3, 3),
    e2e_warmup=1,
    kernel_shapes=((8, 64),),
    kernel_dtypes=(torch.float32,),
    kernel_repeats=3,
    kernel_inner=2,
    agreement_shape=(8, 64),
)


@dataclass
class Context:
    """What the sections share: device, sizes, a scratch folder, a progress printer, the time budget's clock."""

    device: str
    sizes: Sizes
    workdir: str
    log: Callable[[str], None]
    remaining: Callable[[], float]  # seconds left in the whole run's budget
    layers: int | None = None  # overrides the model's number of layers
    save: Callable[[], None] = lambda: None  # writes the results so far (sections call it after each part)
    estimates: dict = field(default_factory=dict)  # measured costs that later sections plan with
    state: dict = field(default_factory=dict)  # objects that later sections reuse (the forward sections' trainer)
    _models: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def model(self, kind: str = "model") -> tuple[str, str]:
        """`(model folder, tokenizer folder)` of `Sizes.model` (`kind="model"`) or `Sizes.check_model`
        (`"check_model"`), built on first use; one folder for both where they are the same configuration."""
        config = dict(getattr(self.sizes, kind))
        if self.layers:
            config["num_hidden_layers"] = self.layers
        key = repr(sorted(config.items()))
        if key not in self._models:
            begin = time.monotonic()
            folder = os.path.join(self.workdir, f"model-{len(self._models)}")
            self._models[key] = build_model_folder(folder, config, self.device)
            self.estimates[f"{kind}_build_s"] = time.monotonic() - begin
            self.log(f"built and saved the {kind.replace('_', ' ')} in {self.estimates[f'{kind}_build_s']:.1f} s")
        return self._models[key]


def build_model_folder(folder: str, model_config: dict, device: str, seed: int = 0) -> tuple[str, str]:
    """Save a randomly initialised `Qwen2ForCausalLM` and a character tokenizer padded to its vocabulary.

    Args:
        folder (`str`): gets `model/` (bf16 safetensors: TRL loads it as float32 master weights) and `tokenizer/`
            (kept apart: `AutoTokenizer` would give a `qwen2` folder Qwen2's byte-level tokenizer class).
        model_config (`dict`): `transformers.Qwen2Config` arguments.
        device (`str`): where the weights are initialised (fast on a GPU).
        seed (`int`): seed of the initialisation.

    Returns:
        `(model folder, tokenizer folder)`.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_grpo_ext.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer(ALPHABET, vocab_size=model_config["vocab_size"])
    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = Qwen2Config(**model_config, **special)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id] *= EOS_SCALE
    for name, value in special.items():
        setattr(model.generation_config, name, value)
    model_path, tokenizer_path = os.path.join(folder, "model"), os.path.join(folder, "tokenizer")
    model.to(torch.bfloat16).save_pretrained(model_path)
    tokenizer.save_pretrained(tokenizer_path)
    del model
    free_memory()
    return model_path, tokenizer_path


def text_hash_reward(completions, **kwargs) -> list[float]:
    """A fixed score in [0, 1) per completion text: a random model needs no task for its groups to have a spread."""
    return [zlib.crc32(completion.encode()) % 1000 / 1000 for completion in completions]


def prompts(count: int) -> list[str]:
    """`count` four-character prompts of the training sections' task (three letters and `=`)."""
    return [ALPHABET[i % 10] + ALPHABET[(3 * i + 1) % 10] + ALPHABET[(7 * i + 2) % 10] + "=" for i in range(count)]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_trainer(ctx: Context, side: str, output_dir: str, lora: bool, trainer_class=None, callbacks=(), **overrides):
    """A stock (`side="trl"`, with `STOCK_EQUIVALENT`) or `GRPOTrainerExt` trainer on the context's model."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_ext import GRPOConfigExt, GRPOTrainerExt

    model_path, tokenizer_path = ctx.model()
    args = dict(
        output_dir=output_dir,
        per_device_train_batch_size=ctx.sizes.batch,
        num_generations=ctx.sizes.num_generations,
        max_completion_length=ctx.sizes.completion_length,
        learning_rate=ctx.sizes.learning_rates["lora" if lora else "full"],
        max_steps=8,
        logging_steps=1,
        report_to="none",
        use_cpu=not ctx.cuda,
        bf16=ctx.cuda,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    args.update(overrides)
    if side == "trl":
        trainer_class, config = GRPOTrainer, GRPOConfig(**args, **STOCK_EQUIVALENT)
    else:
        trainer_class, config = trainer_class or GRPOTrainerExt, GRPOConfigExt(**args)
    return trainer_class(
        model=model_path,
        reward_funcs=text_hash_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts(64)}),
        processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if lora else None,
        callbacks=list(callbacks),
    )


def loss_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]
