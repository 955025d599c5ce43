"""Benchmarks of trl_grpo_ext against stock TRL: `python -m trl_grpo_ext.bench --help`."""
