"""Helpers shared by the test modules (importable as `helpers`: pytest puts tests/ on sys.path)."""


def count_a_reward(completions, **kwargs) -> list[float]:
    """Rewards letters 'a' and length: different completions of one prompt get different rewards."""
    return [completion.count("a") + 0.1 * len(completion) for completion in completions]


def tiny_grpo_args(output_dir, **overrides) -> dict:
    """Keyword arguments for a few-step CPU GRPO run on the tiny model."""
    args = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    args.update(overrides)
    return args
