"""The trainer behind `megatron-async-pretrain`: flags, model, data, loop, checkpoints."""
