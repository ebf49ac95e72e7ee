"""`--metrics-json`: one JSON line per iteration, next to Megatron's own logging.

Megatron's log line rounds the loss and TensorBoard needs a reader; a JSON line
per iteration (loss, learning rate, grad norm, seconds) is what plots, sweeps and
equivalence tests read. Written by the last rank (where Megatron prints), from
the values Megatron's training_log receives; nothing is communicated.
"""

from __future__ import annotations

import inspect
import time

from megatron_async.megatron_lm.observability.records import json_line, open_for_run, read_records

def _float(value):
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def _gpu_memory() -> dict:
    """This rank's peak GPU memory so far, in MiB (what the weight stash adds shows here);
    nothing on the CPU, where the emulation allocates no device memory."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"max_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


class MetricsRecorder:
    """One run's metrics file and clocks (megatron_lm/adapter/plugin_run.PluginRun holds it)."""

    def __init__(self):
        self.file = None
        self.started = None  # when Megatron's train started (a resumed run's too)
        self.last = None  # when the previous iteration was logged
        self.signature = None  # Megatron's training_log's, bound once
        self.eval = None  # (key, iteration) of the next evaluation
        self.rank_stats = None

    def _writer(self):
        """The metrics file on the rank that writes it (the last, where Megatron prints), else None."""
        import torch
        from megatron.training import get_args

        margs = get_args()
        if not margs.metrics_json or torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
            return None
        if self.file is None:
            self.file = open_for_run(margs.metrics_json, margs.iteration)
        return self.file

    def _rank_stats(self, iteration: int, seconds, pending_sends) -> None:
        """--rank-stats-dir: every rank's own pace, RSS and pending sends (no collective)."""
        from megatron.training import get_args

        args = get_args()
        if not args.rank_stats_dir:
            return
        if self.rank_stats is None:
            import torch

            from megatron_async.megatron_lm.observability.rank_stats import RankStats

            self.rank_stats = RankStats(args.rank_stats_dir, torch.distributed.get_rank(), resumed_from=args.iteration)
        if seconds is not None:
            self.rank_stats.iteration(seconds)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            extra = {"pending_sends": pending_sends} if pending_sends is not None else {}
            self.rank_stats.flush(iteration, **extra)

    def start_clock(self) -> None:
        """Megatron's train starts: the first iteration's seconds, a resumed run's included, count from here."""
        self.started = time.perf_counter()

    def record_iteration(self, training_log, args, kwargs, pending_sends=None) -> None:
        if self.signature is None:
            self.signature = inspect.signature(training_log)
        bound = self.signature.bind(*args, **kwargs).arguments
        now = time.perf_counter()
        since = self.last if self.last is not None else self.started
        seconds = now - since if since is not None else None
        # the ranks' steady pace leaves out the first iteration, whose seconds hold its warm-up
        self._rank_stats(bound["iteration"], now - self.last if self.last is not None else None, pending_sends)
        self.last = now
        out = self._writer()
        if out is None:
            return
        losses = {key.replace(" ", "_"): _float(value) for key, value in (bound["loss_dict"] or {}).items()}
        record = dict(iteration=bound["iteration"], **losses, lr=_float(bound["learning_rate"]),
                      grad_norm=_float(bound["grad_norm"]), skipped=bool(bound["skipped_iter"]), s_per_iter=seconds)
        record.update(_gpu_memory())
        out.write(json_line(record))
        out.flush()

    def record_routing(self, routing, args, kwargs) -> None:
        """An MoE model's routing this iteration (moe_routing.RoutingCounts); every rank takes part."""
        from megatron.training import get_args

        margs = get_args()
        if not margs.num_experts or not margs.metrics_json:
            return
        iteration = self.signature.bind(*args, **kwargs).arguments["iteration"]
        layers = margs.num_layers + (getattr(margs, "mtp_num_layers", None) or 0)  # MTP layers number after the rest
        record = routing.take_record(iteration, layers, margs.num_experts)
        out = self._writer()
        if out is not None and record is not None:
            out.write(json_line(record))
            out.flush()

    def evaluation_context(self, prefix: str, iteration: int) -> None:
        """Set by evaluate_and_print_results: which split and iteration the next evaluate is for."""
        if "test set" in prefix:
            key = "test_loss"
        elif "validation set" in prefix:  # Megatron's evaluation after training, on further batches
            key = "final_val_loss"
        else:  # "iteration N": every --eval-interval during training
            key = "val_loss"
        self.eval = (key, iteration)

    def record_evaluation(self, total_loss_dict) -> None:
        out = self._writer()
        if out is None or not total_loss_dict or self.eval is None:
            return
        key, iteration = self.eval
        loss = total_loss_dict.get("lm loss")
        if loss is not None:
            out.write(json_line({"iteration": iteration, key: _float(loss)}))
            out.flush()

    def finish(self, plot_path) -> None:
        """Close the metrics file; with --plot, draw train and validation loss from it."""
        out = self.file
        if out is None:
            return
        out.close()
        self.file = None
        if plot_path:
            from megatron.training import get_args

            from megatron_async.megatron_lm.adapter import run_mode
            from megatron_async.megatron_lm.observability.loss_plot import plot_losses

            args = get_args()
            records = read_records(args.metrics_json)
            train = [(r["iteration"], r["lm_loss"]) for r in records if r.get("lm_loss") is not None]
            valid = [(r["iteration"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
            schedule = run_mode.of(args).name or "megatron"
            plot_losses(plot_path, train, valid, title=f"GPT {args.num_layers}L/{args.hidden_size}H, {schedule}, "
                                                       f"{args.optimizer}")
