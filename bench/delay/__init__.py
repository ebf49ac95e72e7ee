"""Delay studies: optimizers under one-step and variable delay, sweeps, their archives and reports."""
