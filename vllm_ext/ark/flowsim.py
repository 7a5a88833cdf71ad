"""Flow-level network simulator: max-min fair rates, event-driven (numpy, no vLLM).

Each flow has a start time, a size in bytes and a fixed path, given as link
indices (padded with ``-1``). Between events (a flow starts or finishes)
every active flow runs at its max-min fair rate, computed by progressive
filling: raise all unfrozen rates together until a link saturates, freeze the
flows crossing it, repeat. This is the fluid model of long TCP/RDMA flows
sharing links under fair congestion control; packets, queues and slow start
are not modelled.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-9


def maxmin_rates(paths: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rate of each flow.

    Args:
        paths: ``(flows, hops)`` link indices, ``-1`` for no link.
        capacity: ``(links,)`` capacities (same unit as the returned rates).
    """
    n_flows = paths.shape[0]
    rates = np.zeros(n_flows)
    if n_flows == 0:
        return rates
    n_links = capacity.shape[0]
    dummy = n_links  # padding hops point at a link that never saturates
    hops = np.where(paths < 0, dummy, paths)
    left = np.append(capacity.astype(float), np.inf)
    frozen = np.zeros(n_flows, dtype=bool)
    while not frozen.all():
        active = ~frozen
        users = np.bincount(hops[active].ravel(), minlength=n_links + 1).astype(float)
        users[dummy] = 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(users > 0, left / users, np.inf)
        step = share.min()
        if not np.isfinite(step):  # flows crossing no real link: unbounded
            rates[active] = np.inf
            break
        rates[active] += step
        left = left - step * users
        saturated = (users > 0) & (left <= _EPS * np.append(capacity, 1.0))
        saturated[dummy] = False
        frozen |= saturated[hops].any(axis=1)
    return rates


def simulate(
    starts: np.ndarray, sizes: np.ndarray, paths: np.ndarray, capacity: np.ndarray
) -> np.ndarray:
    """Finish time of every flow (flows start at ``starts`` and never wait to be admitted)."""
    n = len(starts)
    finish = np.full(n, np.nan)
    order = np.argsort(starts, kind="stable")
    remaining = sizes.astype(float).copy()
    active: list[int] = []
    rates = np.zeros(0)
    now, nxt = 0.0, 0
    while nxt < n or active:
        if active:
            with np.errstate(divide="ignore"):
                to_finish = remaining[active] / rates
            t_finish = now + to_finish.min()
        else:
            t_finish = np.inf
        t_start = starts[order[nxt]] if nxt < n else np.inf
        t = min(t_finish, t_start)
        if active:
            remaining[active] -= rates * (t - now)
        now = t
        if active:
            done = remaining[active] <= _EPS * np.maximum(sizes[active], 1.0)
            if t == t_finish:
                done[np.argmin(to_finish)] = True  # the flow that set t, despite rounding
            for flow in np.asarray(active)[done]:
                finish[flow] = now
            active = [f for f, d in zip(active, done, strict=True) if not d]
        while nxt < n and starts[order[nxt]] <= now:
            flow = order[nxt]
            nxt += 1
            if sizes[flow] <= 0:
                finish[flow] = now
            else:
                active.append(flow)
        rates = maxmin_rates(paths[active], capacity) if active else np.zeros(0)
    return finish
