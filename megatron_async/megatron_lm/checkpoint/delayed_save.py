"""One checkpoint save of a delayed run, in the phases of Megatron's save_checkpoint.

Megatron-Core 0.19.2's save_checkpoint (megatron/training/checkpointing.py) writes every
rank's files, waits for every rank (a barrier), and then rank 0 names the tracker file
and writes it. A delayed run's checkpoint is whole only with our marker
(checkpoint/marker.py) and, in the torch format, our per-rank files, so no tracker may
name it before they are there. The save hook (megatron_lm/adapter/hooks.py) makes one
`DelayedSave` per save and holds it on the run while Megatron's save runs; the hooks on
the names Megatron calls inside it move it through its phases, in this order:

1. `before_megatron_writes`: no send outstanding over the save; in the torch format, our
   per-rank files and the marker (the directory is ours to create first);
2. `after_every_rank_wrote`: torch_dist, once Megatron's dist_checkpointing.save returned
   on every rank (this rank's files are whole): each rank hashes the files it wrote and
   rank 0 keeps the checksums for the marker (checkpoint/checksums.py);
3. `at_the_tracker`: rank 0, every rank having saved, right before Megatron writes the
   tracker: the torch_dist marker (torch_dist needs an empty directory to save into, so
   it cannot come first); a node lost between the two leaves the previous checkpoint
   tracked.

`after_megatron_returned` writes a marker still due where no tracker was named (an
asynchronous save: its tracker comes later). A save into a non-persistent directory
(--non-persistent-save-interval) writes nothing of ours.
"""

from __future__ import annotations

from megatron_async.megatron_lm.checkpoint.marker import checkpoint_dir, contents_to_save, write_marker


class DelayedSave:
    """One save: where it goes, what its marker records, and which phases it went through."""

    def __init__(self, run, root: str, iteration: int, persistent: bool = True):
        self.run, self.root, self.iteration = run, root, iteration
        self.contents = contents_to_save(run) if persistent else {}
        self.home = self.contents.get("per_rank_state")  # "files" (torch), "optimizer" (torch_dist) or None
        self.written = False  # every rank's files are whole (torch_dist)
        self.marker_due = self.home == "optimizer"

    def before_megatron_writes(self) -> None:
        from megatron_async.megatron_lm.checkpoint import side_files
        from megatron_async.megatron_lm.checkpoint.optimizer_state import per_rank_state

        self.run.drain()  # 2bw: no send outstanding over the save (it may outlast NCCL's watchdog)
        if self.home == "files":  # before Megatron's tracker names the checkpoint
            side_files.save(checkpoint_dir(self.root, self.iteration), per_rank_state(self.run))
            write_marker(self.root, self.iteration, self.contents, create=True)

    def after_every_rank_wrote(self, directory: str, with_checksums: bool) -> None:
        """Megatron's synchronous dist_checkpointing.save of `directory` (this save's) returned here."""
        if not self.marker_due or self.written:  # the checkpoint's own save is the first
            return
        from megatron_async.megatron_lm.checkpoint import checksums

        recorded = checksums.gather(directory) if with_checksums else None  # every rank takes part
        if recorded is not None:  # rank 0
            self.contents = {**self.contents, checksums.KEY: recorded}
        self.written = True

    def at_the_tracker(self) -> None:
        """Megatron names the tracker file: rank 0, every rank having saved."""
        if self.marker_due and self.written:
            self._write_due_marker()

    def after_megatron_returned(self) -> None:
        if self.marker_due:  # no tracker named on this rank (write_marker writes on rank 0 only)
            self._write_due_marker()

    def _write_due_marker(self) -> None:
        self.marker_due = False
        write_marker(self.root, self.iteration, self.contents)
