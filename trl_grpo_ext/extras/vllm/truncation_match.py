"""`match_sampler_truncation`: vLLM's importance-sampling correction under truncated sampling, unbiased.

With `top_k`, `top_p` or `min_p`, vLLM reports log-probs of the distribution its cuts leave, renormalised over the kept
tokens; TRL 1.16 compares them with the trainer's whole-vocabulary log-probs, so every ratio carries the kept mass
`S` (TRL issue #6789). `TruncationMatch` gives the correction the trainer's `log p_trunc(t) = log p(t) - log S` of the
same cuts (`sampler_cuts`), from one forward pass without gradient per generation batch whose backbone hidden states
are projected through the LM head at the scored tokens only, in chunks. From it, for the batch that trains: the
correction's weights and TRL's statistics of them are rebuilt, the mismatch metrics use it, and
`sampling/truncation/kept_mass` and `outside_cut_fraction` are logged. `old_per_token_logps` (the surrogate's
denominator) stays the whole-vocabulary log-prob, as in TRL.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
from accelerate.utils import is_peft_model

from ..._compat import FORWARD_KEYS
from ...config import option
from ...metrics import TRUNCATION_KEPT_MASS, TRUNCATION_OUTSIDE_CUT_FRACTION
from ..generation import preserved_rng
from .correction import (
    TRL_CORRECTION_METRICS,
    corrected_tokens,
    correction_metrics,
    correction_ratio,
    sampler_log_ratios,
)
from .sampler_cuts import SamplerCuts, TruncatedLogProbs, truncated_log_probs_from_hidden

__all__ = [
    "TruncationMatch",
    "sampler_cuts",
    "trainer_logps",
    "trainer_truncated_logps",
    "trl_logit_transform",
    "truncation_warning",
]


def trainer_logps(trainer, output: dict[str, Any]) -> torch.Tensor:
    """The trainer's per-token log-probs `(N, T)` of a generated batch, as TRL computes `old_per_token_logps`: one
    forward pass without gradient (gradient checkpointing paused, as TRL does) that leaves the random state as it
    found it. On every process (sharded weights gather in the forward)."""
    try:
        from trl.models.utils import disable_gradient_checkpointing

        paused = disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)
    except ImportError:  # an older TRL without the helper: nothing to pause
        paused = nullcontext()
    args = trainer.args
    batch_size = args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size
    completion_ids = output["completion_ids"]
    # TRL's padded forward (`GRPOTrainerExt` keeps it beside the padding-free one): the truncation match reads the
    # backbone's hidden states in that layout.
    forward = getattr(trainer, "_stock_logps_and_entropies", trainer._get_per_token_logps_and_entropies)
    with torch.no_grad(), paused, preserved_rng():
        logps, _, _ = forward(
            trainer.model,
            torch.cat([output["prompt_ids"], completion_ids], dim=1),
            torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            completion_ids.size(1),
            batch_size=batch_size,
            **{key: output[key] for key in FORWARD_KEYS if output.get(key) is not None},
        )
    return logps


#: The sampling fields that truncate the sampler's distribution.
_CUTS = ("top_k", "top_p", "min_p")


def sampler_cuts(args) -> SamplerCuts:
    """The cuts vLLM samples with under `args`: `top_k`, `top_p` and `min_p`, each overridden by the same key of
    `generation_kwargs` (TRL passes those to vLLM's `SamplingParams` after the fields). `None` means off."""
    values = {name: getattr(args, name, None) for name in _CUTS}
    values.update({name: value for name, value in (args.generation_kwargs or {}).items() if name in _CUTS})
    off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    return SamplerCuts(**{name: off[name] if value is None else value for name, value in values.items()})


def truncation_warning(args) -> str | None:
    """The warning about what biases vLLM's importance-sampling correction under `args` (truncated sampling with the
    correction on and `match_sampler_truncation` off), naming the settings and what to do; else `None`."""
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False)):
        return None
    if option(args, "match_sampler_truncation"):
        return None
    cuts = sampler_cuts(args)
    off = SamplerCuts()
    truncating = [
        f"{name}={getattr(cuts, name)}"
        for name in ("top_p", "top_k", "min_p")
        if (getattr(cuts, name) > 0 if name == "top_k" else getattr(cuts, name) != getattr(off, name))
    ]
    if not truncating:
        return None
    return (
        f"vLLM samples from a truncated distribution ({', '.join(truncating)}) while "
        "vllm_importance_sampling_correction is on: vLLM's log-probs are renormalised over the tokens kept, the "
        "trainer's cover the whole vocabulary, so every importance ratio is scaled by the kept probability mass "
        "(<= 1) and the correction is biased (TRL issue #6789). Set match_sampler_truncation=True (GRPOConfigExt) "
        "to compare the trainer's log-probs of the same truncated distribution, sample without truncation "
        "(top_p=1.0, top_k=0, min_p=None), or switch the correction off; "
        "sampling/importance_sampling_ratio_raw/mean below 1 shows the bias."
    )


def trl_logit_transform(model) -> tuple[Any, dict[str, Any]]:
    """The backbone of TRL's fused LM head in `model` (a PEFT model's base model) and its logits' transform
    (`logit_scale`, `softcap`): a copy of the configuration reading of TRL 1.16's `add_fused_lm_head`
    (`_compat.TRL_COPIES`)."""
    text_config = model.config.get_text_config()
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    scale = 1.0 if scale is None else scale
    return model.base_model, {"logit_scale": scale, "softcap": getattr(text_config, "final_logit_softcapping", None)}


def _lm_head_weights(head, cast_to_fp32: bool):
    """The LM head's weight and bias, whole (FSDP2's DTensors gathered; ZeRO-3's inside `_gathered_lm_head`)."""
    weight, bias = head.weight, head.bias
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is sharded that way
        DTensor = ()  # noqa: N806
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    if cast_to_fp32:
        weight, bias = weight.float(), bias.float() if bias is not None else None
    return weight, bias


def _gathered_lm_head(head):
    """ZeRO-3 gathers the head's parameters only inside its own forward; the projection reads them directly."""
    try:
        from trl.trainer.utils import maybe_gather_lm_head_ctx
    except ImportError:  # TRL releases without it gather nothing for a fused head either
        return nullcontext()
    return maybe_gather_lm_head_ctx(head.weight, head.bias)


def trainer_truncated_logps(
    trainer, output: dict[str, Any], cuts: SamplerCuts
) -> tuple[torch.Tensor, TruncatedLogProbs]:
    """The trainer's log-probs `(N, T)` of a generated batch (`trainer_logps`), and [`TruncatedLogProbs`] `(N, T)`
    under `cuts`: at the corrected tokens from the backbone's hidden states, projected by a forward hook during that
    pass; elsewhere TRL's log-probs, a log kept mass of 0 and `kept` true."""
    model = trainer.model.get_base_model() if is_peft_model(trainer.model) else trainer.model
    backbone, transform = trl_logit_transform(model)
    length = output["completion_ids"].size(1)
    scored = corrected_tokens(output)
    cast_to_fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    parts: list[TruncatedLogProbs] = []
    seen = 0  # rows of the batch projected so far: TRL forwards its micro-batches in order

    def project(module, args, kwargs, result):
        nonlocal seen
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        hidden = result.last_hidden_state if hasattr(result, "last_hidden_state") else result[0]
        rows = scored[seen : seen + input_ids.size(0)].to(hidden.device)
        seen += input_ids.size(0)
        head = model.get_output_embeddings()
        autocast = torch.autocast(hidden.device.type, enabled=False) if cast_to_fp32 else nullcontext()
        with torch.no_grad(), _gathered_lm_head(head), autocast:
            weight, bias = _lm_head_weights(head, cast_to_fp32)
            hidden = hidden[:, -length - 1 : -1][rows].to(weight.device)  # (M, H): the scored tokens only
            if cast_to_fp32:
                hidden = hidden.float()
            targets = input_ids[:, -length:][rows.to(input_ids.device)].to(weight.device)
            part = truncated_log_probs_from_hidden(
                hidden, weight, bias, targets, cuts, temperature=trainer.temperature, **transform
            )
        parts.append(TruncatedLogProbs(*(field.to(scored.device) for field in part)))

    handle = backbone.register_forward_hook(project, with_kwargs=True)
    try:
        logps = trainer_logps(trainer, output)
    finally:
        handle.remove()
    if seen != scored.size(0):
        raise RuntimeError(f"The truncation match projected {seen} rows of a batch of {scored.size(0)}.")
    flat = TruncatedLogProbs(*(torch.cat(field) for field in zip(*parts, strict=True)))
    # The rows' scored tokens in row-major order, micro-batch after micro-batch: what masked_scatter fills.
    truncated = TruncatedLogProbs(
        logps.masked_scatter(scored, flat.logps.to(logps.dtype)),
        torch.zeros(scored.shape, device=scored.device).masked_scatter(scored, flat.log_kept_mass),
        torch.ones_like(scored).masked_scatter(scored, flat.kept),
    )
    return logps, truncated


class TruncationMatch:
    """`match_sampler_truncation` for one trainer, built by `for_trainer` where it acts (vLLM, the option, a cut):
    `mark` before a generation batch is generated, `apply` after, on every process."""

    def __init__(self, trainer, cuts: SamplerCuts):
        self.trainer, self.cuts = trainer, cuts

    @classmethod
    def for_trainer(cls, trainer) -> TruncationMatch | None:
        if not trainer.use_vllm or not option(trainer.args, "match_sampler_truncation"):
            return None
        cuts = sampler_cuts(trainer.args)
        return cls(trainer, cuts) if cuts.truncates else None

    def mark(self, mode: str) -> dict[str, int]:
        """How many values TRL's correction metrics hold now (the batch's come after)."""
        return {name: len(self.trainer._metrics[mode].get(name, [])) for name in TRL_CORRECTION_METRICS}

    def apply(self, output: dict[str, Any], mode: str, mark: dict[str, int], for_metrics: bool) -> torch.Tensor | None:
        """Replace the batch's correction weights and their logged statistics; return the trainer's truncated
        log-probs `(N, T)`, or `None` when neither the correction nor the mismatch metrics (`for_metrics`) use them
        (then nothing is computed)."""
        trainer = self.trainer
        correcting = trainer.vllm_importance_sampling_correction
        if output.get("sampling_per_token_logps") is None or not (correcting or for_metrics):
            return None
        logps, computed = trainer_truncated_logps(trainer, output, self.cuts)
        old = output.get("old_per_token_logps")
        truncated = (logps if old is None else old) - computed.log_kept_mass
        if correcting:
            level = trainer.vllm_importance_sampling_mode
            low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
            sampler_logps = output["sampling_per_token_logps"]
            log_ratio = sampler_log_ratios(truncated, sampler_logps, corrected_tokens(output), level).log_ratio
            ratio = correction_ratio(log_ratio, level, low, high)
            output["importance_sampling_ratio"] = ratio
            sequence_level = level.startswith("sequence")
            values = correction_metrics(trainer.accelerator, truncated, output, ratio, sequence_level)
            for name, value in values.items():
                logged = trainer._metrics[mode][name]
                del logged[mark[name] :]  # TRL's values of this batch (of every round, with dynamic sampling)
                logged.append(value)
        self._log_kept_mass(computed, output, mode)
        return truncated

    def _log_kept_mass(self, computed: TruncatedLogProbs, output: dict[str, Any], mode: str) -> None:
        mask = corrected_tokens(output)
        sums = torch.stack(
            [
                computed.log_kept_mass[mask].exp().sum(),
                (~computed.kept[mask]).sum().to(computed.log_kept_mass.dtype),
                mask.sum().to(computed.log_kept_mass.dtype),
            ]
        )
        kept_mass, outside, tokens = self.trainer.accelerator.gather(sums[None]).sum(dim=0).tolist()
        metrics = self.trainer._metrics[mode]
        metrics[TRUNCATION_KEPT_MASS].append(kept_mass / tokens if tokens else math.nan)
        metrics[TRUNCATION_OUTSIDE_CUT_FRACTION].append(outside / tokens if tokens else math.nan)
