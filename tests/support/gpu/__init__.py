"""GPU test support: launching, comparing and reporting the GPU acceptance suite (tests/gpu)."""
