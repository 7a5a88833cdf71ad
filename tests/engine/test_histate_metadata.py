"""No page rides HiState's scheduler<->worker metadata, in a real engine run that uses every path.

A small host tier (room for the KV blocks of the run, not for every snapshot) makes the
policy spill snapshots to the SSD and drop items; the prompt is then served again with
vLLM's device cache reset, its KV from host memory and its state staged from the SSD file.
Every ``HiStateMetadata`` the scheduler half built and every ``HiStateWorkerMetadata`` the
worker half built is walked field by field: only strings, numbers, booleans and None in
lists, tuples, dicts and dataclasses may appear (no bytes, bytearray, memoryview, array or
tensor), and each pickles to under 16 KiB, far below one page (268 KiB for a state,
384 KiB for a KV block), the least a store or load with its payload inside would take.
The restored prefix decodes the cold tokens.
"""

from __future__ import annotations

import dataclasses
import pickle

from tests.engine.test_histate_engine import (
    BLOCK,
    MODEL,
    _run,
    _tokens,
    assert_tiers_agree,
    histate_kwargs,
    scheduler_of,
    worker_of,
)
from tests.helpers import engine

PROMPT = _tokens(1700, 2 * BLOCK + 20)
FILLERS = [_tokens(1701 + i, 2 * BLOCK + 20) for i in range(3)]
# tiny-hybrid's pages with bf16 state at 384-token blocks (checked below): the host tier
# is sized from them
KV_PAGE, STATE_PAGE = 393216, 274432
SCALARS = (str, int, float, bool, type(None))


def _walk(obj, where: str) -> None:
    if isinstance(obj, SCALARS):
        return
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name), f"{where}.{f.name}")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _walk(key, f"{where} key")
            _walk(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            _walk(value, f"{where}[{i}]")
    else:
        raise AssertionError(f"{where} is a {type(obj).__name__}: metadata must carry ids only")


def _record(monkeypatch, llm) -> tuple[list, list]:
    conn, worker = scheduler_of(llm).connector, worker_of(llm)
    sent, returned = [], []

    def wrap(obj, name, into):
        original = getattr(obj, name)

        def recording(*args):
            out = original(*args)
            into.append(out)
            return out

        monkeypatch.setattr(obj, name, recording)

    wrap(conn, "build_connector_meta", sent)
    wrap(worker, "build_connector_worker_meta", returned)
    return sent, returned


def test_metadata_carries_ids_only_through_stores_spills_stages_and_loads(tmp_path, monkeypatch):
    # every KV block of the run (4 prompts x 2 blocks) and one and a half snapshots
    host = 8 * KV_PAGE + 3 * STATE_PAGE // 2
    kwargs = histate_kwargs(directory=str(tmp_path), host_bytes=host, snapshot_interval_blocks=1)
    with engine(MODEL, **kwargs) as llm:
        conn, pages = scheduler_of(llm).connector, worker_of(llm).store.pages
        assert (pages.page_bytes(conn.attn_group), pages.page_bytes(conn.mamba_group)) == (
            KV_PAGE, STATE_PAGE)  # fmt: skip
        sent, returned = _record(monkeypatch, llm)
        cold = list(_run(llm, PROMPT).outputs[0].token_ids)
        for filler in FILLERS:
            _run(llm, filler, 2)
        conn.runtime.drain()
        assert conn.counters.value("spills") > 0
        llm.reset_prefix_cache()
        before = conn.counters.value("snapshots_loaded_ssd")
        again = list(_run(llm, PROMPT).outputs[0].token_ids)
        assert again == cold
        assert conn.counters.value("snapshots_loaded_ssd") == before + 1
        assert_tiers_agree(llm)
        conn.shutdown()
    del llm
    returned = [m for m in returned if m is not None]
    ops = {op for meta in sent for op, _, _ in meta.ops}
    assert {"spill", "stage"} <= ops and any(m.loads for m in sent) and any(m.stores for m in sent)
    assert any(m.stored for m in returned) and any(m.staged for m in returned)
    bound = 16 << 10  # ids of a step: well under 1 KiB; one page: 268 KiB and more
    assert bound < STATE_PAGE < KV_PAGE
    for i, meta in enumerate([*sent, *returned]):
        _walk(meta, f"{type(meta).__name__}#{i}")
        assert len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)) < bound
