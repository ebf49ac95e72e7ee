"""Values read back from Megatron's own training log, for tests that check our records
against what Megatron printed."""

from __future__ import annotations

import re


def printed_aux_losses(stdout: str) -> dict[int, float]:
    """Megatron's per-iteration load_balancing_loss from its log lines, by iteration."""
    found = re.findall(r"iteration\s+(\d+)/.*?load_balancing_loss: ([0-9.E+-]+)", stdout)
    return {int(it): float(value) for it, value in found}
