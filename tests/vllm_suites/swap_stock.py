"""No swap: vLLM's suite as shipped (the baseline each swapped run is compared with)."""


def install() -> None:
    return
