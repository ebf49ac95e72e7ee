"""Run safety: the --save lock and free-space check, the guard against starting afresh over
checkpoints, failure reports, the launcher watch and the flush before our own exits."""
