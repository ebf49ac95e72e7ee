"""The adapter: Megatron's hooked names, our flags, the delayed run inside Megatron's loop,
the per-run state and the GPT entry point."""
