"""Bytes of an input file -> text, refusing what would silently become garbage training data.

Two mistakes would pass unnoticed: a binary file (an executable renamed .txt) becoming a
"document", and a UTF-8 file with one bad byte decoded whole as Latin-1, garbling every
accented character. Both are refused with the file's name; `--encoding` names another
encoding when the file really uses one.
"""

from __future__ import annotations

import codecs

from megatron_async.data.errors import DataError

SNIFF_CHARS = 8192
MAX_CONTROL_SHARE = 0.10
_WHITESPACE_CONTROLS = set("\t\n\v\f\r")
_CONTROLS = frozenset(chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))) - _WHITESPACE_CONTROLS


def encoding_name(encoding: str) -> str:
    """Python's canonical name of `encoding` ("latin-1" -> "iso8859-1"), so equal choices compare equal."""
    try:
        try:
            b"\0\0\0\0".decode(encoding)  # LookupError for unknown names and non-text codecs (base64, ...)
        except UnicodeDecodeError:
            pass
        return codecs.lookup(encoding).name
    except LookupError:
        raise DataError(f"--encoding {encoding}: unknown encoding (e.g. utf-8, latin-1, cp1252, utf-16)") from None


def check_not_binary(raw: bytes, name: str, encoding: str) -> None:
    """Refuse `raw` as binary when the start of the file does not look like text.

    Rule: the first 8192 characters (decoded leniently in `encoding`) hold a NUL, or more than
    10% of them are control characters other than tab, newline, vertical tab, form feed and
    carriage return (C0 and C1 controls and DEL count). Executables, images, archives and
    compressed files fail this within their first few bytes; no real text does. The check runs
    on decoded characters, so UTF-16 text (whose bytes hold NULs) passes with `--encoding utf-16`.
    """
    head = codecs.getincrementaldecoder(encoding)(errors="replace").decode(raw[: 4 * SNIFF_CHARS])[:SNIFF_CHARS]
    if "\x00" in head:
        raise DataError(f"{name}: looks binary, not text (a NUL character at offset {head.index(chr(0))}); "
                        "pass text files only (UTF-16 text needs --encoding utf-16)")
    controls = sum(1 for ch in head if ch in _CONTROLS)
    if head and controls > MAX_CONTROL_SHARE * len(head):
        raise DataError(f"{name}: looks binary, not text ({controls} of its first {len(head)} characters are "
                        "control characters); pass text files only")


def decode(raw: bytes, name: str, encoding: str = "utf-8") -> str:
    """`raw` decoded strictly in `encoding`; DataError naming `name` and the first bad byte's offset."""
    check_not_binary(raw, name, encoding)
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{name}: not valid {encoding}: byte 0x{raw[exc.start]:02X} at offset {exc.start} ({exc.reason}); "
            "if the file uses another encoding, say which with --encoding (e.g. --encoding latin-1)"
        ) from None
    if "\x00" in text:
        raise DataError(f"{name}: looks binary, not text (a NUL character at character {text.index(chr(0))}); "
                        "pass text files only")
    return text
