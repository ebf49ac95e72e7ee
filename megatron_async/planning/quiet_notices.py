"""The notices the planner's imports and meta-device model print, silenced by name, so its table comes first.

The planner imports Megatron and builds its model on the meta device on a login node or a
laptop, where Transformer Engine, Apex and a CUDA runtime are usually absent: Megatron and
torch then print a page of notices about the fallbacks they take, none of which changes
a count or a size the plan reports. Each is silenced by its own text (a filter per
message, nothing else): any other warning still prints.
"""

from __future__ import annotations

import logging
import warnings

# Megatron-Core's fallbacks where Transformer Engine or Apex is not installed
_WARNINGS = (
    r"Transformer Engine and Apex are not installed\. Falling back",
    r"Apex is not installed\. Falling back",
    r"Only transformer-engine>=[\d.]+ supports MoE experts, but your version is 0\.0\.0",  # TE absent reads 0.0.0
    # check_flags.parse passes Megatron's validate_args the tokenizer the command line already has
    r"Overriding default arguments for (\w+):(\S+) with \1:\2$",
)
# (logger, the start of its message): torch without a CUDA runtime; the model class the planner
# builds on the meta device only to count it, as the plugin's GPT entry builds it
_LOGGED = (
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
)


class _DropStartingWith(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def silence_known_notices() -> None:
    """Before Megatron is imported: drop the notices above, and only those."""
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    # Megatron-Core's sources compiled at their first import: an invalid escape in a docstring
    warnings.filterwarnings("ignore", message="invalid escape sequence", category=SyntaxWarning,
                            module=r".*/megatron/")
    for name, start in _LOGGED:
        logging.getLogger(name).addFilter(_DropStartingWith(start))
