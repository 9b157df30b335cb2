"""Tokenizers: text (byte-level BPE) now; image, video and audio tokenizers join with their issues."""
