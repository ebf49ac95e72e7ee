"""A 2bw run's state in Megatron's own checkpoints: Megatron's `--save`/`--load` carry
the weight stash, the delay-correction state, the stale global norm and the RNG, in its
own formats, next to the rest of the optimizer.

- optimizer_state.py: what our optimizers add to the sharded state dict Megatron
  saves (per-rank objects; the stash laid out like the model's weights, whose layout
  is the stash's own: stash/stash_checkpoint.py) and take out again on load, and the
  same state gathered for a per-rank file.
- side_files.py: one file per rank next to the checkpoint, for the torch format,
  which saves no per-rank objects; the error a checkpoint that breaks its promise
  raises.
- marker.py: `megatron_async.json`, what a checkpoint holds of ours, written with it
  and read back on resume; which checkpoint `--load` resumes.
- saved_rng.py: the RNG state saved is the one from before the next batch's warm-up
  forwards, so a resumed run draws the same dropout masks.
"""
