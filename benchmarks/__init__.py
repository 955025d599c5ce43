"""Benchmarks of trl_grpo_ext against stock TRL: `python -m benchmarks --help`."""
