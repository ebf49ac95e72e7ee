"""What a user sees of a run: progress lines, JSON-lines metrics, a loss plot.

Only the rank that holds the loss (last pipeline stage, first data-parallel and
tensor-parallel rank) writes; nothing here communicates across pipeline stages.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def json_line(record: dict) -> str:
    """One line of strict JSON: a NaN or infinite number is written as null, since
    JSON has no such values and readers reject Python's `NaN`."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


class RunLog:
    """Progress lines, metrics records and the loss history of one run."""

    def __init__(self, enabled: bool, total_iters: int, tokens_per_iter: int,
                 metrics_path: Optional[str] = None, stream=sys.stdout):
        self.enabled = enabled
        self.total_iters = total_iters
        self.tokens_per_iter = tokens_per_iter
        self.stream = stream
        self.train: list[tuple[int, float]] = []
        self.valid: list[tuple[int, float]] = []
        self._window: list[dict] = []
        self._start = time.monotonic()
        self._file = None
        self._metrics_path = metrics_path if enabled else None

    def open_metrics(self, resumed_from: int = 0) -> None:
        """Start the metrics file: a fresh run replaces it; a run resumed at iteration
        t keeps the records up to t (dropping any later ones a crashed run left) and
        appends, so the file and the final plot cover the whole run once."""
        path = self._metrics_path
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if resumed_from and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by a crash
                    if record.get("iteration", 0) <= resumed_from:
                        kept.append(record)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json_line(r) for r in kept)
        self.train = [(r["iteration"], r["lm_loss"]) for r in kept if r.get("lm_loss") is not None]
        self.valid = [(r["iteration"], r["val_loss"]) for r in kept if "val_loss" in r]
        self._file = open(path, "a", encoding="utf-8")

    def _write(self, record: dict) -> None:
        if self._file:
            self._file.write(json_line(record))
            self._file.flush()

    def iteration(self, iteration: int, lm_loss: Optional[float], lr: float,
                  grad_norm: Optional[float], seconds: float, **extra) -> None:
        """Record iteration `iteration` (1-based)."""
        if not self.enabled:
            return
        record = dict(
            iteration=iteration,
            lm_loss=lm_loss,
            lr=lr,
            grad_norm=grad_norm,
            s_per_iter=seconds,
            tokens_per_s=self.tokens_per_iter / seconds if seconds > 0 else None,
            **extra,
        )
        self._write(record)
        if lm_loss is not None:
            self.train.append((iteration, lm_loss))
        self._window.append(record)

    def progress(self, iteration: int, resumed_from: int = 0) -> None:
        """Print one line summarising the iterations since the last progress line."""
        if not self.enabled or not self._window:
            return
        window, self._window = self._window, []
        losses = [r["lm_loss"] for r in window if r["lm_loss"] is not None]
        secs = sum(r["s_per_iter"] for r in window) / len(window)
        norm = window[-1]["grad_norm"]
        done = iteration - resumed_from
        elapsed = time.monotonic() - self._start
        eta = elapsed / max(done, 1) * (self.total_iters - iteration)
        loss_txt = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        norm_txt = f"{norm:.3f}" if norm is not None and math.isfinite(norm) else "-"
        print(
            f"iteration {iteration:>6d}/{self.total_iters} | lm loss {loss_txt} | "
            f"lr {window[-1]['lr']:.3e} | grad norm {norm_txt} | {secs:.3f} s/iter | "
            f"{self.tokens_per_iter / secs:,.0f} tokens/s | ETA {_fmt_duration(eta)}",
            file=self.stream, flush=True,
        )

    def evaluation(self, iteration: int, val_loss: float) -> None:
        if not self.enabled:
            return
        self.valid.append((iteration, val_loss))
        self._write({"iteration": iteration, "val_loss": val_loss})
        print(f"validation at iteration {iteration} | val loss {val_loss:.4f} | "
              f"val ppl {math.exp(min(val_loss, 50)):.2f}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def rss_mb() -> float:
    """This process's resident set size in MB (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


class RankStats:
    """Per-rank pace and memory: `DIR/rank<R>.jsonl`, one record per log interval.

    Every rank writes its own file and nothing is gathered, so a slow or growing
    rank shows up without a collective (which under 2bw would span stages).
    """

    def __init__(self, directory: Optional[str], rank: int, resumed_from: int = 0):
        self._file = None
        self._seconds: list[float] = []
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"rank{rank}.jsonl"), "a" if resumed_from else "w",
                              encoding="utf-8")

    def iteration(self, seconds: float) -> None:
        if self._file:
            self._seconds.append(seconds)

    def flush(self, iteration: int, **extra) -> None:
        """Write the record for the iterations since the last flush."""
        if not self._file or not self._seconds:
            return
        record = dict(iteration=iteration, s_per_iter=sum(self._seconds) / len(self._seconds),
                      rss_mb=round(rss_mb(), 1), **extra)
        self._seconds = []
        self._file.write(json_line(record))
        self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def plot_losses(path: str, train: list[tuple[int, float]], valid: list[tuple[int, float]],
                title: str = "") -> str:
    """Write a PNG of training and validation loss; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train lm loss", linewidth=1.0, alpha=0.8)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss", linewidth=1.5)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "megatron-async pretraining")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
