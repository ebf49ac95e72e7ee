"""The plugin's side of Megatron-LM: the hooks into its training loop, flags, checkpoints and logs."""
