"""The markdown summary (`gpu.md`) of `python -m benchmarks gpu`'s results, complete or partial.

Each section is rendered on its own; one that cannot be (an unexpected shape of results) says so and the rest of
the summary is still written, since the summary is rewritten after every section of a run that may be cut short.
"""

from __future__ import annotations

import traceback

from .common import format_table

__all__ = ["render"]


def _number(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def _span(stats: dict, scale: float = 1.0, digits: int = 3) -> str:
    return (
        f"{stats['median'] * scale:.{digits}g} [{stats['min'] * scale:.{digits}g}, {stats['max'] * scale:.{digits}g}]"
    )


def _environment(result: dict) -> list[str]:
    packages = ", ".join(f"{name} {version}" for name, version in result["packages"].items() if version)
    lines = [f"Python {result['python']}; {packages}.", ""]
    if "gpu" in result:
        gpu = result["gpu"]
        lines.append(
            f"{gpu['name']}, {gpu['total_memory_bytes'] / 2**30:.0f} GiB, {gpu['multiprocessors']} multiprocessors, "
            f"compute capability {gpu['capability']}, CUDA {gpu['cuda']}."
        )
    lines.append(f"Imported from: {', '.join(f'{k} {v}' for k, v in result['imported_from'].items())}.")
    return lines


def _equivalence(result: dict) -> list[str]:
    tolerance = "; ".join(f"{key}: rtol {t['rtol']:g}, atol {t['atol']:g}" for key, t in result["tolerance"].items())
    lines = [
        f"Precision: {result['precision']}. A step passes when |ext - stock| <= atol + rtol * |stock| ({tolerance}).",
        "",
    ]
    comparisons = dict(result["modes"])
    if "stock_against_itself_full" in result:
        comparisons["full, stock vs stock (noise floor)"] = result["stock_against_itself_full"]
    for mode, comparison in comparisons.items():
        rows = []
        for step in comparison["steps"]:
            row = [step["step"]]
            for key in ("loss", "grad_norm", "kl"):
                row += [_number(step[key]["stock"], 6), _number(step[key]["ext"], 6)]
            row += [_number(step["reward"]["stock"]), _number(step["completions/mean_length"]["stock"], 3)]
            within = all(step[key]["within"] for key in ("loss", "grad_norm", "kl"))
            row.append(("yes" if within else "NO") if step["compared"] else "(other samples)")
            rows.append(row)
        headers = [
            "step",
            "loss stock",
            "loss ext",
            "grad_norm stock",
            "grad_norm ext",
            "kl stock",
            "kl ext",
            "reward",
            "mean length",
            "within",
        ]
        worst = ", ".join(f"{k} {v:.2f}" for k, v in comparison["worst_fraction_of_tolerance"].items())
        diverged = comparison["samples_diverged_at_step"]
        samples = f"the sampled completions differ from step {diverged} on" if diverged else "the same completions"
        lines += [
            f"**{mode}**: within tolerance: {_number(comparison['within_tolerance'])} "
            f"({comparison['steps_compared']} steps compared; {samples}); worst |difference| / allowed: {worst}.",
            "",
            format_table(headers, rows),
            "",
        ]
    return lines


def _syncs(result: dict) -> list[str]:
    lines = []
    rows = []
    for side, run in result["runs"].items():
        name = "GRPOTrainerExt" if side == "ext" else "trl.GRPOTrainer"
        for owner in ("trl_grpo_ext", "trl"):
            micro, per_log = run[f"{owner}_per_micro_batch"], run[f"{owner}_per_log_step"]
            rows.append(
                [
                    name,
                    owner,
                    _number(micro["loss"], 3),
                    _number(micro["micro_batch"], 3),
                    _number(per_log["log"], 3),
                    _number(per_log["generation"], 3),
                    _number(per_log["optimizer_step"], 3),
                ]
            )
    headers = [
        "trainer",
        "caused by",
        "loss / micro-batch",
        "rest of micro-batch",
        "log / log step",
        "generation / log step",
        "grad-norm guard / log step",
    ]
    first = next(iter(result["runs"].values()))
    lines += [
        f"Counted: {first['method']}; {first['micro_batches']} micro-batches, {first['log_steps']} log steps.",
        "",
        format_table(headers, rows),
        "",
    ]
    ours = [[s["phase"], s["site"], s["count"]] for s in result["runs"].get("ext", {}).get("trl_grpo_ext_sites", [])]
    if ours:
        lines += [
            "Every site in trl_grpo_ext (GRPOTrainerExt run):",
            "",
            format_table(["phase", "site", "events"], ours),
        ]
        lines.append("")
    for side, run in result["runs"].items():
        sites = [[s["owner"], s["phase"], s["site"], s["count"]] for s in run["top_sites"][:8]]
        if sites:
            lines += [
                f"Most frequent sites, {side}:",
                "",
                format_table(["owner", "phase", "site", "events"], sites),
                "",
            ]
    return lines


def _kernels(result: dict) -> list[str]:
    lines = [
        f"Bandwidth {result['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s ({result['bandwidth']['method']}); "
        f"compile fell back to eager: {_number(result['compile']['fell_back_to_eager'])}; graphs compiled: "
        f"{result['compile']['graphs_compiled']}.",
        "",
    ]
    rows = []
    for case in result["agreement"]:
        row = [case["dtype"], case["epsilon"], _number(case["epsilon_high"]), case["beta"]]
        if "error" in case:
            row += ["error"] * 5
        else:
            row += [f"{case['relative_difference'][k]:.1e}" for k in ("loss", "policy_loss", "kl", "grad")]
            row.append(f"{case['clipped_token_share']:.1%}")
        rows.append(row + [_number(case["agrees"])])
    headers = ["dtype", "epsilon", "epsilon_high", "beta", "loss", "policy_loss", "kl", "grad", "clipped", "agrees"]
    lines += ["compiled against reference (max relative difference):", "", format_table(headers, rows), ""]
    rows = []
    for case in result["cases"]:
        for side, stats in case["sides"].items():
            extra = stats.get("extra_peak_fp32_buffers")
            rows.append(
                [
                    f"{case['shape'][0]}x{case['shape'][1]}",
                    case["dtype"],
                    side,
                    _span(stats["time_s"], 1e6),
                    _span(stats["speedup_vs_seed000"]),
                    f"{stats['roofline_fraction']:.1%}",
                    "-" if extra is None else f"{extra:.2f}",
                ]
            )
    headers = [
        "N x T",
        "dtype",
        "side",
        "fwd+bwd us, median [min, max]",
        "speed-up vs seed000",
        "of roofline",
        "extra peak, (N,T) fp32 buffers",
    ]
    return lines + [format_table(headers, rows), ""]


def _nonfinite(result: dict) -> list[str]:
    checks = "; ".join(f"{name}: {_number(ok)}" for name, ok in result["checks"].items())
    return [f"{checks}. Logged skipped steps: {result['skipped_steps_logged']}; grad_norm: {result['grad_norm']}.", ""]


def _e2e(result: dict) -> list[str]:
    config = result["config"]
    return [
        f"{config['steps']} steps per side ({config['warmup']} warm-up), "
        f"batch {config['per_device_train_batch_size']}, max_completion_length {config['max_completion_length']}, "
        f"bf16 {config['bf16']}.",
        "",
        result.get("table", ""),
        "",
    ]


def _forward(result: dict) -> list[str]:
    config = result["config"]
    lines = [
        f"{config['groups']} groups of {config['generations']} completions, attention: "
        f"{', '.join(config['implementations'])}.",
        "",
        result.get("table", ""),
        "",
    ]
    return lines + [f"{name} failed:\n```\n{error.rstrip()}\n```" for name, error in result["errors"].items()]


RENDERERS = {
    "environment": ("Environment", _environment),
    "equivalence": ("Equivalence with stock TRL", _equivalence),
    "syncs": ("Host synchronisations", _syncs),
    "kernels": ("Loss kernels", _kernels),
    "nonfinite": ("Non-finite guard", _nonfinite),
    "e2e": ("End to end (GRPOTrainerExt / stock TRL)", _e2e),
    "forward": ("The log-prob forward (padding-free / TRL's padded)", _forward),
}


def render(results: dict) -> str:
    """The markdown text for `results` (what `gpu.run` builds)."""
    lines = [
        f"# GPU check: {results['device']}",
        "",
        f"{results['date']}; sizes: {results['sizes']}; {results.get('elapsed_s', 0):.0f} s of a "
        f"{results['budget_s']:.0f} s budget. Command: `{results['command']}`.",
        "",
    ]
    rows, targets = [], []
    for name, entry in results["sections"].items():
        detail = entry.get("reason") or entry.get("error") or ", ".join(entry.get("failed_checks", []))
        skipped = (entry.get("result") or {}).get("skipped") or {}
        if skipped:
            detail = "; ".join(filter(None, [detail, *(f"skipped {part}: {why}" for part, why in skipped.items())]))
        rows.append([name, entry["status"], f"{entry['seconds']:.0f}" if "seconds" in entry else "", detail])
        for target, value in ((entry.get("result") or {}).get("targets") or {}).items():
            targets.append([name, target, _number(value["value"]), value["limit"], _number(value["met"])])
    lines += [format_table(["section", "status", "s", "notes"], rows), ""]
    if targets:
        lines += [
            "Targets (reported, not enforced):",
            "",
            format_table(["section", "target", "value", "limit", "met"], targets),
            "",
        ]
    for name, entry in results["sections"].items():
        if name not in RENDERERS or entry["status"] == "pending":
            continue
        title, renderer = RENDERERS[name]
        lines += [f"## {title}", ""]
        if entry["status"] == "error":
            lines += ["```", entry.get("traceback", entry.get("error", "")).rstrip(), "```", ""]
        if "result" in entry:
            try:
                lines += renderer(entry["result"])
            except Exception:  # noqa: BLE001 - the rest of the summary must still be written
                lines += ["Could not render this section:", "```", traceback.format_exc().rstrip(), "```"]
            if lines[-1]:
                lines.append("")
    return "\n".join(lines) + "\n"
