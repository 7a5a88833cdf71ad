"""How one :class:`~vllm_ext.common.seam.Seam` is checked against the vLLM this process imports.

:func:`seam_problem` answers None (the seam holds) or the short reason it does
not; :mod:`vllm_ext.common.compat` turns reasons into the one line a user sees.
A ``call`` seam reads vLLM's calling function from its source (the AST, not
the text), finds every call of the named expression and binds its shape
(positional count, keyword names) to our override's signature, so a vLLM that
passes one more argument than our method takes is found before it calls us.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_ext.common.seam import Seam


def resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def found(seam: Seam) -> Seam:
    """``seam`` at the first of its modules that has it (its own, then ``moved_to``)."""
    for module in (seam.module, *seam.moved_to):
        try:
            resolve(module, seam.qualname)
        except (ImportError, AttributeError):
            continue
        return dataclasses.replace(seam, module=module)
    return seam


def _owner_and_attr(seam: Seam):
    owner, _, attr = seam.qualname.rpartition(".")
    return (resolve(seam.module, owner) if owner else importlib.import_module(seam.module)), attr


def _signature_problem(obj, params: tuple[str, ...]) -> str | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "has no signature"
    found_ = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    names = [p.name for p in found_ if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    wanted = [p for p in params if p != "**"]
    if names[: len(wanted)] != wanted:
        return f"takes ({', '.join(names)}), expected ({', '.join(wanted)}, ...)"
    if "**" in params and not any(p.kind == p.VAR_KEYWORD for p in found_):
        return "takes no **kwargs"
    return None


def _field_names(cls) -> set[str]:
    """Fields of a (pydantic) dataclass or an annotated class, over its MRO."""
    names = set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "model_fields", {}))
    for base in getattr(cls, "__mro__", ()):
        names |= set(vars(base).get("__annotations__", {}))
    return names


@dataclasses.dataclass(frozen=True)
class CallShape:
    """One call as vLLM writes it: ``positional`` None when it unpacks ``*args``."""

    positional: int | None
    keywords: tuple[str, ...]
    double_star: bool  # it passes **kwargs: any keyword may arrive

    def __str__(self) -> str:
        parts = ["*args" if self.positional is None else f"{self.positional} positional"]
        parts += [f"{k}=" for k in self.keywords] + (["**kwargs"] if self.double_star else [])
        return ", ".join(parts)


def call_shapes(function, expression: str) -> list[CallShape]:
    """Every call of ``expression`` (e.g. ``"self._policy.insert"``) in ``function``'s source."""
    return _calls_in(function).get(expression, [])


@functools.cache
def _calls_in(function) -> dict[str, list[CallShape]]:
    # one parse per vLLM function: several seams (and systems) name the same caller
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls: dict[str, list[CallShape]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            starred = any(isinstance(a, ast.Starred) for a in node.args)
            calls.setdefault(ast.unparse(node.func), []).append(
                CallShape(
                    None if starred else len(node.args),
                    tuple(k.arg for k in node.keywords if k.arg is not None),
                    any(k.arg is None for k in node.keywords),
                )
            )
    return calls


def override(path: str):
    """``"module:Class.method"`` → (the function as looked up on the class, whether it
    takes the instance first)."""
    module, _, qualname = path.partition(":")
    owner_name, _, method = qualname.rpartition(".")
    owner = resolve(module, owner_name)
    raw = inspect.getattr_static(owner, method)
    return getattr(owner, method), not isinstance(raw, (staticmethod, classmethod))


def binding_problem(function, takes_self: bool, shape: CallShape) -> str | None:
    """None when a call of ``shape`` binds to ``function``; else why not."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin or C function: nothing to compare
    params = list(signature.parameters.values())
    if shape.positional is None or shape.double_star:
        # unpacked arguments: check only the keywords we can see
        names = {p.name for p in params}
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return None
        absent = [k for k in shape.keywords if k not in names]
        return f"has no parameter {', '.join(absent)}" if absent else None
    args = [None] * (shape.positional + (1 if takes_self else 0))
    try:
        signature.bind(*args, **dict.fromkeys(shape.keywords))
    except TypeError as exc:
        return str(exc)
    return None


def _call_problem(seam: Seam) -> str | None:
    expression = seam.params[0]
    module, _, qualname = seam.ours.partition(":")
    try:
        resolve(module, qualname.rpartition(".")[0])
    except (ImportError, AttributeError) as exc:
        return f"our {seam.ours} is not importable ({type(exc).__name__}: {exc})"
    try:
        function, takes_self = override(seam.ours)
    except AttributeError:
        return None  # our class lacks the method: vLLM checks for it (e.g. SupportsHMA)
    if not (getattr(function, "__module__", None) or "").startswith("vllm_ext."):
        return None  # not overridden: vLLM calls its own method
    try:
        caller = resolve(seam.module, seam.qualname)
        shapes = call_shapes(caller, expression)
    except ImportError as exc:
        return f"module not importable ({exc.__class__.__name__}: {exc})"
    except AttributeError:
        return "missing"
    except (OSError, TypeError, SyntaxError):
        return "source unavailable"
    if not shapes:
        return f"no longer calls {expression}"
    for shape in dict.fromkeys(shapes):
        problem = binding_problem(function, takes_self, shape)
        if problem is not None:
            ours = seam.ours.partition(":")[2]
            return f"with ({shape}), which our {ours} cannot take ({problem})"
    return None


def seam_problem(seam: Seam) -> str | None:
    """Why ``seam`` does not hold in this process's vLLM; None when it does.

    ``instance`` entries check here only that their class exists (the attribute
    is set in ``__init__``: :func:`~vllm_ext.common.compat.check_instance`
    checks it on a real instance).
    """
    if seam.kind == "call":
        return _call_problem(seam)
    seam = found(seam)
    try:
        if seam.kind == "field":
            owner, attr = _owner_and_attr(seam)
            return None if attr in _field_names(owner) else "missing"
        if seam.kind == "instance":
            owner, _ = _owner_and_attr(seam)
            return None if owner is not None else "missing"
        obj = resolve(seam.module, seam.qualname)
    except ImportError as exc:
        return f"module not importable ({exc.__class__.__name__}: {exc})"
    except AttributeError:
        return "missing"
    if seam.kind == "signature":
        return _signature_problem(obj, seam.params)
    if seam.kind == "source":
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            return "source unavailable"
        absent = [s for s in seam.params if s not in text]
        return f"no longer mentions {', '.join(absent)}" if absent else None
    return None
