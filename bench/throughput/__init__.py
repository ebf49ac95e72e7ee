"""Throughput: pipeline schedules in Megatron's loop and in PyTorch's, per-stage costs, start-up, the GPU projection."""
