"""What runs apart from the trainer, which never imports it at module level: the `trl-grpo-ext` command (`cli`, `env`),
the report (`report`), the model card added to TRL's (`card`) and the recipes (`recipes`)."""
