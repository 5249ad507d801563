"""The text of a report file, plain or gzip-compressed: every command that reads run
reports or bench files reads them through ``read_text``, so a committed ``.json.gz``
reads the same as the ``.json`` it was compressed from. Gzip is told by its magic
bytes, not the file name, so a renamed file still reads."""
from __future__ import annotations

import gzip
import os
import zlib

GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: str | os.PathLike) -> bytes:
    """The file's bytes, decompressed when it is gzip. OSError when it cannot be read;
    ValueError naming the damage when it is gzip but cannot be decompressed."""
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.startswith(GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"a damaged gzip file ({e or type(e).__name__})") from None


def read_text(path: str | os.PathLike, encoding: str = "utf-8") -> str:
    """The file's text, decompressed when it is gzip (UnicodeDecodeError when it is not
    text in ``encoding``)."""
    return read_bytes(path).decode(encoding)
