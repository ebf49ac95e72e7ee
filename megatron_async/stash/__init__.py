"""The weight stash: two weight versions per stage (weight_stash.py), and its layout in a torch_dist
checkpoint (stash_checkpoint.py; the rest of our checkpoint code is megatron_lm/checkpoint/)."""
