"""The reference GPU cluster that turns a stage's work into time, each number with its source.

The planner (planning/balance.py) weighs a stage's compute, its optimizer step and its
transfers against each other in seconds on this cluster; bench/throughput/project.py
projects schedules on it. Ratios, not absolute times, decide a split, so a faster or
slower GPU of the same balance of compute, memory and links splits the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    peak_flops: float = 989e12  # H100 SXM dense BF16
    mfu: float = 0.40
    gpus_per_node: int = 8
    nvlink_bytes_s: float = 450e9  # per GPU, one direction
    ib_bytes_s: float = 50e9  # per GPU, one 400 Gb/s NIC
    link_latency_s: float = 10e-6
    hbm_bytes_s: float = 3.35e12
    ns_mfu: float = 0.5  # Newton-Schulz GEMMs are large and square

    @property
    def pass_flops_s(self) -> float:
        """What the forward and backward passes run at."""
        return self.peak_flops * self.mfu


H100 = Cluster()

ASSUMPTIONS = {
    "peak_flops": "989 TFLOP/s dense BF16, NVIDIA H100 SXM5 datasheet",
    "mfu": "40% of peak for the passes (stated, not measured; --mfu changes it); dense Megatron GPT runs "
           "on H100 report 40-50% (NVIDIA Megatron-LM README), MoE less",
    "nvlink_bytes_s": "450 GB/s per GPU per direction, NVLink 4 (900 GB/s bidirectional, H100 SXM5 datasheet)",
    "ib_bytes_s": "50 GB/s per GPU: one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100)",
    "link_latency_s": "10 microseconds per message (stated)",
    "hbm_bytes_s": "3.35 TB/s HBM3, H100 SXM5 datasheet",
    "ns_mfu": "50% of peak for Newton-Schulz GEMMs (stated)",
}

ADAM_STEP_BYTES = 22  # a parameter's optimizer state (16), gradient (4) and bf16 weight (2), read and written once


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """Muon's orthogonalisation of a rows x cols matrix: `steps` iterations of 4mn^2 + 2m^3 FLOPs (m <= n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)
