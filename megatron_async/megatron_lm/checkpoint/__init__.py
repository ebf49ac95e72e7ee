"""A 2bw run's state in Megatron's own checkpoints: the marker, the per-rank files and the
optimizer's sharded state (the stash's own torch_dist layout: stash/stash_checkpoint.py)."""
