"""What `--load` and `--save` hold, checked before Megatron builds anything.

No silent fresh start over checkpoints, a writable `--save`, a checkpoint format that
carries 2bw's state, and at a resume: the marker that says how to read a checkpoint,
unchanged since the save, the files every rank reads before the load unchanged too,
the same tied or untied embeddings, the same weight-stash depth, a delay correction
that can use the saved state, and a layout the per-rank state was saved at. These read
the disk, so they live here, beside the other guards; the flag module only parses and
calls them.
"""

from __future__ import annotations

import argparse
import os
import re

from megatron_async.megatron_lm.checkpoint.marker import (MARKER, holds_a_stash, resume_directory,
                                                          saved_contents, saved_megatron_args)
from megatron_async.megatron_lm.checkpoint.marker_checksum import seal_matches
from megatron_async.megatron_lm.safety.checkpoint_guard import (complete_iterations, fresh_start_notice,
                                                                resume_problem, unwritable_save)
from megatron_async.megatron_lm.safety.checksum_guard import verify_shared_files
from megatron_async.megatron_lm.safety.failures import FlagError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FlagError(message)


CARRY_2BW_STATE = ("torch_dist", "torch")  # formats tested to save and restore the stash and EF state


def _layout_text(sizes: dict) -> str:
    return " ".join(f"{k.upper()}={sizes[k]}" for k in ("pp", "tp", "ep", "dp"))


def check_checkpoints(args: argparse.Namespace, stash: bool) -> None:
    """No silent fresh start over checkpoints, a writable --save, and: what a run with a
    weight stash (`stash`: 2bw or a simulated delay) saves must carry it; what it loads
    must give it back."""

    for problem in (unwritable_save(args.save), resume_problem(args.load, args.save, getattr(args, "ckpt_step", None))):
        _require(problem is None, problem)
    _require(not (args.save and args.ckpt_format == "torch_dist" and args.mtp_num_layers
                  and not args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size > 1),
             "--ckpt-format torch_dist with --mtp-num-layers, tied embeddings (no "
             "--untie-embeddings-and-output-weights) and --pipeline-model-parallel-size > 1: Megatron-Core 0.19.2 "
             "cannot save it (an assertion in GPTModel.sharded_state_dict at the first save, under any schedule); "
             "use --ckpt-format torch or --untie-embeddings-and-output-weights")
    _require(args.eval_interval is not None or args.skip_train,
             "--eval-interval is required: Megatron sizes its validation data by --train-iters // --eval-interval "
             "(pass e.g. --eval-interval 1000; --eval-iters 0 skips validation)")
    if stash and args.save:
        _require(args.ckpt_format in CARRY_2BW_STATE,
                 f"--ckpt-format {args.ckpt_format}: not tested to carry 2bw's weight stash and delay-correction "
                 f"state; use {' or '.join(CARRY_2BW_STATE)}")
        _require(getattr(args, "non_persistent_ckpt_type", None) in (None, "global"),
                 f"--non-persistent-ckpt-type {args.non_persistent_ckpt_type}: not tested to carry 2bw's weight "
                 "stash; use global")
    if not args.load:
        return
    notice = fresh_start_notice(args.load, getattr(args, "ckpt_step", None),
                                getattr(args, "pretrained_checkpoint", None))
    if notice and not getattr(args, "exit_on_missing_checkpoint", False) and int(os.environ.get("RANK", "0")) == 0:
        print(notice, flush=True)
    held = saved_contents(args)
    _check_marker_intact(args, held)
    verify_shared_files(args, held)  # before anything below reads the checkpoint's .metadata
    _check_tied_embeddings_match(args)
    _check_iterations_left_to_train(args)
    _check_marker_present(args, held)
    if not held.get("weight_stash"):
        return
    where = held["loaded_from"]
    _require(stash or not held.get("embedding_copy_linked") or held.get("ckpt_format") != "torch",
             f"--load {args.load}: the checkpoint in {where} is a --pipeline-schedule 2bw run's in --ckpt-format "
             "torch with tied embeddings or --mtp-num-layers; there the last stage's optimizer state of its copy "
             "of the word embeddings followed discarded updates (2bw sends it the first stage's weights), and "
             "a synchronous schedule would step from it and untie the copy. Resume it with --pipeline-schedule "
             "2bw, or save it as --ckpt-format torch_dist (which keeps one copy) first")
    if not stash:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"megatron-async: {where} holds 2bw state (the older weight version"
                  f"{', the delay correction' if held.get('delay_correction') else ''}); this run is synchronous "
                  "and does not use it", flush=True)
        return
    # versions the stash keeps: the delay, or 1 for 2bw (whose marker says simulated_delay 0)
    from megatron_async.megatron_lm.adapter import run_mode

    mode = run_mode.of(args)
    saved_depth, depth = max(int(held.get("simulated_delay") or 0), 1), mode.stash_depth
    _require(saved_depth == depth,
             f"--simulated-delay {mode.simulated_delay}: the checkpoint in {where} keeps the weights of "
             f"{saved_depth} earlier step(s) for a delay of {saved_depth}, this run needs {depth}; "
             f"resume with a delay of {saved_depth}")
    _check_correction_state(args, held)
    saved = held.get("layout")
    wanted = {"pp": args.pipeline_model_parallel_size, "tp": args.tensor_model_parallel_size,
              "ep": args.expert_model_parallel_size,
              "dp": args.data_parallel_size * getattr(args, "context_parallel_size", 1)}
    if saved is None or saved == wanted:
        return
    per_rank = [name for name, held_here in (
        ("the weight stash", held.get("stash_layout") != "sharded"),
        ("the delay-correction state", held.get("delay_correction")),
        ("the stale global norm", held.get("stale_global_norm"))) if held_here]
    if per_rank:  # the sharded stash reshards with the model; per-rank state cannot
        raise FlagError(f"--load {args.load}: {', '.join(per_rank)} of this checkpoint is kept per rank, saved at "
                        f"{_layout_text(saved)}, and cannot be laid out for this run's {_layout_text(wanted)}; "
                        "resume at the saved layout")


def _tying(untied: bool) -> str:
    return ("--untie-embeddings-and-output-weights (separate output weights)" if untied
            else "tied input and output embeddings (Megatron's default, no --untie-embeddings-and-output-weights)")


def _check_iterations_left_to_train(args: argparse.Namespace) -> None:
    """--train-iters at the iteration the run resumes from, a finished run (a requeue after its
    last save, a load-time measurement): Megatron loads, evaluates and exits 0 having trained
    nothing, without a word; say it (rank 0), once, up front. Below it, Megatron would train
    nothing too, with a learning-rate schedule that ended before the checkpoint: its schedule
    check refuses that after the model is built, and with that check overridden it evaluates
    and exits 0 (or fails building a data sampler with no samples left); refused here in one
    line instead. --skip-train only evaluates, as asked; --finetune starts at iteration 0."""
    directory = resume_directory(args)
    match = re.search(r"iter_(\d{7})$", os.path.normpath(directory)) if directory else None
    if (match is None or args.train_iters is None or args.skip_train or getattr(args, "finetune", False)
            or args.train_iters > int(match.group(1))):
        return
    resumed = int(match.group(1))
    _require(args.train_iters == resumed,
             f"--train-iters {args.train_iters} is below iteration {resumed}, where --load {args.load} resumes: "
             f"nothing would be trained; raise --train-iters above {resumed} to go on, resume an earlier checkpoint "
             "with --ckpt-step, or pass --skip-train to only evaluate this one")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"megatron-async: --train-iters {args.train_iters} is iteration {resumed}, where --load {args.load} "
              "resumes: nothing will be trained (Megatron evaluates and exits); raise --train-iters to go on",
              flush=True)


def _check_marker_intact(args: argparse.Namespace, held: dict) -> None:
    """A megatron_async.json whose content no longer matches the checksum it holds of itself
    (edited or damaged after the save) would resume the checkpoint as it now says, without a
    word: refused, naming the file and the opt-out."""
    if not held or getattr(args, "no_checkpoint_checksums", False) or seal_matches(held) is not False:
        return
    path = os.path.join(held["loaded_from"], MARKER)
    _require(False, f"--load {args.load}: {path} does not match the checksum it holds of its own content (it "
                    "changed after the save); it says how the checkpoint resumes (its weight stash, delay-correction "
                    "state, layout and file checksums): restore it from a copy of the checkpoint, or pass "
                    "--no-checkpoint-checksums to resume as it says now")


def _check_marker_present(args: argparse.Namespace, held: dict) -> None:
    """A checkpoint whose files hold a 2bw weight stash but whose megatron_async.json (what
    says how to read it) is gone, or says it holds none, would resume with both weight
    versions equal, silently another trajectory: refused, naming the file and the previous
    complete checkpoint."""
    directory = resume_directory(args)
    if (held.get("weight_stash") or directory is None or args.finetune or args.no_load_optim
            or not holds_a_stash(directory)):
        return
    name = os.path.basename(os.path.normpath(directory))
    older = [i for i in complete_iterations(args.load) if f"iter_{i:07d}" < name]
    previous = f"; the previous complete checkpoint is iteration {older[-1]} (--ckpt-step {older[-1]})" if older else ""
    lacks = (f"its {MARKER} says it holds none" if held
             else f"not its {MARKER}, which says how to read it (lost, or the checkpoint was copied without it)")
    _require(False, f"--load {args.load}: the checkpoint in {directory} holds a 2bw weight stash but {lacks}, so "
                    f"the run would resume with both weight versions equal: restore the file{previous}, or pass "
                    "--no-load-optim to start both versions from the loaded weights on purpose")


def _check_tied_embeddings_match(args: argparse.Namespace) -> None:
    """Tied to untied or back at a resume: Megatron loads either without a word, dropping
    the trained output layer or starting it from the embeddings. Refused, naming both."""
    directory = resume_directory(args)
    saved = saved_megatron_args(directory) if directory else None
    if saved is None or not hasattr(saved, "untie_embeddings_and_output_weights"):
        return
    was, now = bool(saved.untie_embeddings_and_output_weights), bool(args.untie_embeddings_and_output_weights)
    _require(was == now, f"--load {args.load}: the checkpoint in {directory} was trained with {_tying(was)}; "
                         f"this run has {_tying(now)}. Resume with the same choice")


def _check_correction_state(args: argparse.Namespace, held: dict) -> None:
    """A delay correction switched on or off at a resume is allowed, and said: turned on,
    it starts with no previous update (its first step after the resume is uncorrected,
    as at iteration 1); turned off, the saved state is left unused. One correction
    swapped for another is refused: their saved states differ, and weight prediction
    keeps a stash of another shape."""
    from megatron_async.corrections.delay_correction import RULES

    where, saved_rule, rule = held["loaded_from"], held.get("delay_correction_rule"), args.delay_correction
    if saved_rule is not None and saved_rule != rule:  # None: saved before the rule was recorded
        _require("predict" not in (saved_rule, rule) and not (saved_rule in RULES and rule in RULES),
                 f"--delay-correction {rule}: the checkpoint in {where} was saved with --delay-correction "
                 f"{saved_rule}, whose saved state this run cannot use; resume with --delay-correction {saved_rule}")
    if int(os.environ.get("RANK", "0")) != 0:
        return
    wanted, saved = rule in RULES, bool(held.get("delay_correction"))
    if wanted and not saved:
        print(f"megatron-async: {where} holds no delay-correction state; --delay-correction {rule} starts "
              "without a previous update (its first step after the resume is uncorrected)", flush=True)
    elif saved and not wanted:
        print(f"megatron-async: {where} holds delay-correction state; this run has no --delay-correction "
              "and does not use it", flush=True)
