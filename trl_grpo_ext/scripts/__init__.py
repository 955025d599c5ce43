"""Scripts behind the `trl-grpo-ext` command: `grpo` (the recipe) and `demo` (the offline demo)."""
