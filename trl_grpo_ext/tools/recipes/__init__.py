"""The recipe behind `trl-grpo-ext grpo` and `demo` (`grpo`), its command line (`arguments`), data (`data`), reward
functions (`rewards`), the SLURM launcher (`slurm`), and the demo's model, data and configs (`tiny/`)."""
