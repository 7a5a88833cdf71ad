"""Vectorised search: orders × per-group (stages, dp, tp, recompute) × micro-batch × layer split.

For each device-group order and micro-batch size, every combination of the
groups' options and every layer split is one cell of a numpy array (axes: one
per group's options, then the splits), costed by :mod:`.model` at once. Options
that break a hard rule (tp beyond a node, a micro-batch not divisible by dp) are
never built; plans that do not fit in memory are kept out of the rankings.

Rankings over the same space (lower is better): ``memx`` the weighted score,
``metis`` time only among plans that fit (Metis's objective), ``sailor`` time
only among plans that fit under Sailor's memory accounting (Sailor's planner
objective), ``balance`` memory variance only (ties: time).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import Iterator, Sequence

import numpy as np

from vllm_ext.memx import model as mm
from vllm_ext.memx.spec import Cluster, ModelSpec, SpecError

RANKINGS = ("memx", "metis", "sailor", "balance")
_TERM = re.compile(r"^\s*(?:(\d+(?:\.\d*)?|\.\d+)\s*\*\s*)?(time|peak|var)\s*$")


@dataclasses.dataclass(frozen=True)
class Objective:
    """score = time · T/T_ideal + peak · max utilisation + var · variance of utilisation."""

    time: float = 1.0
    peak: float = 0.5
    var: float = 2.0

    @classmethod
    def parse(cls, text: str) -> Objective:
        """``"time+0.5*peak+4*var"``: a sum of weighted terms; missing terms weigh 0."""
        weights = {"time": 0.0, "peak": 0.0, "var": 0.0}
        for term in text.split("+"):
            match = _TERM.match(term)
            if not match:
                raise SpecError(f"--objective term {term.strip()!r} is not [WEIGHT*]time|peak|var")
            weights[match.group(2)] += float(match.group(1) or 1.0)
        return cls(**weights)

    def score(self, time_ratio, max_util, var_util):
        return self.time * time_ratio + self.peak * max_util + self.var * var_util


@dataclasses.dataclass(frozen=True)
class Space:
    cluster: Cluster
    model: ModelSpec
    seq: int
    global_batch: int
    micro_batches: tuple[int, ...]
    recompute: tuple[bool, ...] = (False, True)

    def __post_init__(self) -> None:
        if self.seq <= 0:
            raise SpecError(f"--seq must be > 0, got {self.seq}")
        if self.global_batch <= 0:
            raise SpecError(f"--global-batch must be > 0, got {self.global_batch}")
        bad = [b for b in self.micro_batches if b <= 0 or self.global_batch % b]
        if bad or not self.micro_batches:
            raise SpecError(
                f"--micro-batch sizes {bad or '[]'} must be > 0 and divide "
                f"--global-batch {self.global_batch}"
            )
        if self.model.layers < len(self.cluster.groups):
            raise SpecError(
                f"model.layers ({self.model.layers}) < number of device groups "
                f"({len(self.cluster.groups)}): every group needs a layer"
            )


def group_options(space: Space, g: int, mb: int) -> np.ndarray:
    """Rows (k, dp, tp, rc) for group ``g``: k·dp·tp = its GPUs, tp within a node, dp | mb."""
    grp, m = space.cluster.groups[g], space.model
    rows = []
    for tp in _divisors(grp.count):
        if tp > grp.gpus_per_node or m.heads % tp or m.kv_heads % tp:
            continue
        for dp in _divisors(grp.count // tp):
            if mb % dp:
                continue
            k = grp.count // (tp * dp)
            rows += [(k, dp, tp, int(rc)) for rc in space.recompute]
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def compositions(total: int, parts: int) -> np.ndarray:
    """Every split of ``total`` layers into ``parts`` positive counts, one row each."""
    combos = list(itertools.combinations(range(1, total), parts - 1))
    cuts = np.array(combos, dtype=np.int64).reshape(len(combos), parts - 1)
    edges = np.hstack([np.zeros((len(cuts), 1), np.int64), cuts, np.full((len(cuts), 1), total)])
    return np.diff(edges, axis=1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass
class Block:
    """One (order, micro-batch) slice of the space, costed; arrays share one shape."""

    order: tuple[int, ...]
    mb: int
    options: list[np.ndarray]
    splits: np.ndarray
    time: np.ndarray
    util: list[np.ndarray]  # per position in the order
    sailor_util: list[np.ndarray]
    valid: np.ndarray  # every group has at least one layer per stage

    @property
    def size(self) -> int:
        return int(self.time.size)


def cost_block(space: Space, order: Sequence[int], mb: int) -> Block | None:
    """Cost every plan with this group order and micro-batch size (None: no option exists)."""
    m, groups = space.model, space.cluster.groups
    options = [group_options(space, g, mb) for g in order]
    if any(len(o) == 0 for o in options):
        return None
    splits = compositions(m.layers, len(order))
    ndim = len(order) + 1
    micro = space.global_batch // mb

    def along(p: int, column: np.ndarray) -> np.ndarray:
        shape = [1] * ndim
        shape[p] = len(column)
        return column.reshape(shape)

    ks = [along(p, o[:, 0]) for p, o in enumerate(options)]
    total_stages = sum(ks)
    before = np.zeros_like(total_stages)
    times, tails, utils, sailor, valid = [], [], [], [], True
    last_p = len(order) - 1
    for p, g in enumerate(order):
        grp, o = groups[g], options[p]
        k, dp, tp, rc = (along(p, o[:, c]) for c in range(4))
        n = along(ndim - 1, splits[:, p])
        first, last = int(p == 0), int(p == last_p)
        inflight = np.minimum(total_stages - before, micro)
        hop = space.cluster.link_gbps(grp, groups[order[p + 1]]) if p < last_p else grp.inter_gbps
        times.append(mm.stage_time(m, grp, space.seq, mb, n, k, dp, tp, rc, last, hop))
        tails.append(mm.tail_time(m, grp, space.seq, mb, n, k, dp, tp, rc, first, last))
        peak = mm.peak_bytes(m, grp, space.seq, mb, n, k, dp, tp, rc, inflight, first, last)
        utils.append(peak / grp.mem_bytes)
        s_peak = mm.sailor_peak_bytes(m, space.seq, mb, n, k, dp, tp, rc, inflight, first, last)
        sailor.append(s_peak / grp.mem_bytes)
        valid = valid & (n >= k)
        before = before + k
    t = mm.iteration_time(times, ks, tails, micro)
    shape = np.broadcast_shapes(t.shape, *(u.shape for u in utils))

    def full(arrays):
        return [np.broadcast_to(a, shape) for a in arrays]

    t, valid = np.broadcast_to(t, shape), np.broadcast_to(valid, shape)
    return Block(tuple(order), mb, options, splits, t, full(utils), full(sailor), valid)


def blocks(space: Space, progress: bool = False) -> Iterator[Block]:
    """Every costed (order, micro-batch) block, with a progress bar if asked."""
    orders = list(itertools.permutations(range(len(space.cluster.groups))))
    todo = [(o, mb) for o in orders for mb in space.micro_batches]
    if progress:
        from tqdm import tqdm

        todo = tqdm(todo, desc="memx search", unit="block")
    for order, mb in todo:
        block = cost_block(space, order, mb)
        if block is not None:
            yield block


def memory_stats(space: Space, block: Block) -> tuple[np.ndarray, np.ndarray]:
    """(max utilisation, GPU-count-weighted variance of utilisation) of every plan."""
    counts = np.array([space.cluster.groups[g].count for g in block.order], dtype=float)
    w = counts / counts.sum()
    stack = np.stack(block.util)
    mean = np.tensordot(w, stack, axes=1)
    var = np.tensordot(w, (stack - mean) ** 2, axes=1)
    return stack.max(axis=0), var


def rank_keys(space: Space, block: Block, objective: Objective) -> dict[str, np.ndarray]:
    """Per ranking, a key per plan (lower is better; inf = not eligible)."""
    max_u, var_u = memory_stats(space, block)
    fits = block.valid & (max_u <= 1.0)
    sailor_fits = block.valid & (np.stack(block.sailor_util).max(axis=0) <= 1.0)
    ratio = block.time / mm.ideal_time(
        space.model, space.cluster.groups, space.seq, space.global_batch
    )
    inf = np.inf
    return {
        "memx": np.where(fits, objective.score(ratio, max_u, var_u), inf),
        "metis": np.where(fits, block.time, inf),
        "sailor": np.where(sailor_fits, block.time, inf),
        # variance first, time breaks ties (time is far below 1e6 s)
        "balance": np.where(fits, np.round(var_u, 9) * 1e6 + block.time, inf),
    }


@dataclasses.dataclass(frozen=True)
class Plan:
    order: tuple[str, ...]
    micro_batch: int
    groups: tuple[dict, ...]  # per position: k, dp, tp, recompute, layers, peak_gib, util
    time_s: float
    max_util: float
    var_util: float
    sailor_max_util: float
    score: float

    @property
    def oom(self) -> bool:
        return self.max_util > 1.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"oom": self.oom}


def plan_at(space: Space, block: Block, flat: int, objective: Objective) -> Plan:
    """The plan in cell ``flat`` of ``block``."""
    idx = np.unravel_index(flat, block.time.shape)
    split = block.splits[idx[-1]]
    groups, max_u, var_u = [], *[float(x[idx]) for x in memory_stats(space, block)]
    for p, g in enumerate(block.order):
        k, dp, tp, rc = (int(v) for v in block.options[p][idx[p]])
        grp = space.cluster.groups[g]
        util = float(block.util[p][idx])
        groups.append(
            {
                "group": grp.name,
                "vendor": grp.vendor,
                "type": grp.type,
                "stages": k,
                "dp": dp,
                "tp": tp,
                "recompute": bool(rc),
                "layers": int(split[p]),
                "peak_gib": util * grp.mem_gib,
                "util": util,
            }
        )
    t = float(block.time[idx])
    ratio = t / mm.ideal_time(space.model, space.cluster.groups, space.seq, space.global_batch)
    return Plan(
        order=tuple(space.cluster.groups[g].name for g in block.order),
        micro_batch=block.mb,
        groups=tuple(groups),
        time_s=t,
        max_util=max_u,
        var_util=var_u,
        sailor_max_util=float(max(u[idx] for u in block.sailor_util)),
        score=float(objective.score(ratio, max_u, var_u)),
    )


@dataclasses.dataclass
class SearchResult:
    top: dict[str, list[Plan]]
    evaluated: int
    feasible: int
    seconds: float
    binding: str | None  # when nothing fits: which constraint binds

    @property
    def configs_per_s(self) -> float:
        return self.evaluated / self.seconds if self.seconds else float("inf")


def search(
    space: Space,
    objective: Objective,
    top: int = 5,
    progress: bool = False,
    rankings: Sequence[str] = RANKINGS,
) -> SearchResult:
    """The ``top`` plans of each ranking over the whole space."""
    start = time.perf_counter()
    best: dict[str, list[tuple[float, int, Block, int]]] = {r: [] for r in rankings}
    evaluated = feasible = 0
    tightest = np.inf
    serial = 0
    for block in blocks(space, progress):
        keys = rank_keys(space, block, objective)
        evaluated += block.size
        feasible += int(np.isfinite(keys["metis"]).sum())
        max_u, _ = memory_stats(space, block)
        tightest = min(tightest, float(np.where(block.valid, max_u, np.inf).min()))
        for r in rankings:
            flat = keys[r].ravel()
            n = min(top, flat.size)
            cand = np.argpartition(flat, n - 1)[:n]
            for c in cand:
                if np.isfinite(flat[c]):
                    serial += 1
                    best[r].append((float(flat[c]), serial, block, int(c)))
            best[r] = sorted(best[r], key=lambda x: x[:2])[:top]
    seconds = time.perf_counter() - start
    plans = {r: [plan_at(space, b, c, objective) for _, _, b, c in v] for r, v in best.items()}
    binding = None
    if feasible == 0:
        binding = (
            (
                f"memory: the plan needing the least memory still uses {tightest:.0%} of its "
                "tightest device group (try recompute, a smaller --micro-batch, ZeRO "
                "stage 3, or more GPUs)"
            )
            if np.isfinite(tightest)
            else ("layers: no layer split gives every pipeline stage a layer")
        )
    return SearchResult(plans, evaluated, feasible, seconds, binding)
