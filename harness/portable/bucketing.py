"""Bucketing for shm, one for the harness's sender and the script's.

Named tensors cut into buckets of at most a number of bytes (one bucket for ``None``), in
order."""

from __future__ import annotations

from typing import Any


def buckets(weights: list[tuple[str, Any]], bucket_bytes: int | None):
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if bucket and bucket_bytes is not None and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
