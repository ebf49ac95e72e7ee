"""Megatron's own command-line flag for a saved argument, for the exporter's refusals (a
checkpoint holds argument names; a user typed flags)."""

from __future__ import annotations

import functools


@functools.cache
def _flags() -> dict[str, str]:
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags: dict[str, str] = {}
    for action in parser._actions:
        if action.option_strings:
            flags.setdefault(action.dest, action.option_strings[0])
    return flags


def flag(dest: str) -> str:
    """The flag of argument `dest` (its first option string), or its dashed name."""
    return _flags().get(dest, "--" + dest.replace("_", "-"))
