"""A Megatron checkpoint of our runs as a Hugging Face model folder (`megatron-async-export-hf`).

The weights come through megatron-core's own loading (checkpoint_reader.py), are mapped to
the transformers class whose forward is the same function (hf_architecture.py,
hf_weights.py; anything else is refused, naming the flag) and written as one folder,
renamed into place once complete (hf_folder.py). The command: cli.py.
"""


class ExportError(Exception):
    """A refusal: what is wrong with the input, named; nothing has been written."""
