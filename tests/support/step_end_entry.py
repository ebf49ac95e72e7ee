"""`python -m tests.support.step_end_entry ARGS`: megatron_async.launch for the tests that
need a runtime changed in one place, each change switched on from the environment. Most are
negative controls: a runtime without one of its safeguards, which the test must catch.

- MEGATRON_ASYNC_TEST_OLD_RUNTIME=1: a 2bw runtime without its step-end receive (a stage
  receives a later batch's activation only in its next step) whose exit paths drain only
  at a normal end of training: the CPU emulation of NCCL must catch its hangs, and the exit
  report must count the sends it leaves at exit (tests/test_step_end_waits.py);
- MEGATRON_ASYNC_TEST_OLD_STASH_START=1: a stash start that keeps a stash already at the
  run's iteration instead of following the checkpoint load, so it holds the weights from
  before the load (tests/test_stash_start.py);
- MEGATRON_ASYNC_TEST_OLD_LOAD_EXIT=1: Megatron's bare `sys.exit()` on its load path passed
  through unchanged (exit code 0; tests/test_checkpoint_guard.py);
- MEGATRON_ASYNC_TEST_CLOCK_AHEAD_S=S: Megatron's training clock (`_TRAIN_START_TIME`)
  started S seconds earlier, so that `--exit-duration-in-mins 1` runs out S seconds
  sooner (tests/test_stop_agreement.py);
- MEGATRON_ASYNC_TEST_OLD_TIED_CONTACT=1: the tied link's pair communicator made by an
  all-reduce of the pair (a communicator nothing uses), with no first contact: under NCCL's
  lazy pair communicators the first stage's first gradient receive then hangs
  (tests/test_tied_link_waits.py, and `make test-gpu-ranks` on real NCCL);
- MEGATRON_ASYNC_TEST_OLD_TIED_RECV=1: the tied gradient receive posted at the batch's first
  backward, a whole batch before its sender's step;
- MEGATRON_ASYNC_TEST_EMPTY_CACHE_ON_STAGE0=1: `torch.cuda.empty_cache()` after every
  forward and backward of the first stage, as an allocator retry would anywhere in a batch;
- MEGATRON_ASYNC_TEST_OLD_MARKERLESS_RESUME=1: a checkpoint whose files hold a stash but
  whose megatron_async.json is gone resumes without refusal, with both weight versions equal
  (the resume tests' negative controls: a resume without our state must differ);
- MEGATRON_ASYNC_TEST_EXIT_AFTER_SAVE=N: the process exits (code 9, as if killed) right after
  Megatron's save of iteration N returned, tracker written, before anything of ours that
  follows it (tests/test_stash_save.py: a node lost there);
- MEGATRON_ASYNC_TEST_QUICK_SNIFF=1: Megatron's `--gpu-sniff-test-interval` check with
  its GEMM and bandwidth benchmarks (80 s on the CPU) replaced by one all-reduce over
  all ranks and a device synchronisation, keeping what matters to the pipeline:
  Megatron's barrier-timed bracket around all-rank collectives;
- MEGATRON_ASYNC_TEST_EXIT_REPORT=DIR: each rank's sends left unwaited at exit, written to
  DIR (tests/support/exit_report.py).
"""

import os
import sys

import torch

from tests.support import exit_report


def _old_step_end() -> None:
    """train_step without the early receive; drain receives it instead."""
    from megatron_async.pipeline.executor import StageExecutor

    train_step, drain = StageExecutor.train_step, StageExecutor.drain

    def train_step_without_receive(self, step: int, data_for):
        self._receive_sent_ahead = lambda: None  # shadows the method for this call only
        try:
            return train_step(self, step, data_for)
        finally:
            del self._receive_sent_ahead

    def drain_receiving_first(self) -> None:
        self._receive_sent_ahead()
        drain(self)

    StageExecutor.train_step, StageExecutor.drain = train_step_without_receive, drain_receiving_first


def _old_exit_paths() -> None:
    """finish only when train returned normally; nothing when it raised or exited."""
    from megatron_async.megatron_lm.adapter.two_bw_run import TwoBWRun

    finish = TwoBWRun.finish

    def finish_unless_leaving(self):
        if sys.exc_info()[0] is None:
            finish(self)

    TwoBWRun.finish = finish_unless_leaving
    TwoBWRun.abandon = lambda self: None


def _old_stash_start() -> None:
    from megatron_async.megatron_lm.adapter.runtime import DelayedRun

    start = DelayedRun.start_from_checkpoint

    def start_unless_at_the_iteration(self, args):
        if self.stash.newest != args.iteration:
            start(self, args)

    DelayedRun.start_from_checkpoint = start_unless_at_the_iteration


def _old_load_exit() -> None:
    import dataclasses
    import functools

    from megatron_async.megatron_lm.adapter import hooks

    def passing_exits_through(original):
        wrapped = hooks._load_checkpoint(original)

        @functools.wraps(original)
        def hooked(*args, **kwargs):
            try:
                return wrapped(*args, **kwargs)
            except Exception as err:
                if isinstance(err.__context__, SystemExit):  # what the hook made of Megatron's exit
                    raise err.__context__ from None
                raise

        return hooked

    hooks.HOOKS = tuple(dataclasses.replace(h, wrap=passing_exits_through) if h.name == "load_checkpoint" else h
                        for h in hooks.HOOKS)


def _old_tied_contact() -> None:
    import torch.distributed as dist

    from megatron_async.pipeline import p2p, tied_embeddings, two_bw

    make = p2p.first_last_group

    def with_pair_all_reduce(pp_group):
        group = make(pp_group)
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=torch.cuda.current_device()), group=group)
        return group

    two_bw.first_last_group = with_pair_all_reduce
    tied_embeddings.TiedEmbeddings.connect = lambda self: None


def _old_tied_recv() -> None:
    from megatron_async.pipeline import executor

    backward = executor.StageExecutor._backward

    def posting_at_the_first_backward(self, action):
        runner_tied = getattr(self, "tied_link_for_tests", None)
        if runner_tied is not None and action.microbatch % self.m == 0:
            runner_tied.post_grad_recv()
        return backward(self, action)

    executor.StageExecutor._backward = posting_at_the_first_backward
    from megatron_async.pipeline import two_bw

    init = two_bw.TwoBWRunner.__init__

    def keeping_the_link(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.executor.tied_link_for_tests = self.tied

    two_bw.TwoBWRunner.__init__ = keeping_the_link


def _empty_cache_on_stage0() -> None:
    from megatron_async.pipeline import executor

    for name in ("_forward", "_backward"):
        compute = getattr(executor.StageExecutor, name)

        def then_empty_cache(self, action, *data, compute=compute):
            compute(self, action, *data)
            if self.is_first:
                torch.cuda.empty_cache()

        setattr(executor.StageExecutor, name, then_empty_cache)


def _exit_after_save(at: int) -> None:
    """Wraps Megatron's save itself, so the plugin's hook (installed later) wraps this."""
    from megatron.training import training

    save = training.save_checkpoint

    def save_then_exit(iteration, *args, **kwargs):
        result = save(iteration, *args, **kwargs)
        if iteration == at:
            sys.stdout.flush()
            os._exit(9)
        return result

    training.save_checkpoint = save_then_exit


def _quick_sniff(tag="", pg_collection=None):
    value = torch.ones(1)
    torch.distributed.all_reduce(value)  # over all ranks, as the real check's all-reduce benchmark
    torch.cuda.synchronize()


if __name__ == "__main__":
    if os.environ.get("MEGATRON_ASYNC_TEST_OLD_RUNTIME") == "1":
        _old_step_end()
        _old_exit_paths()
    if os.environ.get("MEGATRON_ASYNC_TEST_OLD_STASH_START") == "1":
        _old_stash_start()
    if os.environ.get("MEGATRON_ASYNC_TEST_OLD_LOAD_EXIT") == "1":
        _old_load_exit()
    if os.environ.get("MEGATRON_ASYNC_TEST_CLOCK_AHEAD_S"):
        from megatron.training import training

        training._TRAIN_START_TIME -= float(os.environ["MEGATRON_ASYNC_TEST_CLOCK_AHEAD_S"])
    if os.environ.get("MEGATRON_ASYNC_TEST_OLD_TIED_CONTACT") == "1":
        _old_tied_contact()
    if os.environ.get("MEGATRON_ASYNC_TEST_OLD_TIED_RECV") == "1":
        _old_tied_recv()
    if os.environ.get("MEGATRON_ASYNC_TEST_EMPTY_CACHE_ON_STAGE0") == "1":
        _empty_cache_on_stage0()
    if os.environ.get("MEGATRON_ASYNC_TEST_OLD_MARKERLESS_RESUME") == "1":
        from megatron_async.megatron_lm.safety import resume_checks

        resume_checks._check_marker_present = lambda args, held: None
    if os.environ.get("MEGATRON_ASYNC_TEST_EXIT_AFTER_SAVE"):
        _exit_after_save(int(os.environ["MEGATRON_ASYNC_TEST_EXIT_AFTER_SAVE"]))
    if os.environ.get("MEGATRON_ASYNC_TEST_QUICK_SNIFF") == "1":
        from megatron.training import gpu_sniff_test

        gpu_sniff_test.run_gpu_sniff_test = _quick_sniff
    if os.environ.get(exit_report.EXIT_REPORT_ENV):
        exit_report.install()
    from megatron_async.launch import main

    sys.exit(main())
