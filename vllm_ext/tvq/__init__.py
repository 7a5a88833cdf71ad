"""TVQ: trainable vector quantization (codes, codebooks, per-row scales) served by a ``tvq`` method."""
