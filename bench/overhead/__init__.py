"""Overheads: what the optimizer step, Muon's matmul precision and the weight stash cost, and long-run soak."""
