"""`python -m benchmarks tables [--check]`: the documents' benchmark tables, written from the committed results.

A table in a document sits between two markers, each on a line of its own:

    <!-- table:e2e -->
    ... written by this command, not by hand ...
    <!-- /table -->

The name is that of a file in `benchmarks/results/`, a benchmark's own JSON (`python -m benchmarks e2e --json
benchmarks/results/e2e.json`), which the suite's table function renders, with a line naming the command, commit and
date it came from. `tables` rewrites every marked region of the README and `docs/*.md`; `--check` changes nothing and
exits with 1, naming each stale table (`tests/test_benchmarks_tables.py`). A figure that a new run changes is then
changed by rerunning the benchmark and this command, and a hand edit inside a region fails the tests.

A new table: a `RENDERERS` entry (the JSON's suite key and a function of its results that returns Markdown), the
JSON under `benchmarks/results/`, the markers in the document.

A table of the package's records (`record_tables()`: docs/objective.md's loss-type table, from the built-in loss-type
records) is written the same way from the records themselves, with no results file: a new record changes it through
this command. The metric tables of the README and the documents, and the alarm table, are text.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from .common import CHECKOUT

RESULTS_DIR = os.path.join("benchmarks", "results")
#: The documents searched for markers, relative to the checkout.
DOCUMENTS = ("README.md", os.path.join("docs", "*.md"))
MARKED = re.compile(
    r"^(?P<open><!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)^(?P<close><!-- /table -->)$", re.DOTALL | re.MULTILINE
)
# Markers on lines of their own; one quoted in prose is no marker.
OPENING, CLOSING = (
    re.compile(r"^<!-- table:[\w.-]+ -->$", re.MULTILINE),
    re.compile(r"^<!-- /table -->$", re.MULTILINE),
)


def _e2e(results: dict) -> str:
    """The end-to-end table as the suite prints it, its notes (the diagnostics' own time) as a list."""
    from . import e2e

    lines = e2e.table(results).splitlines()
    table = [line for line in lines if line.startswith("|")]
    notes = [f"- {line}" for line in lines if not line.startswith("|")]
    return "\n".join(table) + ("\n\n" + "\n".join(notes) if notes else "")


def _kernel(results: dict) -> str:
    """The loss-kernel table as the suite prints it, the measured bandwidth (the roofline's) after it."""
    from . import kernel

    bandwidth, table = kernel.table(results).split("\n", 1)
    return f"{table}\n\nMemory bandwidth in the same run (for the roofline column): {bandwidth.split(' ', 2)[2]}."


def _forward(results: dict) -> str:
    """The log-prob forward's table as the suite prints it, the shape and the row budget after it."""
    from . import forward

    shape, syncs = results["shape"], results.get("syncs_per_chunk", {}).get("shared")
    rows = " and ".join(f"{side} {b} x {length}" for side, (b, length) in shape.get("packed_rows", {}).items())
    attention = results["config"].get("attn_implementation", "sdpa")
    said = (
        f"{forward.table(results)}\n\n{attention} attention; {shape['rows']} rows of up to {shape['width']} tokens, "
        f"packed into rows of {rows or 'at most ' + str(shape.get('row_tokens')) + ' tokens'}; median of "
        f"{results['config']['steps']} timed steps per side."
    )
    if syncs is not None:
        said += (
            f" Per chunk, the package's code waits for the device {syncs['package']} time(s) and uploads "
            f"{syncs['uploads']} array(s) without waiting (`benchmarks.syncs`)."
        )
    return said


def _forward_emulated(results: dict) -> str:
    """The log-prob forward under flash-attention's emulation: tokens and exactness (its times and memory measure the
    stand-in kernels, which keep each sequence's attention matrix, not flash-attention, and are left out)."""
    from .common import format_table

    rows = [
        [side, f"{values['tokens_per_distinct']:.2f}", f"{values['max_abs_logp_difference']:.1e}"]
        for side, values in results["sides"].items()
    ]
    table = format_table(["side", "tokens / distinct", "max |dlogp| vs trl"], rows)
    shape = results["shape"]
    packed = " and ".join(f"{side} {b} x {length}" for side, (b, length) in shape["packed_rows"].items())
    syncs = results["syncs_per_chunk"]["shared"]
    return (
        f"{table}\n\n{shape['rows']} rows of up to {shape['width']} tokens, packed into rows of {packed}; per chunk "
        f"the package's code waits for the device {syncs['package']} time(s) and uploads {syncs['uploads']} array(s)."
    )


def _comm(results: dict) -> str:
    """The collectives' table as the suite prints it, its set-up line after it."""
    from . import comm

    setup, table = comm.table(results).split("\n", 1)
    return f"{table}\n\n{setup}."


def _truncation(results: dict) -> str:
    """The truncated-sampling table as the suite prints it, the run's steps and correction mode after it."""
    from . import truncation

    return (
        f"{truncation.table(results)}\n\n{results['steps']} training steps per side and setting, "
        f"`vllm_importance_sampling_mode={results['mode']!r}`."
    )


def _truncation_cost(results: dict) -> str:
    """The truncation match's cost table as the suite prints it, the forward, model and batch after it."""
    from . import truncation

    batch, model, forward = results["batch"], results["model"], results["forward_s"]["median"]
    return (
        f"{truncation.cost_table(results)}\n\nTRL's log-prob forward of the batch: {forward:.2f} s "
        f"(median of {results['repeats']}); {batch['rows']} completions of up to {batch['width']} tokens "
        f"({batch['completion_tokens']} completion tokens) after {batch['prompt']} prompt tokens; hidden size "
        f"{model['hidden_size']}, {model['num_hidden_layers']} layers, the LM head "
        f"{results['lm_head_flop_share']:.0%} of the forward's matmul FLOPs; top_p={results['top_p']}, bounds "
        f"{', '.join(f'{width:,}' for width in results['top_p_bounds'])}; "
        f"{results['chunk_positions']['before']} and {results['chunk_positions']['after']} positions per chunk."
    )


def _learning_epochs(results: dict) -> str:
    """The learning benchmark's multi-epoch runs: the summary table, held-out exact match every 100 steps, and the
    groups' flatness."""
    from . import learning

    epochs = results["epochs"]
    curves = learning.curve_table(results["epoch_runs"], list(epochs["summary"]), 100)
    return (
        f"{learning.table(epochs)}\n\nHeld-out exact match at every 100 steps from step 0 (mean of the seeds), and "
        f"the mean training CPU seconds at those steps:\n\n{curves}\n\n"
        f"The groups generated in training (every side; mean of the seeds):\n\n{learning.flatness_table(epochs)}"
    )


def _learning_whole(results: dict) -> str:
    """The learning benchmark's runs on the whole training set: the summary table, held-out exact match every 100
    steps, and the step time with row skipping against without."""
    from . import learning

    curves = learning.curve_table(results["runs"], list(results["summary"]), 100)
    skipping = learning.skip_table(results["skip_step_times"])
    return (
        f"{learning.table(results)}\n\nHeld-out exact match at every 100 steps from step 0 (mean of the seeds), and "
        f"the mean training CPU seconds at those steps:\n\n{curves}\n\n"
        f"Step time with skipping against without, on the same objective (`beta=0`), "
        f"{results['config']['skip_steps']} steps per run, no evaluation; each step's CPU time split into TRL's "
        f"generation and scoring and the rest (mean of the seeds):\n\n{skipping}"
    )


def _learning_rounds(results: dict) -> str:
    """Dynamic sampling's round sizes: completions generated, per trained, rounds and training time per side."""
    from . import learning

    config = results["config"]
    return f"{learning.rounds_table(results)}\n\n{config['steps']} steps per run, {len(config['seeds'])} seeds."


def _learning_time_split(results: dict) -> str:
    """Where each multi-epoch side's training time goes: TRL's generation and scoring against the rest."""
    from . import learning

    config = results["config"]
    return (
        f"{learning.time_split_table(results['epoch_runs'], list(results['epochs']['summary']))}\n\n"
        f"{config['steps']} steps per run on the first {config['epoch_prompts']} training prompts, "
        f"{len(config['seeds'])} seeds."
    )


def _demo(results: dict) -> str:
    """The demo's figures as the suite prints them, the machine's load during the run after them."""
    from . import demo

    load = ", ".join(f"{value:.1f}" for value in results["load_average"])
    return f"{demo.table(results)}\n\nLoad average of the machine at the end of the run (1, 5, 15 minutes): {load}."


@dataclass(frozen=True)
class Renderer:
    """How one results file becomes Markdown.

    Args:
        suite (`str`): the key of the suite's results in the JSON (`python -m benchmarks SUITE` writes it).
        render (`Callable[[dict], str]`): the suite's results to Markdown.
    """

    suite: str
    render: Callable[[dict], str]


RENDERERS: dict[str, Renderer] = {
    "e2e": Renderer("e2e", _e2e),
    "kernel": Renderer("kernel", _kernel),
    "forward": Renderer("forward", _forward),
    "forward-flash-emulated": Renderer("forward", _forward_emulated),
    "comm": Renderer("comm", _comm),
    "truncation": Renderer("truncation", _truncation),
    "truncation-cost": Renderer("truncation_cost", _truncation_cost),
    "learning-spread": Renderer("learning", _learning_epochs),
    "learning-demo": Renderer("learning", _learning_whole),
    "learning-demo-epochs": Renderer("learning", _learning_epochs),
    "learning-spread-forward": Renderer("learning", _learning_time_split),
    "learning-demo-rounds": Renderer("learning", _learning_rounds),
    "demo": Renderer("demo", _demo),
}


def provenance(payload: dict) -> str:
    """One line: the command, commit and date a results file came from (`environment` as the benchmarks write it)."""
    environment = payload.get("environment", {})
    where = ", ".join(
        part
        for part in (
            f"commit {environment['commit']}" if environment.get("commit") else "",
            environment.get("date", ""),
        )
        if part
    )
    line = f"`{payload['command']}`" + (f" ({where})" if where else "")
    if payload.get("reconstructed_from"):
        line += f", {payload['reconstructed_from']}"
    return line


#: divisor -> what `D` is, in the words of docs/objective.md's loss-type table (Markdown).
DIVISOR_NOTES = {
    "window_tokens": "`D` = completion tokens of the accumulation window",
    "rows_times_max_length": "`D = N * max_completion_length`",
}


def loss_type_row(record, note: str = "") -> str:
    """The row of a loss-type record (`trl_grpo_ext.ops.loss_types.LossType`) in docs/objective.md's table: its name
    (with `note` after it, in brackets), policy term, aggregation (with what its divisor `D` is)."""
    name = f"`{record.name}`" + (f" ({note})" if note else "")
    aggregation = f"`{record.aggregation}`" + (f", {DIVISOR_NOTES[record.divisor]}" if record.divisor else "")
    cells = [name, f"`{record.policy_term}`", aggregation]
    for cell in cells:
        if "|" in cell or "\n" in cell:
            raise ValueError(f"loss type {record.name}: a table cell holds '|' or a line break: {cell!r}")
    return f"| {' | '.join(cells)} |"


def _loss_types() -> str:
    """docs/objective.md's loss-type table, from the built-in loss-type records (`trl_grpo_ext.ops.loss_types`), the
    defaults of `GRPOConfigExt` and of TRL's `GRPOConfig` named in their rows."""
    import trl

    from trl_grpo_ext import GRPOConfigExt
    from trl_grpo_ext.ops.loss_types import BUILTIN_LOSS_TYPES, LOSS_TYPES

    notes: dict[str, list[str]] = {}
    defaults = ((GRPOConfigExt.loss_type, "this package's default"), (trl.GRPOConfig.loss_type, "TRL's default"))
    for default, whose in defaults:
        notes.setdefault(default, []).append(whose)
    header = "| `loss_type` | policy term `P` | aggregation |\n| --- | --- | --- |\n"
    rows = (loss_type_row(LOSS_TYPES[name], "; ".join(notes.get(name, []))) for name in BUILTIN_LOSS_TYPES)
    return header + "".join(f"{row}\n" for row in rows)


def record_tables() -> dict[str, Callable[[], str]]:
    """The tables written from the package's records, not from a results file: name -> a function that returns
    Markdown (the package is imported on the first call, not with this module)."""
    return {"loss-types": _loss_types}


def render(name: str, root: str = CHECKOUT) -> str:
    """The body of the region `name`: the table of `benchmarks/results/<name>.json` and where its figures came from,
    or a `record_tables()` table.

    Raises:
        `KeyError`: no renderer of that name. `FileNotFoundError`: no results file.
    """
    if name not in RENDERERS:
        return record_tables()[name]()
    renderer = RENDERERS[name]
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(os.path.join(root, path)) as handle:
        payload = json.load(handle)
    body = renderer.render(payload[renderer.suite])
    return f"{body}\n\nWritten by `python -m benchmarks tables` from `{path}`: {provenance(payload)}.\n"


def documents(root: str = CHECKOUT) -> list[str]:
    """The documents that may hold marked tables, relative to `root`."""
    found = []
    for pattern in DOCUMENTS:
        found += sorted(os.path.relpath(path, root) for path in glob.glob(os.path.join(root, pattern)))
    return found


def rewrite(text: str, root: str = CHECKOUT) -> tuple[str, list[str]]:
    """`text` with every marked region rendered anew, and the names of the regions that changed.

    Raises:
        `ValueError`: an opening marker without its closing one, or a name without a renderer.
    """
    changed: list[str] = []
    records = record_tables()

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS and name not in records:
            known = ", ".join(sorted([*RENDERERS, *records]))
            raise ValueError(f"<!-- table:{name} -->: no such table (known: {known})")
        body = render(name, root)
        if body != match.group("body"):
            changed.append(name)
        return match.group("open") + body + match.group("close")

    rewritten = MARKED.sub(replace, text)
    opened, closed = len(OPENING.findall(text)), len(CLOSING.findall(text))
    if opened != closed or opened != len(MARKED.findall(text)):
        raise ValueError(f"{opened} table markers opened and {closed} closed, {len(MARKED.findall(text))} paired")
    return rewritten, changed


def main(argv: list[str] | None = None, root: str = CHECKOUT) -> int:
    """Rewrite (or with `--check`, check) every marked table; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    stale = []
    for document in documents(root):
        path = os.path.join(root, document)
        with open(path) as handle:
            text = handle.read()
        try:
            rewritten, changed = rewrite(text, root)
        except ValueError as error:
            print(f"{document}: {error}")
            return 1
        stale += [f"{document}: table '{name}'" for name in changed]
        if changed and not args.check:
            with open(path, "w") as handle:
                handle.write(rewritten)
    for line in stale:
        print(f"{line} {'is stale' if args.check else 'rewritten'}")
    if args.check and stale:
        print("Run `python -m benchmarks tables` to write them from benchmarks/results/.")
        return 1
    return 0
