"""Sending the diagnostics' histograms to the loggers that draw them.

Scalars travel through `Trainer.log` to every logger named in `report_to`. Histograms have no such common path:
they are written here to the loggers that take raw histograms (TensorBoard), and skipped for the others.
"""

from __future__ import annotations

from transformers.integrations import TensorBoardCallback
from transformers.trainer_callback import CallbackHandler

__all__ = ["write_histograms"]


def write_histograms(callback_handler: CallbackHandler, histograms: dict[str, tuple], mode: str, step: int) -> int:
    """Write `histograms` (as built by `DiagnosticsSummary`) to the TensorBoard writer of the trainer, if any.

    Tags follow the TensorBoard callback's scalar tags: `train/ratio/histogram`, `eval/reward_std/group/histogram`.

    Returns:
        `int`: the number of histograms written (0 when no TensorBoard writer is open).
    """
    written = 0
    for callback in callback_handler.callbacks:
        writer = getattr(callback, "tb_writer", None) if isinstance(callback, TensorBoardCallback) else None
        if writer is None:
            continue
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
            written += 1
        writer.flush()
    return written
