"""A Megatron checkpoint of our runs as a Hugging Face model folder (`megatron-async-export-hf`).

The weights are read one group (the embedding, a layer, the output) at a time from the
chunks megatron-core saved (checkpoint_reader.py, checkpoint_stream.py), are mapped to the
transformers class whose forward is the same function (hf_architecture.py, hf_weights.py;
anything else is refused, naming the flag) and written as safetensors files as they come
(safetensors_shards.py) into one folder, renamed into place once complete (hf_folder.py).
The command: cli.py.
"""


class ExportError(Exception):
    """A refusal: what is wrong with the input, named; nothing has been written."""
