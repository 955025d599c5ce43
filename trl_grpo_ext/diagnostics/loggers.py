"""The diagnostics' histograms to the loggers that draw them: TensorBoard, trackio and Weights & Biases.

Histograms have no common path through `Trainer.log` (a non-scalar value in `logs` would land in
`trainer_state.json` and every other logger): they are written here, after the scalars of the same log step, under
the tags of the callback's scalars (`train/ratio/histogram`). Other loggers get the scalars only.
"""

from __future__ import annotations

from transformers.integrations import TensorBoardCallback, TrackioCallback, WandbCallback
from transformers.trainer_callback import CallbackHandler

__all__ = ["histogram_edges", "write_histograms"]


def histogram_edges(histogram: tuple) -> tuple[list[float], list[float]]:
    """`(counts, bin edges)` of a histogram as `DiagnosticsSummary` builds it, the `np_histogram` form that
    `trackio.Histogram` and `wandb.Histogram` take: the edges are the minimum, then each bucket's upper limit
    (`len(edges) == len(counts) + 1`)."""
    limits, counts, minimum = histogram[0], histogram[1], histogram[2]
    return list(counts), [minimum, *limits]


def _write_tensorboard(writer, histograms: dict[str, tuple], mode: str, step: int) -> int:
    for name, (limits, counts, minimum, maximum, number, total, squares) in histograms.items():
        writer.add_histogram_raw(
            tag=f"{mode}/{name}/histogram",
            min=minimum,
            max=maximum,
            num=number,
            sum=total,
            sum_squares=squares,
            bucket_limits=limits,
            bucket_counts=counts,
            global_step=step,
        )
    writer.flush()
    return len(histograms)


def _write_trackio(histograms: dict[str, tuple], mode: str, step: int) -> int:
    import trackio

    run = trackio.context_vars.current_run.get()
    if run is None:
        return 0
    # transformers' callback logs the scalars without a step, so trackio numbers them itself: the histograms take the
    # step of the scalars just logged (a later one would leave a gap in every curve).
    next_step = getattr(run, "_next_step", None)
    trackio_step = next_step - 1 if isinstance(next_step, int) and next_step > 0 else None
    trackio.log(_tracker_histograms(trackio.Histogram, histograms, mode, step), step=trackio_step)
    return len(histograms)


def _write_wandb(histograms: dict[str, tuple], mode: str, step: int) -> int:
    import wandb

    if wandb.run is None:
        return 0
    wandb.log(_tracker_histograms(wandb.Histogram, histograms, mode, step))
    return len(histograms)


def _tracker_histograms(histogram_type, histograms: dict[str, tuple], mode: str, step: int) -> dict:
    """trackio's or W&B's histograms, with `train/global_step` (the optimizer step, which transformers' callbacks
    plot every metric against)."""
    metrics = {
        f"{mode}/{name}/histogram": histogram_type(np_histogram=histogram_edges(histogram))
        for name, histogram in histograms.items()
    }
    return {**metrics, "train/global_step": step}


def write_histograms(callback_handler: CallbackHandler, histograms: dict[str, tuple], mode: str, step: int) -> int:
    """Write `histograms` (as built by `DiagnosticsSummary`) to the trainer's TensorBoard writer, trackio run and W&B
    run, each when the trainer has its callback (`report_to`) and the run is open.

    Args:
        callback_handler: the trainer's callbacks (`trainer.callback_handler`).
        histograms: name -> (bucket upper limits, counts, minimum, maximum, number, sum, sum of squares).
        mode: `"train"` or `"eval"`, the prefix of the tags.
        step: the optimizer step (`trainer.state.global_step`).

    Returns:
        `int`: the number of histograms written, over all loggers (0 when none takes them).
    """
    if not histograms:
        return 0
    written = 0
    for callback in callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and getattr(callback, "tb_writer", None) is not None:
            written += _write_tensorboard(callback.tb_writer, histograms, mode, step)
        elif isinstance(callback, TrackioCallback):
            written += _write_trackio(histograms, mode, step)
        elif isinstance(callback, WandbCallback):
            written += _write_wandb(histograms, mode, step)
    return written
