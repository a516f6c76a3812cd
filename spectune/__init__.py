"""spectune: observability and autotuning for speculative decoding."""
