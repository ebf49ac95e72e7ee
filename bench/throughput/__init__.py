"""Throughput: pipeline schedules in Megatron's loop, per-stage costs, start-up, the GPU projection."""
