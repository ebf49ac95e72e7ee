"""Checks on one GPU: 2bw over real NCCL and the 10B MoE stage's memory, each one command (docs/benchmarks.md)."""
