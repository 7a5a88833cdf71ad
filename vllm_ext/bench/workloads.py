"""Request sets built from the offline datasets, shared by the demo and the benchmarks."""

from __future__ import annotations

from pathlib import Path

from vllm_ext.bench.loadgen import Request, poisson_arrivals


def sharegpt_requests(
    n: int,
    *,
    rate: float,
    seed: int = 0,
    max_tokens: int = 64,
    tokenizer: str | Path | None = None,
    max_prompt_chars: int = 2000,
) -> list[Request]:
    """First ShareGPT turns as chat requests arriving as a Poisson process.

    With ``tokenizer``, each request generates as many tokens as ShareGPT's own
    answer had (capped at ``max_tokens``, EOS ignored): the real output-length
    mix, as ``vllm bench serve`` does. Without it, every request asks for
    ``max_tokens`` and stops at EOS.
    """
    from vllm_ext.datasets.sharegpt import first_turns

    samples = first_turns(n, seed=seed, max_prompt_chars=max_prompt_chars)
    lengths = _reference_lengths(samples, tokenizer, max_tokens)
    arrivals = poisson_arrivals(n, rate, seed=seed)
    extra = {"ignore_eos": True} if tokenizer is not None else {}
    return [
        Request(
            id=f"sharegpt-{i}-{s.id}",
            messages=[{"role": "user", "content": s.prompt}],
            max_tokens=length,
            arrival_s=t,
            extra_body=extra,
        )
        for i, (s, length, t) in enumerate(zip(samples, lengths, arrivals, strict=True))
    ]


def _reference_lengths(samples, tokenizer, cap: int) -> list[int]:
    if tokenizer is None:
        return [cap] * len(samples)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    return [max(1, min(cap, len(tok(s.reference)["input_ids"]))) for s in samples]
