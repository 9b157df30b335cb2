"""Tokenizers and the side models of the media path: text (byte-level BPE), the causal multi-scale
bitwise vision tokenizer, the causal RVQ audio codec (with its semantic teacher and audio features),
the cascaded refiner, and the folder format they are saved in."""
