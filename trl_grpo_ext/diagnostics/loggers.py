"""Sending the diagnostics' histograms to the loggers that draw them: TensorBoard, trackio and Weights & Biases.

Scalars travel through `Trainer.log` to every logger named in `report_to`. Histograms have no such common path (a
non-scalar value in `logs` would also land in `trainer_state.json` and in every other logger), so they are written
here, after the scalars of the same log step, to each of these loggers whose callback the trainer holds and whose run
is open, under the tags of the callback's scalars (`train/ratio/histogram`, `eval/reward_std/group/histogram`).
Other loggers get the scalars only.
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
    # transformers' callback logs the scalars without a step, so trackio numbers them itself; the histograms take the
    # step of the scalars just logged (a later step would leave a gap in every curve). `train/global_step` is the
    # optimizer step, as in the callback's scalars (trackio can plot against it).
    next_step = getattr(run, "_next_step", None)
    trackio_step = next_step - 1 if isinstance(next_step, int) and next_step > 0 else None
    metrics = {
        f"{mode}/{name}/histogram": trackio.Histogram(np_histogram=histogram_edges(histogram))
        for name, histogram in histograms.items()
    }
    trackio.log({**metrics, "train/global_step": step}, step=trackio_step)
    return len(metrics)


def _write_wandb(histograms: dict[str, tuple], mode: str, step: int) -> int:
    import wandb

    if wandb.run is None:
        return 0
    metrics = {
        f"{mode}/{name}/histogram": wandb.Histogram(np_histogram=histogram_edges(histogram))
        for name, histogram in histograms.items()
    }
    # transformers' callback plots every metric against `train/global_step` (`define_metric(..., step_metric=...)`).
    wandb.log({**metrics, "train/global_step": step})
    return len(metrics)


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
