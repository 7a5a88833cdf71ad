"""ARK: coordinated source-port selection for KV-transfer elephant flows.

Senders announce their KV transfers to each other in advance and pick source
ports so that concurrent large flows hash onto different spines of a
leaf-spine fabric (no switch changes, no receiver reordering). See docs/ark.md.

Pure modules (no vLLM): :mod:`.fabric`, :mod:`.paths`, :mod:`.planner`,
:mod:`.announce`, :mod:`.simulator`, :mod:`.traces`, :mod:`.testbed`.
Adapters (import vLLM): :mod:`.connector`, :mod:`.prom`.
"""
