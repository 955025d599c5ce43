"""What a person reads of a run, one module each:

- `watch`: one record per metric row of the documents' tables (what it is, healthy and worrying values), with the
  signals `health` judges and the console shows; the record type and the tables' rendering in `metric_record`;
- `figure`: `report.png`, the training curves with the alarm episodes shaded;
- `health`: one verdict per signal of a run's log history, from the alarm rules;
- `command`: `trl-grpo-ext report RUN_DIR`;
- `formats`: its summary written as text, markdown or JSON, from one set of findings;
- `tensorboard`: a log history from TensorBoard event files, for a folder without a trainer state;
- `console`: the progress bar and one compact line per log step.
"""

from .figure import PANELS, build_report_figure, missing_panels, plot_training_report

__all__ = ["PANELS", "build_report_figure", "missing_panels", "plot_training_report"]
