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
# The plugin's modules a run imports (about 80: 0.1-0.2 s a rank, compiled from source where
# bytecode is not written) are imported only: each rank still installs the hooks itself.
for _module in ("megatron.training.training", "megatron.core.datasets.gpt_dataset",
                "megatron.core.tokenizers.text", "megatron.core.tokenizers.text.models",
                "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.models.mimo",
                "megatron_async.launch", "megatron_async.megatron_lm.adapter.hooks",
                "megatron_async.megatron_lm.adapter.gpt", "megatron_async.megatron_lm.adapter.two_bw_run",
                "megatron_async.megatron_lm.adapter.simulated_delay_run", "megatron_async.pipeline.two_bw",
                "megatron_async.stash.weight_stash", "megatron_async.data.prepare",
                "megatron_async.data.flag_checks", "megatron_async.pipeline.grad_stats",
                "megatron_async.megatron_lm.adapter.layout_invariant_init",
                "megatron_async.megatron_lm.adapter.optimizer_probe", "megatron_async.megatron_lm.checkpoint.marker",
                "megatron_async.megatron_lm.observability.metrics",
                "megatron_async.megatron_lm.observability.moe_routing",
                "megatron_async.megatron_lm.safety.resume_checks", "megatron_async.megatron_lm.safety.checkpoint_guard",
                "megatron_async.megatron_lm.safety.save_space", "megatron_async.megatron_lm.safety.full_disk"):
    importlib.import_module(_module)

_read = argument_utils.ArgumentGroupFactory._get_field_docstrings
_docstrings: dict = {}


def _kept(self, src_cfg_class: type) -> dict:
    if src_cfg_class not in _docstrings:
        _docstrings[src_cfg_class] = _read(self, src_cfg_class)
    return dict(_docstrings[src_cfg_class])


argument_utils.ArgumentGroupFactory._get_field_docstrings = _kept
arguments.add_megatron_arguments(argparse.ArgumentParser())  # reads every class Megatron's parser uses
