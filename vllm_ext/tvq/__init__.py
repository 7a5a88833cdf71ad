"""TVQ: trainable vector quantization (codes, codebooks, row scales), served as ``tvq``."""
