"""One vLLM seam: a symbol, attribute, signature or call shape a vllm_ext system relies on.

Each system declares its seams next to its own code, in ``vllm_ext/<system>/seams.py``
(a ``SEAMS`` tuple; shared plumbing in :mod:`vllm_ext.common.seams`);
:mod:`vllm_ext.common.compat` collects and checks them. Imports no vLLM.

Kinds: ``symbol`` (an importable name), ``attribute`` (a class or module
attribute, usually private), ``signature`` (a callable whose parameters, after
``self``, start with ``params``; ``"**"`` asks for a ``**kwargs``), ``source``
(a callable whose source mentions each string in ``params``: a keyword contract
vLLM keeps in a call, or attributes an ``__init__`` sets), ``instance`` (an
attribute set in ``__init__``: checked on real instances, see
:func:`vllm_ext.common.compat.check_instance`), ``field`` (a field of a vLLM
dataclass or config class, checked without an instance), ``call`` (vLLM's
function ``module.qualname`` calls ``params[0]``, e.g. ``self._policy.insert``,
and every such call must bind to our override ``ours``: the arity and keywords
vLLM uses, read from the AST of vLLM's function).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("symbol", "attribute", "signature", "source", "instance", "field", "call")


@dataclass(frozen=True)
class Seam:
    system: str  # the package under vllm_ext whose seams.py declares it
    module: str
    qualname: str
    kind: str  # one of KINDS
    why: str
    params: tuple[str, ...] = ()
    runner: str = ""  # "", "v1" or "v2": checked only where that model runner exists
    moved_to: tuple[str, ...] = ()  # modules a later vLLM keeps it in (see compat.locate)
    # kind "call": our override the call reaches, "vllm_ext.<module>:<Class>.<method>"
    ours: str = ""
    # the vLLM series the entry holds on, e.g. "<0.34" (vLLM dropped it) or ">=0.33"
    # (vLLM added it); "" on every release. Our code branches on the same boundary.
    releases: str = ""

    def applies_to(self, series: tuple[int, int] | None) -> bool:
        """Whether the entry is checked on vLLM series ``series`` (``(0, 34)``)."""
        if not self.releases or series is None:
            return True
        for bound in self.releases.split(","):
            op = bound[:2] if bound[:2] in (">=", "<=") else bound[:1]
            major, minor = (int(x) for x in bound[len(op):].split("."))
            held = {"<": series < (major, minor), ">=": series >= (major, minor),
                    "<=": series <= (major, minor), ">": series > (major, minor)}[op]  # fmt: skip
            if not held:
                return False
        return True

    @property
    def name(self) -> str:
        if self.kind == "call":
            return f"{self.module}.{self.qualname} calls {self.params[0]}()"
        return f"{self.module}.{self.qualname}"

    @property
    def private(self) -> bool:
        parts = (*self.module.split("."), *self.qualname.split("."))
        return any(part.startswith("_") and not part.startswith("__") for part in parts)
