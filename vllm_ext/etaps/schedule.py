"""The sparsity schedule: the target of each stage, rising to the final sparsity."""

from __future__ import annotations


def sparsity_schedule(
    final: float, stages: int, *, start: float = 0.5, checkpoints: tuple[float, ...] = ()
) -> list[float]:
    """Stage targets from ``start`` to ``final``, evenly spaced, plus ``checkpoints``.

    Each stage prunes a little more than the last, so the increments trained in
    one stage make up the loss before the next cut. Checkpoints (sparsities to
    export on the way, e.g. 0.7 on the road to 0.9) are inserted as stages too.

    Returns:
        strictly increasing sparsities in (0, 1), the last one ``final``.

    Raises:
        ValueError: ``final`` or ``start`` outside (0, 1), ``start > final`` or ``stages < 1``.
    """
    if not 0.0 < final < 1.0:
        raise ValueError(f"final sparsity must be in (0, 1), got {final}")
    if not 0.0 < start <= final:
        raise ValueError(f"start sparsity must be in (0, final={final}], got {start}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if stages == 1:
        targets = {round(final, 6)}
    else:
        step = (final - start) / (stages - 1)
        targets = {round(start + i * step, 6) for i in range(stages)}
    for point in checkpoints:
        if not 0.0 < point <= final:
            raise ValueError(f"checkpoint {point} must be in (0, final={final}]")
        targets.add(round(point, 6))
    return sorted(targets)


def pruned_per_row(in_features: int, sparsity: float) -> int:
    """Weights pruned in each row at ``sparsity`` (the exporter and vLLM agree on it)."""
    return int(in_features * sparsity + 1e-9)
