"""Training data: the corpus, its SentencePiece tokenizer and Megatron indexed datasets.

`prepare(out_dir, ...)` is the library form of `megatron-async-prepare-data`;
`load_tokenizer(model_path)` gives the trainer a Megatron-Core tokenizer for it.
Both are resolved on first use, so importing this package stays cheap and
`python -m megatron_async.data.prepare` does not import its module twice.
"""

__all__ = ["prepare", "load_tokenizer"]


def __getattr__(name):
    if name == "prepare":
        from megatron_async.data.prepare import prepare

        return prepare
    if name == "load_tokenizer":
        from megatron_async.data.tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
