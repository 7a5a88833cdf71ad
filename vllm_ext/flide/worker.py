"""``FlideWorkerExtension``: the worker-side RPC of Flide (vLLM 0.32 ``Worker``).

Enabled with ``--worker-extension-cls vllm_ext.flide.worker.FlideWorkerExtension``;
vLLM mixes it into its worker class, and callers reach it through
``collective_rpc("flide_classify", args=(payload,))`` — ``LLM.collective_rpc``
offline, ``EngineClient.collective_rpc`` from the HTTP endpoint. The call runs
between engine steps, on the weights vLLM loaded, and never touches the KV
cache (see :mod:`vllm_ext.flide.forward`). Under tensor parallelism
``collective_rpc`` runs it on every rank with the same payload: each rank
validates it (so all refuse a bad one, and none waits in a collective), packs
the same sequence and computes its share of the heads; the model's own
all-reduces join the ranks, and callers read rank 0's answer
(``tests/engine/test_flide_tp2.py``).
"""

from __future__ import annotations

from vllm_ext.common import compat
from vllm_ext.flide.batch import Item, label_logprobs, pack_items, validate_items, validate_labels
from vllm_ext.flide.config import SYSTEM
from vllm_ext.flide.forward import check_supported, packed_logprobs

RPC_METHOD = "flide_classify"


class FlideWorkerExtension:
    """Adds :meth:`flide_classify` to vLLM's worker."""

    def flide_classify(self, payload: dict) -> list[list[float]]:
        """Score every question of ``payload`` against its labels in one packed pass.

        Args:
            payload: ``{"items": [[context_ids, [question_ids, ...]], ...],
                "labels": [label_ids, ...]}`` (token ids); ``"isolate": False``
                packs naively (one causal sequence), for benchmarks only.

        Returns:
            ``[Q][L]`` summed label log-probabilities, questions in input order.
        """
        if not compat.require(SYSTEM):
            raise compat.VllmCompatError("; ".join(compat.problems(SYSTEM)))
        model = self.model_runner.get_model()
        config = self.model_runner.vllm_config
        check_supported(model, config.model_config.architecture)
        labels = validate_labels(payload["labels"], config.model_config.get_vocab_size())
        items = [Item(tuple(ctx), tuple(tuple(q) for q in qs)) for ctx, qs in payload["items"]]
        validate_items(items, labels, config.model_config.max_model_len)
        batch = pack_items(items, labels, isolate=payload.get("isolate", True))
        logp = label_logprobs(batch, packed_logprobs(model, config, batch).cpu())
        return logp.tolist()
