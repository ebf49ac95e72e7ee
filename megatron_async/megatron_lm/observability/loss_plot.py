"""`--plot`: a PNG of training and validation loss, drawn from the metrics file."""

from __future__ import annotations

import os


def plot_losses(path: str, train: list[tuple[int, float]], valid: list[tuple[int, float]],
                title: str = "") -> str:
    """Write the PNG (matplotlib's Agg backend: no display needed); returns the path."""
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
