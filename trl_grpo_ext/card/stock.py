"""What TRL's own model card holds for a GRPO run, so that this package's card keeps all of it.

TRL's `create_model_card` (`trl/trainer/base_trainer.py`) adds tags at run time and renders its card template with
`generate_model_card` (`trl/trainer/utils.py`), passing the trainer's name, paper and citation (`GRPOTrainer._name`,
`_paper`). `trl_card_tags` adds the same tags; `trl_card_sections` renders TRL's card for the same run through
TRL's own helper and returns its sections, so that their text (the title, the tracked runs' badges and the paper
line of "Training procedure", "Framework versions", the GRPO and TRL citations) is TRL's, as TRL writes it.
"""

from __future__ import annotations

import os

from trl.trainer.utils import generate_model_card

__all__ = ["TRL_TAGS", "split_sections", "trl_card_sections", "trl_card_tags"]

#: The tags TRL's card of a `GRPOTrainer` run always has: `generate_model_card`'s and the trainer's `_tag_names`.
TRL_TAGS = ("generated_from_trainer", "trl", "grpo")


def trl_card_tags(model_config=None, tags: list[str] | None = None, trackio_url: str | None = None) -> list[str]:
    """`tags` and those TRL's `create_model_card` adds for the run: `unsloth` for a model prepared by Unsloth (its
    config has `unsloth_version`), `hf_jobs` on Hugging Face Jobs (`JOB_ID` is set), and `trackio:<url>` for an
    active trackio run (replacing an older `trackio:` tag; the Hub shows that run beside the model)."""
    tags = list(tags or [])
    if model_config is not None and hasattr(model_config, "unsloth_version"):
        tags.append("unsloth")
    if "JOB_ID" in os.environ:
        tags.append("hf_jobs")
    if trackio_url is not None:
        tags = [tag for tag in tags if not tag.startswith("trackio:")] + [f"trackio:{trackio_url}"]
    return list(dict.fromkeys(tags))


def split_sections(text: str) -> dict[str, str]:
    """The sections of a Markdown text: heading line (`"## Citations"`) -> the text up to the next heading, with
    trailing spaces and repeated blank lines removed. Lines inside fenced code blocks are never headings."""
    sections: dict[str, list[str]] = {}
    current, fenced = None, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#") and line.lstrip("#").startswith(" "):
            current = line.strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line.rstrip())
    cleaned = {}
    for heading, lines in sections.items():
        kept: list[str] = []
        for line in lines:
            if line or (kept and kept[-1]):
                kept.append(line)
        cleaned[heading] = "\n".join(kept).strip("\n")
    return cleaned


def trl_card_sections(
    *,
    base_model: str | None,
    model_name: str,
    hub_model_id: str | None,
    dataset_name: str | list[str] | None,
    tags: list[str],
    wandb_url: str | None = None,
    trackio_url: str | None = None,
    comet_url: str | None = None,
) -> dict[str, str]:
    """TRL's card for this run, as `trl.GRPOTrainer.create_model_card` renders it, split into sections
    (`split_sections`): `"# Model Card for <model_name>"`, `"## Quick start"`, `"## Training procedure"`,
    `"### Framework versions"`, `"## Citations"` in TRL 1.14-1.16."""
    from trl import GRPOTrainer

    card = generate_model_card(
        base_model=base_model,
        model_name=model_name,
        hub_model_id=hub_model_id or model_name,
        dataset_name=dataset_name,
        tags=tags,
        wandb_url=wandb_url,
        trackio_url=trackio_url,
        comet_url=comet_url,
        trainer_name=GRPOTrainer._name,
        trainer_citation=GRPOTrainer._paper.get("citation"),
        template_file=GRPOTrainer._template_file,
        paper_title=GRPOTrainer._paper.get("title"),
        paper_id=GRPOTrainer._paper.get("id"),
    )
    return split_sections(card.text)
