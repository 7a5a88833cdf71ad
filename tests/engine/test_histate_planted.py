"""A snapshot planted in HiState's SSD folder is never served (real engine, tiny hybrid, CPU).

Engine 1 serves a prompt whose state at 768 tokens goes to the SSD at shutdown. Then that
file (a hot key: the next request sharing the prefix hits it) is replaced by a well-formed
forgery: a state page of the right size filled with seeded random bytes, under the same key,
in our namespace, with valid checksums. An engine on that folder refuses to start, in one
line, when the folder is writable by every user or when the planted file belongs to another
user. Last, the same file owned by us in a
private folder (what the checks cannot tell from our own) is loaded and served: what the
refusals prevent.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from tests.engine.test_histate_engine import (
    BLOCK,
    MODEL,
    _run,
    histate_kwargs,
    scheduler_of,
    worker_of,
)
from tests.engine.test_histate_faults import (
    _family,
    _namespace_of,
    _serve_family,
    _snapshot_keys,
)
from tests.helpers import engine
from vllm_ext.common.config import ConfigError
from vllm_ext.histate import snapfile

NOBODY = 65534
SETTINGS = dict(host_bytes=256 << 20)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """SSD folder whose file for a hot key holds a forged state; the prompt's cold tokens."""
    directory = tmp_path_factory.mktemp("histate-planted")
    with engine(MODEL, **histate_kwargs(directory=str(directory), **SETTINGS)) as llm:
        conn = scheduler_of(llm).connector
        before = _snapshot_keys(conn)
        reference = list(_run(llm, _family(0)[1]).outputs[0].token_ids)
        conn.runtime.drain()
        (key,) = _snapshot_keys(conn) - before  # the state at 768 tokens (the prompt's end)
        path = worker_of(llm).store.ssd.path(key)
        conn.shutdown()
    del llm
    with open(path, "rb") as fh:
        namespace = _namespace_of(fh, path)
        _, length, _ = snapfile.read_header(fh, namespace)
    # seeded random bytes: extreme and non-finite values too. NOTE: the tiny random-weight
    # hybrid's greedy tokens survive a state of random N(0, 16) values, so a milder forgery
    # would not show in its answer
    forged = np.random.default_rng(0).bytes(length)
    path.write_bytes(snapfile.encode(namespace, key, forged))
    return directory, path, reference


def _refused(directory, match: str) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with pytest.raises(ConfigError, match=match) as err:
        with engine(MODEL, **histate_kwargs(directory=str(directory), **SETTINGS)):
            pass
    assert "\n" not in str(err.value) and "unsafe" in str(err.value)
    gc.collect()
    cleanup_dist_env_and_memory()  # the failed engine's parallel state


def test_a_planted_snapshot_is_refused_at_start_and_served_only_if_trusted(planted):
    directory, path_a, reference = planted
    os.chmod(directory, 0o777)
    _refused(directory, "writable by every user")
    os.chmod(directory, 0o700)
    os.chown(path_a, NOBODY, NOBODY)
    _refused(directory, f"owned by uid {NOBODY}")
    # the planted file passed as ours: nothing else tells it from a genuine one
    os.chown(path_a, os.geteuid(), os.getegid())
    with engine(MODEL, **histate_kwargs(directory=str(directory), **SETTINGS)) as llm:
        conn = scheduler_of(llm).connector
        loaded = conn.counters.value("snapshots_loaded_ssd")
        tokens, hit = _serve_family(llm, conn, 0)
        assert hit == 2 * BLOCK and conn.counters.value("snapshots_loaded_ssd") == loaded + 1
        assert tokens != reference  # the planted state decides the answer
        conn.shutdown()
    del llm
