"""Opt-in features, each imported by the trainer only when its option is on:

- `dynamic` and `plan`: dynamic sampling (`dynamic_sampling`);
- `selective`: selective rollouts (`selective_rollouts`, experimental);
- `skipping`: exact skipping of the rows that cannot move the loss (`skip_zero_advantage_rows`);
- `heldout`, `heldout_scoring` and `generation`: held-out evaluation (`heldout_metrics`);
- `vllm`: with `use_vllm`, the sampler's truncation matched (`match_sampler_truncation`), TRL's correction and the
  sampler/trainer mismatch;
- `console`: the compact console line (`console="compact"`); `alerts`: alarms as tracker alerts.
"""
