"""Compute kernels with pure-torch references (``<op>/ref.py`` is ground truth).

``VLLMEXT_KERNELS_FORCE_REF=1`` makes every op use its reference.
"""
