"""ACCT: import a long prefix's KV cache from a cheaper source instead of prefilling it.

Algorithms (no vLLM): :mod:`.llama` (a Llama forward with its per-layer KV
exposed), :mod:`.converter` (hidden state -> K/V maps and their ridge fit),
:mod:`.pipeline` (source runner, converters, exact sinks), :mod:`.train`
(end-to-end KL training), :mod:`.quality` and :mod:`.gate` (offline and online
gates), :mod:`.importer` (the worker-side import plan). The vLLM adapter is
:mod:`.connector` (``AcctConnector``). See docs/acct.md.
"""
