"""The plugin's side of Megatron-LM, one folder per concern:

- `adapter/`: what plugs 2bw into Megatron's training loop: every hooked name and
  `install()` (hooks.py), our flags and their checks (flags.py, optimizer_probe.py),
  the delayed runs and their optimizer (runtime.py; one class per mode: two_bw_run.py,
  simulated_delay_run.py), the one object per training run
  (plugin_run.py), the GPT entry point (gpt.py) and the layout-invariant weight
  initialisation (layout_invariant_init.py).
- `checkpoint/`: what a Megatron checkpoint holds of ours and how it gets there: the
  optimizer's sharded state (optimizer_state.py), per-rank files for the torch format
  (side_files.py), `megatron_async.json` (marker.py, with the checksum of its own content:
  marker_checksum.py) and the saved RNG (saved_rng.py);
  the stash's own torch_dist layout is stash/stash_checkpoint.py.
- `safety/`: what keeps a run from losing work or hanging: one writer per --save
  (save_lock.py), room for a checkpoint (save_space.py) and a disk that fills during a
  save (full_disk.py), no silent restart over
  checkpoints (checkpoint_guard.py), one line and exit code per failure (failures.py),
  no orphaned workers (launcher_watch.py), logs flushed before our own exits
  (exit_flush.py).
- `observability/`: what a run reports: --metrics-json lines (metrics.py, records.py),
  each rank's pace and memory (rank_stats.py), the loss plot (loss_plot.py), the
  MoE routing record (moe_routing.py) and which grad norm Megatron logs under 2bw
  (grad_norm_note.py).
"""
