"""`--metrics-json`: one JSON line per iteration, next to Megatron's own logging.

Megatron's log line rounds the loss and TensorBoard needs a reader; a JSON line
per iteration (loss, learning rate, grad norm, seconds) is what plots, sweeps and
equivalence tests read. Written by the last rank (where Megatron prints), from
the values Megatron's training_log receives; nothing is communicated.
"""

from __future__ import annotations

import inspect
import time

from megatron_async.megatron_lm.records import json_line, open_for_run, read_records

_STATE = {"file": None, "last": None, "signature": None, "eval": None}


def _float(value):
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def _writer():
    """The metrics file on the rank that writes it (the last, where Megatron prints), else None."""
    import torch
    from megatron.training import get_args

    margs = get_args()
    if not margs.metrics_json or torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
        return None
    if _STATE["file"] is None:
        _STATE["file"] = open_for_run(margs.metrics_json, margs.iteration)
    return _STATE["file"]


def _rank_stats(iteration: int, seconds) -> None:
    """--rank-stats-dir: every rank's own pace, RSS and pending sends (no collective)."""
    from megatron.training import get_args

    args = get_args()
    if not args.rank_stats_dir:
        return
    if _STATE.get("rank_stats") is None:
        import torch

        from megatron_async.megatron_lm.rank_stats import RankStats

        _STATE["rank_stats"] = RankStats(args.rank_stats_dir, torch.distributed.get_rank(),
                                         resumed_from=args.iteration)
    stats = _STATE["rank_stats"]
    if seconds is not None:
        stats.iteration(seconds)
    if iteration % args.log_interval == 0 or iteration == args.train_iters:
        from megatron_async.megatron_lm.runtime import STATE

        extra = {"pending_sends": STATE.runner.pending_sends} if STATE.runner is not None else {}
        stats.flush(iteration, **extra)


def _gpu_memory() -> dict:
    """This rank's peak GPU memory so far, in MiB (what the weight stash adds shows here);
    nothing on the CPU, where the emulation allocates no device memory."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"max_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def record_iteration(training_log, args, kwargs) -> None:
    if _STATE["signature"] is None:
        _STATE["signature"] = inspect.signature(training_log)
    bound = _STATE["signature"].bind(*args, **kwargs).arguments
    now = time.perf_counter()
    seconds = now - _STATE["last"] if _STATE["last"] is not None else None
    _STATE["last"] = now
    _rank_stats(bound["iteration"], seconds)
    out = _writer()
    if out is None:
        return
    losses = {key.replace(" ", "_"): _float(value) for key, value in (bound["loss_dict"] or {}).items()}
    record = dict(iteration=bound["iteration"], **losses, lr=_float(bound["learning_rate"]),
                  grad_norm=_float(bound["grad_norm"]), skipped=bool(bound["skipped_iter"]), s_per_iter=seconds)
    record.update(_gpu_memory())
    out.write(json_line(record))
    out.flush()


def record_routing(args, kwargs) -> None:
    """An MoE model's routing this iteration (moe_routing); every rank takes part."""
    from megatron.training import get_args

    margs = get_args()
    if not margs.num_experts or not margs.metrics_json:
        return
    from megatron_async.megatron_lm import moe_routing

    iteration = _STATE["signature"].bind(*args, **kwargs).arguments["iteration"]
    layers = margs.num_layers + (getattr(margs, "mtp_num_layers", None) or 0)  # MTP layers number after the rest
    record = moe_routing.take_record(iteration, layers, margs.num_experts)
    out = _writer()
    if out is not None and record is not None:
        out.write(json_line(record))
        out.flush()


def evaluation_context(prefix: str, iteration: int) -> None:
    """Set by evaluate_and_print_results: which split and iteration the next evaluate is for."""
    if "test set" in prefix:
        key = "test_loss"
    elif "validation set" in prefix:  # Megatron's evaluation after training, on further batches
        key = "final_val_loss"
    else:  # "iteration N": every --eval-interval during training
        key = "val_loss"
    _STATE["eval"] = (key, iteration)


def record_evaluation(total_loss_dict) -> None:
    out = _writer()
    if out is None or not total_loss_dict or _STATE["eval"] is None:
        return
    key, iteration = _STATE["eval"]
    loss = total_loss_dict.get("lm loss")
    if loss is not None:
        out.write(json_line({"iteration": iteration, key: _float(loss)}))
        out.flush()


def finish(plot_path) -> None:
    """Close the metrics file; with --plot, draw train and validation loss from it."""
    out = _STATE["file"]
    if out is None:
        return
    out.close()
    _STATE["file"] = None
    if plot_path:
        from megatron.training import get_args

        from megatron_async.megatron_lm.loss_plot import plot_losses

        args = get_args()
        records = read_records(args.metrics_json)
        train = [(r["iteration"], r["lm_loss"]) for r in records if r.get("lm_loss") is not None]
        valid = [(r["iteration"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        schedule = args.pipeline_schedule or "megatron"
        plot_losses(plot_path, train, valid, title=f"GPT {args.num_layers}L/{args.hidden_size}H, {schedule}, "
                                                   f"{args.optimizer}")
