"""Delay corrections (EF, DC-ASGD, prediction, Nesterov) of the one-step-delayed update, around any Megatron optimizer."""
