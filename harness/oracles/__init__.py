"""What a synced server is compared with: the Hugging Face reference (`reference`), the comparisons and tolerances (`parity`), vLLM's own weight digests (`checksums`)."""
