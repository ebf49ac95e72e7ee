"""What each fault does to a job, and the tests that show it.

docs/megatron_lm.md's fault table is `render()` of FAULTS; tests/test_fault_table.py
checks that the docs hold exactly that table and that every test named here exists.
"""

FAULTS = [
    ("a truncated shard, `torch_dist`",
     "exit 2 before training, naming the checkpoint, its damaged files and the previous complete iteration",
     ["tests/test_checkpoint_guard.py::test_a_truncated_checkpoint_is_named_with_the_previous_complete_one"]),
    ("a 0-byte shard or a deleted `.metadata`, `torch_dist`, read already in Megatron's argument validation "
     "(tied embeddings)",
     "exit 2 before training, naming the checkpoint, the damaged or missing file and the previous complete "
     "iteration; the `--ckpt-step` it advises resumes into the same `--save`, saving over the damaged one",
     ["tests/test_checkpoint_guard.py::test_a_damaged_checkpoint_read_in_validation_is_named_and_the_advice_works"]),
    ("a truncated `model_optim_rng.pt`, `torch` format, on every rank or on one",
     "exit 2 (Megatron's loader exits 0 there) on each rank that found it, naming the file, the rank and the "
     "previous complete iteration; torchrun's root cause is that rank",
     ["tests/test_checkpoint_guard.py::test_a_torn_torch_format_checkpoint_fails_naming_the_file_and_the_rank"]),
    ("a longer `--train-iters` on resume",
     "exit 2 before training, in iterations, naming `--override-opt_param-scheduler` and "
     "`--use-checkpoint-opt_param-scheduler`",
     ["tests/test_checkpoint_guard.py::test_a_longer_run_on_resume_names_the_scheduler_flags"]),
    ("`kill -9` of torchrun, started with `-m megatron_async.launch` or a training script with the patched "
     "Megatron (`megatron-async-pretrain` takes the launcher's watch and the package's)",
     "every process the job started (workers, the checkpoint writer's Managers, resource trackers) is gone "
     "within 10 s; a worker killed outright leaves its Manager to the same parent watch",
     ["tests/test_long_runs.py::test_no_process_outlives_a_killed_job"]),
    ("a second job on the `--save` of a live job",
     "refused before training on every rank, naming the first job (host, pid, start time); after `kill -9` of "
     "the first, its requeue takes the lock and trains",
     ["tests/test_save_lock.py::test_a_second_job_on_a_live_jobs_save_is_refused_and_a_requeue_after_kill_takes_it",
      "tests/test_save_lock.py::test_jobs_on_different_save_directories_both_train"]),
    ("the `--save` lock taken over while the job runs",
     "the job stops before its next save, naming the job that took it",
     ["tests/test_save_lock.py::test_a_job_whose_save_was_taken_over_stops_before_its_next_save"]),
    ("no room for one checkpoint in `--save`",
     "exit 2 before training on every rank, naming the free space and what one checkpoint needs",
     ["tests/test_save_space.py::test_a_save_without_room_is_refused_before_training"]),
    ("the disk fills during a save",
     "exit 2 on every rank with one line naming ENOSPC, the folder and the last complete checkpoint, no "
     "traceback; the partial folder is renamed `iter_N.torn`, and the tracker still names the complete one",
     ["tests/test_save_space.py::test_a_disk_that_fills_during_a_save_is_one_line_and_the_partial_folder_set_aside"]),
    ("a refusal in a training script with the patched Megatron (no launcher of ours)",
     "our one line, last on stderr, and exit 2, not a traceback",
     ["tests/test_patches.py::test_a_refusal_in_a_patched_script_is_our_one_line_and_exit_code"]),
    ("`--save` without `--save-interval`",
     "exit 2 before training, naming both flags",
     ["tests/test_refusals.py::test_refused_before_training_naming_the_flag"]),
    ("`--finetune`, `--no-load-optim`, `--pretrained-checkpoint`, a checkpoint without a stash, a fresh start; "
     "under each delay correction",
     "the stash starts at the weights as loaded (the first iteration equals `--simulated-delay 0`'s), and a "
     "start that loaded weights says so",
     ["tests/test_stash_start.py::test_a_delayed_start_begins_at_the_loaded_weights",
      "tests/test_stash_start.py::test_2bw_finetune_with_prediction_begins_at_the_loaded_weights"]),
    ("a non-finite loss or gradient norm",
     "exit 3, naming the iteration and the pipeline stage, before any checkpoint of those weights",
     ["tests/test_megatron_loop.py::test_non_finite_loss_stops_every_schedule_before_any_checkpoint"]),
    ("an empty `--input` among others in `megatron-async-prepare-data`",
     "skipped, and named",
     ["tests/test_prepare_data.py::test_an_empty_input_among_others_is_named_when_skipped"]),
]

BEGIN, END = "<!-- fault table: tests/fault_matrix.py -->", "<!-- end of fault table -->"


def render() -> str:
    rows = ["| fault | what the job does | tests |", "| --- | --- | --- |"]
    for fault, outcome, tests in FAULTS:
        rows.append(f"| {fault} | {outcome} | {', '.join(f'`{t}`' for t in tests)} |")
    return "\n".join([BEGIN, *rows, END])
