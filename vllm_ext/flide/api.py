"""``FlideEndpoint``: the HTTP route of Flide on ``vllm serve`` (vLLM 0.32 ``EndpointPlugin``).

Registered under ``vllm.endpoint_plugins`` as ``flide``; vLLM loads it only
when ``VLLM_PLUGINS`` names it. The route reaches the worker-side RPC
(:mod:`vllm_ext.flide.worker`, enabled by ``--worker-extension-cls``) through
``EngineClient.collective_rpc``, the pairing vLLM's endpoint contract asks for.

``POST /v1/flide/classify``::

    {"labels": [" yes", " no"],
     "items": [{"context": "...", "questions": ["...", {"id": "q7", "text": "..."}]}]}
    -> {"results": [{"id", "label", "probs": {label: p}, "logprobs": {label: lp}}],
        "usage": {"passes": n, "packed_tokens": t}}

Malformed input is a 400 with the problem named; the engine keeps serving.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.logger import init_logger

from vllm_ext.common import compat
from vllm_ext.common.systems import config_from_vllm
from vllm_ext.flide.batch import FlideInputError, Item, validate_items
from vllm_ext.flide.classifier import RPC_METHOD, WORKER_EXTENSION, answers
from vllm_ext.flide.config import SYSTEM
from vllm_ext.flide.plan import (
    engine_step_tokens,
    parse_items,
    parse_labels,
    pass_budget,
    plan_passes,
)

logger = init_logger(__name__)
ROUTE = "/v1/flide/classify"

# counters on vLLM's /metrics (the API server's default Prometheus registry)
_COUNTERS = {
    "questions": "questions classified",
    "passes": "packed passes run",
    "packed_tokens": "tokens computed in packed passes",
    "rejected_requests": "requests rejected as malformed (HTTP 400)",
    "failed_requests": "requests that failed in the engine (HTTP 500)",
}


# the labels vLLM's engine metrics (and our other systems' counters) carry
LABELS = ("model_name", "engine")
BODY_KEYS = ("items", "labels", "model")


def _counters(model_name: str, engine: str = "0") -> dict:
    """The counters of one served model: created once per process (vLLM may build the app
    more than once), labelled like vLLM's own metrics."""
    from prometheus_client import REGISTRY, Counter

    global _METRICS
    if _METRICS is None:
        names = {name: f"vllm_ext:flide_{name}" for name in _COUNTERS}
        existing = getattr(REGISTRY, "_names_to_collectors", {})
        _METRICS = {
            key: existing.get(name) or Counter(name, "Flide: " + _COUNTERS[key], LABELS)
            for key, name in names.items()
        }
    return {key: counter.labels(model_name, engine) for key, counter in _METRICS.items()}


_METRICS: dict | None = None


def _served_name(args) -> str:
    """The first ``--served-model-name`` (what clients send), else the model path."""
    names = getattr(args, "served_model_name", None)
    if isinstance(names, (list, tuple)) and names:
        return str(names[0])
    return str(names or getattr(args, "model", ""))


def _body_problem(body) -> str | None:
    """Why a parsed body is not a classify request, naming the offending keys."""
    if not isinstance(body, dict):
        return f"body must be a JSON object with 'labels' and 'items', got {type(body).__name__}"
    unknown = sorted(set(body) - set(BODY_KEYS))
    if unknown:
        return f"unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(BODY_KEYS)})"
    return None


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class FlideEndpoint:
    """Adds ``POST /v1/flide/classify`` to the OpenAI-compatible server."""

    name = "flide"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route(ROUTE, classify, methods=["POST"])

    async def init_state(self, engine_client, state, args) -> None:
        state.flide_engine = None
        if not compat.require(SYSTEM):  # logs each missing seam; the route then answers 503
            return
        state.flide_config = config_from_vllm(SYSTEM, args)
        state.flide_budget = pass_budget(
            state.flide_config, engine_step_tokens(getattr(engine_client, "vllm_config", None))
        )
        state.flide_engine = engine_client
        state.flide_counters = _counters(_served_name(args))


async def classify(request: Request) -> JSONResponse:
    state = request.app.state
    engine = getattr(state, "flide_engine", None)
    if engine is None:
        why = "Flide is disabled: it needs an engine and the vLLM seams it uses (server log)"
        return _error(503, why, "server_error")
    try:
        body = await request.json()
    except ValueError:
        state.flide_counters["rejected_requests"].inc()
        return _error(400, "request body is not valid JSON", "invalid_request_error")
    problem = _body_problem(body)
    if problem is not None:
        state.flide_counters["rejected_requests"].inc()
        return _error(400, problem, "invalid_request_error")
    tokenizer = engine.get_tokenizer()

    def tokenize(text: str, special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=special)

    config = state.flide_config
    try:
        labels = body.get("labels")
        label_ids = parse_labels(labels, tokenize, config)
        contexts, questions = parse_items(body.get("items"), tokenize, config)
        results, tokens = [], 0
        passes = plan_passes(contexts, questions, label_ids, state.flide_budget)
        max_len = engine.model_config.max_model_len
        for packed in passes:
            validate_items([Item(tuple(c), tuple(map(tuple, qs))) for c, qs in packed.items],
                           label_ids, max_len)  # fmt: skip
            payload = {"items": packed.items, "labels": [list(x) for x in label_ids]}
            logp = (await engine.collective_rpc(RPC_METHOD, args=(payload,)))[0]
            results += answers(packed.questions, logp, labels)
            tokens += sum(len(c) + sum(len(q) for q in qs) for c, qs in packed.items)
    except FlideInputError as exc:
        state.flide_counters["rejected_requests"].inc()
        return _error(400, str(exc), "invalid_request_error")
    except NotImplementedError as exc:
        state.flide_counters["failed_requests"].inc()
        logger.warning("Flide RPC missing: %s", exc)
        return _error(500, f"start vllm with --worker-extension-cls {WORKER_EXTENSION}",
                      "server_error")  # fmt: skip
    except Exception as exc:  # the worker's own checks (unsupported model, ...)
        state.flide_counters["failed_requests"].inc()
        logger.warning("Flide request failed: %s", exc)
        return _error(500, f"Flide failed: {exc}", "server_error")
    order = {q.id: n for n, q in enumerate(questions)}
    results.sort(key=lambda a: order[a.id])
    usage = {"passes": len(passes), "packed_tokens": tokens}
    for key, value in (("questions", len(results)), *usage.items()):
        state.flide_counters[key].inc(value)
    return JSONResponse({"results": [a.as_dict() for a in results], "usage": usage})
