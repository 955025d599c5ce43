"""The `trl-grpo-ext` command (`cli`) and the recipes behind it: `grpo` (the recipe script) and `demo` (the offline
demo), with what they use and the trainer does not: the command line (`arguments`, its `--help` in `help_format`),
data loading (`data`), reward functions (`rewards`), held-out evaluation (`evaluation`), the demo task (`reversal`,
its shipped files in `tiny/`) and the SLURM launcher (`slurm`)."""
