"""Delay corrections (EF, DC-ASGD, prediction, Nesterov) and the simulated delay they are measured against."""
