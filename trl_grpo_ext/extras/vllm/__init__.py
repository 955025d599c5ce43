"""What is vLLM-specific, imported where `use_vllm` is on: the sampler's truncation matched, TRL's correction, the
sampler/trainer mismatch."""
