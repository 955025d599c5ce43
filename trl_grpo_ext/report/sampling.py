"""The report's `sampling:` line for the console's end of training (`tools.report.sampling`), loaded only then."""


def sampling_summary(log_history: list[dict]) -> dict | None:
    """`trl_grpo_ext.tools.report.sampling.sampling_summary`."""
    from ..tools.report.sampling import sampling_summary as summary  # the tools load at the end of training only

    return summary(log_history)
