"""What a run reports: the --metrics-json records, per-rank stats, the loss plot and the MoE
routing record."""
