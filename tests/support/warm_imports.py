"""What the tests' forkserver does once, so that every rank forked from it skips it.

Each rank of a test run would otherwise import Megatron's training package (which
our launcher's hooks patch) and its tokenizers (with transformers), and, at each of Megatron's two argument parses, read
and parse the source of some 26 config dataclasses to get their field docstrings
(`ArgumentGroupFactory._get_field_docstrings`, about 0.2 s of CPU a rank). Here the
docstrings are read once per class and kept: they are a function of the source
alone, so every rank gets the same ones. Nothing is hooked here: each rank still
installs the plugin itself (tests/support/warm_launch.py).
"""

import argparse
import importlib

from megatron.training import argument_utils, arguments

# For the ranks; none queries CUDA at import, so importing them before the emulation is fine.
# Megatron's tokenizer package imports transformers whatever the tokenizer type (NullTokenizer
# too): about 2 s of CPU a rank where transformers is installed (the export extra).
for _module in ("megatron.training.training", "megatron.core.datasets.gpt_dataset",
                "megatron.core.tokenizers.text"):
    importlib.import_module(_module)

_read = argument_utils.ArgumentGroupFactory._get_field_docstrings
_docstrings: dict = {}


def _kept(self, src_cfg_class: type) -> dict:
    if src_cfg_class not in _docstrings:
        _docstrings[src_cfg_class] = _read(self, src_cfg_class)
    return dict(_docstrings[src_cfg_class])


argument_utils.ArgumentGroupFactory._get_field_docstrings = _kept
arguments.add_megatron_arguments(argparse.ArgumentParser())  # reads every class Megatron's parser uses
