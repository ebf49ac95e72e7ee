"""SentencePiece BPE: training it on the corpus, and loading it as a Megatron tokenizer.

Training choices, and why:
  * whole documents are the training "sentences", with identity normalisation, no
    whitespace squeezing, no dummy prefix and "\\n" as a symbol of its own: the
    tokenizer sees text exactly as the trainer will encode it, and decoding gives
    back the original text, line breaks and verse indentation included;
  * unk=0, bos=1, eos=2, pad=3: eos doubles as Megatron's end-of-document token
    (`tokenizer.eod`), and pad is distinct from it, so GPTDataset keeps its pad id;
  * one thread and a fixed seed: SentencePiece's BPE result depends on the thread
    count, so this makes the model file identical on every machine.

`load_tokenizer` reuses Megatron-Core's own SentencePiece tokenizer
(`megatron.core.tokenizers`), which works offline from the local .model file.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Iterable

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# SentencePiece refuses a --max_sentence_length below 10 bytes (trainer_interface.cc), which
# a corpus whose longest document is shorter would otherwise ask for
SPM_MIN_SENTENCE_BYTES = 10
# Megatron-Core's tokenizer factory reads this to pick its GPT SentencePiece tokenizer.
METADATA = {"library": "sentencepiece", "model_type": "gpt", "chat_template": None}


def train_tokenizer(texts: Iterable[str], model_path: Path, vocab_size: int, seed: int = 1234) -> int:
    """Train a BPE model on `texts` (one document each), write it to `model_path`, return its vocab size.

    `vocab_size` is an upper bound: a corpus too small for that many merges gets
    the largest vocabulary it supports rather than an error.
    """
    import sentencepiece as spm

    from megatron_async.data.corpus import DataError

    texts = [t for t in texts if t]
    longest = max((len(t.encode("utf-8")) for t in texts), default=0)
    spm.set_random_generator_seed(seed)
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=proto,
            model_type="bpe",
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            max_sentence_length=max(longest + 1, SPM_MIN_SENTENCE_BYTES),
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise DataError(_training_failure(str(exc), vocab_size)) from None
    Path(model_path).write_bytes(proto.getvalue())
    return spm.SentencePieceProcessor(model_proto=proto.getvalue()).get_piece_size()


def _training_failure(message: str, vocab_size: int) -> str:
    """SentencePiece's failed check as its cause in the user's terms: no text to train on, or a
    vocabulary smaller than the characters it must hold; anything else with its own message."""
    if "!sentences_.empty()" in message:
        return ("SentencePiece training failed: the training documents hold no text it can train on (only line "
                "breaks or whitespace); give it documents with text")
    needed = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", message)
    if needed:
        return (f"SentencePiece training failed: --vocab-size {vocab_size} is smaller than the {needed.group(1)} "
                "pieces the training text needs (each of its distinct characters, the line break and the 4 "
                f"special tokens); pass --vocab-size {needed.group(1)} or more")
    return f"SentencePiece training failed (try a different --vocab-size): {message}"


def load_tokenizer(model_path):
    """Megatron-Core GPT tokenizer for a SentencePiece .model file.

    Usable as `GPTDatasetConfig.tokenizer` and by the trainer: `tokenize(text)`,
    `detokenize(ids)`, `vocab_size`, `eod`, `bos`, `pad`, `unique_identifiers`.
    """
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer model {path} not found (run megatron-async-prepare-data first)")
    from megatron_async.data.indexed import quiet_import

    MegatronTokenizer = quiet_import("megatron.core.tokenizers").MegatronTokenizer
    return MegatronTokenizer.from_pretrained(tokenizer_path=str(path), metadata_path=dict(METADATA))
