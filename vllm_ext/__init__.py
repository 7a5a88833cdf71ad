"""vllm_ext: research systems as plugins for stock vLLM.

Importing this package is cheap and changes nothing in vLLM; a system changes
behaviour only when the user enables it with vLLM's own flags (or through
``vllm-ext serve --plugins ...``).
"""

__version__ = "0.1.0"
