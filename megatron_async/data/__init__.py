"""Training data: the corpus, its SentencePiece tokenizer and Megatron indexed datasets.

`prepare(out_dir, ...)` is the library form of `megatron-async-prepare-data`;
`load_tokenizer(model_path)` gives the trainer a Megatron-Core tokenizer for it.
Importing them is cheap: megatron.core is only imported when they run.
"""

from megatron_async.data.prepare import prepare
from megatron_async.data.tokenizer import load_tokenizer

__all__ = ["prepare", "load_tokenizer"]
