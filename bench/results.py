"""How every benchmark ends: print its table, write its JSON where asked, return it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def emit(result: dict, table: str, json_path: Optional[str]) -> dict:
    print(table)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result


def save_figure(fig, axes, path: str, legend_fontsize: int = 7) -> str:
    """Grid and legend on each of `axes`, then the figure written to `path` (PNG) and closed."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
