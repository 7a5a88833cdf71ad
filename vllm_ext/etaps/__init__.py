"""ETAPS: staged pruning to high sparsity with trained increments on fixed slots.

Algorithm modules (:mod:`.schedule`, :mod:`.slots`, :mod:`.scores`, :mod:`.pruner`,
:mod:`.baselines`, :mod:`.sparse_format`, :mod:`.data`) import no vLLM; the vLLM
adapter is :mod:`.linear_method` (``EtapsSparseLinearMethod``), registered from the
suite's general plugin. See docs/etaps.md.
"""
