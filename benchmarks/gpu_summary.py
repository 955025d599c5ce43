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
    flash = result.get("flash_attention_2")
    if flash:
        lines += ["", f"flash-attention 2: {flash.get('description') or flash.get('reason')}."]
    return lines


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _engagement(result: dict) -> list[str]:
    rows = []
    for name, setup in result["setups"].items():
        check = setup["self_check"]
        rows.append(
            [
                name,
                setup["weights"],
                _number(setup["bf16"]),
                setup["attn_implementation"],
                f"{setup['packed_forwards']}/{setup['forwards']}",
                _number(not setup["fell_back"]),
                _number(check["passed"]),
                check["dtype"],
                f"{check['difference']:.3g}",
                f"{check['floor']:.3g}",
                f"{check['tolerance']:.3g}",
                "-"
                if check["shared_passed"] is None
                else f"{_number(check['shared_passed'])} ({check['shared_difference']:.3g})",
            ]
        )
    headers = [
        "setup",
        "weights",
        "bf16",
        "attention",
        "forwards packed",
        "engaged",
        "self-check passed",
        "at",
        "difference",
        "floor",
        "tolerance",
        "shared passed (difference)",
    ]
    lines = [format_table(headers, rows), ""]
    for name, setup in result["setups"].items():
        lines += [f"- {name}: {message}" for message in setup["messages"]]
    return lines


def _exactness(result: dict) -> list[str]:
    batch = result["batch"]
    lines = [
        f"{batch['label']}: {batch['rows']} rows of {batch['width']} columns, {batch['real_tokens']} real tokens, "
        f"padding_free_row_tokens={batch['padding_free_row_tokens']}. Tolerance: {result['floor_factor']:g} x the "
        "floor (TRL's padded forward against itself with 7 more columns of left padding), at least the dtype's "
        "minimum.",
        "",
    ]
    rows = []
    for run in result["runs"]:
        floor = run["floor"]
        for side, entry in run["sides"].items():
            rows.append(
                [
                    run["attention"],
                    run["precision"],
                    side,
                    entry["packed_rows"],
                    f"{entry['max']:.3g}",
                    f"{entry['p99.9']:.3g}",
                    f"{floor['max']:.3g}",
                    f"{floor['p99.9']:.3g}",
                    f"{run['tolerance']:.3g}",
                    _number(entry["within_tolerance"]),
                ]
            )
    headers = ["attention", "precision", "side", "packed rows", "max", "p99.9", "floor max", "floor p99.9"]
    lines += [format_table([*headers, "tolerance", "within"], rows), ""]
    lines += [f"- {run['attention']}: {run['kernels']}." for run in result["runs"] if run["precision"] != "float32"]
    return lines


def _attention(result: dict) -> list[str]:
    rows = [
        [label, ", ".join(entry["classes"]) or "none", "; ".join(entry["attention_kernels"][:3])[:200]]
        for label, entry in result["kernels"].items()
    ]
    lines = [format_table(["side/attention", "attention kernel", "kernels (first 3)"], rows), ""]
    rows = []
    for case in result["throughput"]:
        for name in ("masked", "causal_no_mask", "gemm"):
            rows.append(
                [
                    case["length"],
                    name,
                    f"{case[name]['forward_s'] * 1e3:.3g}",
                    f"{case[name]['forward_tflops']:.3g}",
                    f"{case[name]['forward_backward_s'] * 1e3:.3g}",
                    f"{case[name]['forward_backward_tflops']:.3g}",
                ]
            )
    headers = ["L", "kernel", "forward ms", "TFLOP/s", "forward + backward ms", "TFLOP/s"]
    lines += [format_table(headers, rows), ""]
    decision = result.get("decision")
    if decision:
        lines.append(
            f"Masked sdpa at {decision['masked_over_gemm']:.2f} of GEMM throughput "
            f"(L={decision['masked_over_gemm_at_length']}, forward + backward): attention costs a token "
            f"{decision['attention_share_measured']:.3g} of its linear layers at the padded width "
            f"{decision['padded_width']} (the package's price: "
            f"{decision['attention_share_at_gemm_throughput']:.3g}); the dense layout's tails are "
            f"{decision['dense_layout_tail_share']:.3g} of its tokens. Verdict: {decision['verdict']}."
        )
    return lines


def _memory(result: dict) -> list[str]:
    rows = []
    for label, runs in result["runs"].items():
        row = [label]
        for key in ("checkpointing_on", "checkpointing_off"):
            run = runs.get(key)
            if run is None:
                row += ["-", "-", "-"]
            elif "out_of_memory" in run:
                row += ["out of memory", "-", "-"]
            else:
                row += [
                    _gib(run.get("peak_bytes")),
                    _gib(run.get("peak_above_start_bytes")),
                    f"{run['saved_bytes'] / 2**20:.1f}",
                ]
        rows.append(row)
    headers = ["side"]
    for state in ("on", "off"):
        headers += [f"checkpointing {state}: peak GiB", "above start GiB", "saved for backward MiB"]
    check = result.get("self_check", {})
    return [
        f"{result['batch']['label']}.",
        "",
        format_table(headers, rows),
        "",
        f"The step-1 self-check alone: {check.get('seconds', 0):.2f} s, "
        f"{_gib(check.get('peak_above_start_bytes'))} GiB above the start, passed {_number(check.get('passed'))}.",
    ]


def _speed(result: dict) -> list[str]:
    batch = result["batch"]
    rows = []
    for label, entry in result["sides"].items():
        if "out_of_memory" in entry:
            rows.append([label, "out of memory", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                label,
                _span(entry["seconds"]),
                _number(entry.get("time_over_trl_sdpa"), 3),
                entry["tokens_forwarded"],
                f"{entry['tokens_per_real_token']:.2f}",
                _gib(entry["peak_bytes"]),
            ]
        )
    headers = ["side", "forward + backward s", "/ trl sdpa", "tokens forwarded", "per real token", "peak GiB"]
    return [
        f"{batch['label']}: {batch['rows']} rows of {batch['width']} columns, {batch['real_tokens']} real tokens; "
        f"{result['precision']}, gradient checkpointing on.",
        "",
        format_table(headers, rows),
    ]


def _host(result: dict) -> list[str]:
    rows = []
    for label, entry in result["sides"].items():
        rows.append(
            [
                label,
                f"{entry['host_s'] * 1e3:.2f}",
                "-" if "device_gap_s" not in entry else f"{entry['device_gap_s'] * 1e3:.2f}",
                entry["package_syncs_per_chunk"],
                "; ".join(f"{site} x{n}" for site, n in entry["sync_sites"].items())[:160],
            ]
        )
    headers = ["side", "host ms before the model", "device gap ms", "package syncs / chunk", "sites"]
    return [format_table(headers, rows)]


def _truncation(result: dict) -> list[str]:
    if "error" in result:
        return [f"Not timed: `{result['error']}` (the match's API changed?)."]
    return [
        f"{result['batch']['label']}, {result['cuts']}, vocabulary {result['vocab']}: the match "
        f"{result['match_s']:.3f} s against one forward's {result['forward_s']:.3f} s "
        f"({result['match_over_forward']:.2f}x); {result['extra_s_per_1000_positions']:.3g} s more per 1,000 "
        f"completion positions, {result['extra_s_at_64x8192']:.3g} s at 64 x 8,192."
    ]


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
    "engagement": ("1. Does packing engage? (self-check, fallback)", _engagement),
    "exactness": ("2. |packed - padded| log-prob on several packed rows", _exactness),
    "attention": ("3. Attention kernels and masked-attention throughput", _attention),
    "memory": ("4. Peak memory", _memory),
    "speed": ("5. Forward + backward time", _speed),
    "host": ("6. Host time before each forward, host syncs", _host),
    "truncation": ("7. The truncation match's cost", _truncation),
    "equivalence": ("Equivalence with stock TRL", _equivalence),
    "syncs": ("Host synchronisations", _syncs),
    "kernels": ("Loss kernels", _kernels),
    "nonfinite": ("Non-finite guard", _nonfinite),
    "e2e": ("End to end (GRPOTrainerExt / stock TRL)", _e2e),
    "forward": ("The log-prob forward on a small model (padding-free / TRL's padded)", _forward),
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
