"""The Hugging Face export at scale: its peak memory and time against the model's size (docs/benchmarks.md)."""
