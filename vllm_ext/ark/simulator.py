"""ARK in a simulated leaf-spine at the paper's regime (numpy; the planner is the plugin's).

Fabric: ``n_leaves`` leaves of ``hosts_per_leaf`` hosts, ``n_spines`` spines,
every leaf linked to every spine; the first half of the leaves hold prefill
instances, the second half decode instances (one instance per host NIC). The
fabric's ECMP is a :class:`~vllm_ext.ark.paths.HashModel` (CRC32 of the
5-tuple with a per-run seed), taken at the source leaf. Variants on the same
trace:

- ``random``: each transfer a random ephemeral source port (plain ECMP);
- ``ark``: each prefill sender, when it schedules a prefill, plans its port
  among ``n_candidates`` with :func:`vllm_ext.ark.planner.choose` from its
  :class:`~vllm_ext.ark.view.PeerView` of earlier announcements (expected
  window: prefill end to prefill end + ``window_scale`` x bytes / NIC rate),
  then announces it;
- ``ksub``: each transfer split into ``k_subflows`` equal subflows on random
  ports (the "more queue pairs per connection" answer), done when all are;
- ``offline``: every transfer known up front, any spine allowed, placed by
  :func:`vllm_ext.ark.planner.offline_spines` (clairvoyant greedy);
- ``spray``: every transfer split evenly over all spines (a non-blocking
  fabric; the reference Hedera calls optimal).

TTFT = queue + prefill + KV transfer (the decode's first step is the same
for every variant and left out).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from vllm_ext.ark import flowsim
from vllm_ext.ark.fabric import Fabric, Transfer, host_name
from vllm_ext.ark.paths import HashModel
from vllm_ext.ark.planner import choose, offline_spines
from vllm_ext.ark.traces import KvGeometry, PdTrace, PrefillModel, PromptLengths, arrival_rate
from vllm_ext.ark.traces import pd_trace as make_trace
from vllm_ext.ark.view import PeerView

VARIANTS = ("random", "ark", "ksub", "offline", "spray")
DST_PORT = 7000
CANDIDATE_BASE = 40000
GBPS = 1e9 / 8


@dataclass(frozen=True)
class SimConfig:
    """Fabric, load and ARK knobs of one simulated run (all assumptions, see docs/ark.md)."""

    n_leaves: int = 32
    hosts_per_leaf: int = 8
    n_spines: int = 8
    nic_gbps: float = 100.0
    link_gbps: float = 100.0
    utilization: float = 0.6
    n_requests: int = 3000
    n_candidates: int = 16
    k_subflows: int = 4
    hash_function: str = "crc32"
    entry_ttl_s: float = 0.05
    # announced window = scale x bytes / NIC rate: flows here take ~2x their solo time
    window_scale: float = 2.0
    geometry: KvGeometry = field(default_factory=KvGeometry)
    model: PrefillModel = field(default_factory=PrefillModel)
    lengths: PromptLengths = field(default_factory=PromptLengths)

    def __post_init__(self) -> None:
        if self.n_leaves < 2 or self.n_leaves % 2:
            raise ValueError("n_leaves must be even and >= 2 (half prefill, half decode)")

    @property
    def n_prefill(self) -> int:
        return self.n_leaves // 2 * self.hosts_per_leaf

    def describe(self) -> dict:
        return dataclasses.asdict(self)


class Layout:
    """Host names, link indices and capacities of the simulated fabric."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.n_hosts = cfg.n_leaves * cfg.hosts_per_leaf
        self.fabric = Fabric.uniform(cfg.n_leaves, cfg.hosts_per_leaf, cfg.n_spines)
        self.names = [host_name(h // cfg.hosts_per_leaf, h % cfg.hosts_per_leaf)
                      for h in range(self.n_hosts)]  # fmt: skip
        fabric_links = 2 * cfg.n_leaves * cfg.n_spines
        self.capacity = np.concatenate([
            np.full(2 * self.n_hosts, cfg.nic_gbps * GBPS),
            np.full(fabric_links, cfg.link_gbps * GBPS),
        ])  # fmt: skip

    def leaf(self, host: int) -> int:
        return host // self.cfg.hosts_per_leaf

    def path(self, src: int, dst: int, spine: int) -> list[int]:
        """NIC up, leaf uplink, spine downlink, NIC down (no spine inside one leaf)."""
        cfg, h = self.cfg, self.n_hosts
        a, b = self.leaf(src), self.leaf(dst)
        if a == b:
            return [src, h + dst, -1, -1]
        up = 2 * h + a * cfg.n_spines + spine
        down = 2 * h + cfg.n_leaves * cfg.n_spines + spine * cfg.n_leaves + b
        return [src, up, down, h + dst]

    def uplink_spine(self, link: int) -> int:
        return (link - 2 * self.n_hosts) % self.cfg.n_spines


def build_trace(cfg: SimConfig, seed: int) -> PdTrace:
    rate = arrival_rate(cfg.utilization, cfg.n_prefill, cfg.lengths, cfg.model)
    return make_trace(cfg.n_requests, rate, cfg.n_prefill, cfg.n_prefill, seed,
                      cfg.geometry, cfg.model, cfg.lengths)  # fmt: skip


def transfers_of(trace: PdTrace, layout: Layout, rng: np.random.Generator) -> list[Transfer]:
    """One announced transfer per request (random ephemeral port until planned)."""
    nic = layout.cfg.nic_gbps * GBPS / layout.cfg.window_scale
    decode_base = layout.cfg.n_prefill
    out = []
    for i in range(len(trace)):
        start = float(trace.prefill_end[i])
        nbytes = int(trace.kv_bytes[i])
        out.append(Transfer(
            f"r{i}", layout.names[trace.prefill_host[i]],
            layout.names[decode_base + trace.decode_host[i]], nbytes, start,
            start + nbytes / nic, int(rng.integers(32768, 61000)), DST_PORT,
        ))  # fmt: skip
    return out


def ark_ports(trace: PdTrace, transfers: list[Transfer], layout: Layout,
              oracle: HashModel) -> tuple[list[int], dict]:  # fmt: skip
    """Plan every transfer in announcement order (prefill start), as the senders would."""
    cfg = layout.cfg
    view = PeerView(entry_ttl_s=cfg.entry_ttl_s, peer_timeout_s=1e9, max_entries=1 << 20)
    candidates = list(range(CANDIDATE_BASE, CANDIDATE_BASE + cfg.n_candidates))
    ports = [t.port for t in transfers]
    reasons: dict[str, int] = {}
    order = sorted(range(len(transfers)), key=lambda i: (trace.prefill_start[i], i))
    for i in order:
        now = float(trace.prefill_start[i])
        choice = choose(transfers[i], view.live(now), layout.fabric, oracle, candidates)
        reasons[choice.reason] = reasons.get(choice.reason, 0) + 1
        ports[i] = choice.port
        view.add(dataclasses.replace(transfers[i], port=choice.port, spine=choice.spine),
                 peer=transfers[i].src, now=now)  # fmt: skip
    return ports, reasons


def subflows(variant: str, transfers: list[Transfer], trace: PdTrace, layout: Layout,
             oracle: HashModel, rng: np.random.Generator) -> tuple[list, dict]:  # fmt: skip
    """``[(transfer index, bytes, spine)]`` for one variant, and planner statistics."""
    cfg, stats = layout.cfg, {}
    spine = [oracle.spine(t.src, t.dst, t.port, t.dst_port) for t in transfers]
    if variant == "random":
        return [(i, t.nbytes, spine[i]) for i, t in enumerate(transfers)], stats
    if variant == "ark":
        ports, stats = ark_ports(trace, transfers, layout, oracle)
        return [(i, t.nbytes, oracle.spine(t.src, t.dst, ports[i], t.dst_port))
                for i, t in enumerate(transfers)], stats  # fmt: skip
    if variant == "ksub":
        k, out = cfg.k_subflows, []
        for i, t in enumerate(transfers):
            for port in rng.integers(32768, 61000, k):
                out.append((i, t.nbytes / k, oracle.spine(t.src, t.dst, int(port), t.dst_port)))
        return out, stats
    if variant == "offline":
        placed = offline_spines(transfers, layout.fabric)
        return [(i, t.nbytes, placed.get(t.transfer_id, 0)) for i, t in enumerate(transfers)], stats
    if variant == "spray":
        s = cfg.n_spines
        return [(i, t.nbytes / s, j) for i, t in enumerate(transfers) for j in range(s)], stats
    raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")


def run_variant(variant: str, cfg: SimConfig, seed: int, trace: PdTrace | None = None) -> dict:
    """Simulate one variant on the trace of ``seed``; its metrics."""
    layout = Layout(cfg)
    trace = build_trace(cfg, seed) if trace is None else trace
    oracle = HashModel(cfg.n_spines, seed=seed, function=cfg.hash_function)
    transfers = transfers_of(trace, layout, np.random.default_rng([seed, 1]))
    flows, stats = subflows(variant, transfers, trace, layout, oracle,
                            np.random.default_rng([seed, 2]))  # fmt: skip
    index = {name: h for h, name in enumerate(layout.names)}
    owner = np.array([f[0] for f in flows])
    sizes = np.array([f[1] for f in flows], dtype=float)
    paths = np.array([layout.path(index[transfers[i].src], index[transfers[i].dst], s)
                      for i, _, s in flows])  # fmt: skip
    starts = trace.prefill_end[owner]
    finish = flowsim.simulate(starts, sizes, paths, layout.capacity)
    done = np.full(len(trace), -np.inf)
    np.maximum.at(done, owner, finish)
    fct = done - trace.prefill_end
    ttft = done - trace.arrival
    return {
        **metrics(fct, ttft, trace),
        **spine_balance(flows, paths, sizes, layout),
        "fcts_s": fct,
        "spine_gbps_over_time": spine_rates(
            flows, paths[:, 1] >= 0, sizes, starts, finish, layout.cfg.n_spines
        ),
        **{f"planner_{k}": v for k, v in stats.items()},
    }


def metrics(fct: np.ndarray, ttft: np.ndarray, trace: PdTrace) -> dict:
    alone = trace.kv_bytes / (100.0 * GBPS)  # the same flow alone on a 100 Gb/s path
    return {
        "mean_fct_s": float(fct.mean()),
        "p50_fct_s": float(np.percentile(fct, 50)),
        "p99_fct_s": float(np.percentile(fct, 99)),
        "mean_ttft_s": float(ttft.mean()),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "mean_queue_s": float((trace.prefill_start - trace.arrival).mean()),
        "mean_prefill_s": float((trace.prefill_end - trace.prefill_start).mean()),
        "mean_kv_mb": float(trace.kv_bytes.mean() / 1e6),
        "mean_fct_alone_100g_s": float(alone.mean()),
    }


def spine_balance(flows, paths: np.ndarray, sizes: np.ndarray, layout: Layout) -> dict:
    """Total bytes per spine and the worst leaf's max/mean uplink bytes."""
    crossing = paths[:, 1] >= 0
    per_spine = np.bincount([f[2] for f, c in zip(flows, crossing, strict=True) if c],
                            weights=sizes[crossing], minlength=layout.cfg.n_spines)  # fmt: skip
    uplink = np.bincount(paths[crossing, 1], weights=sizes[crossing],
                         minlength=len(layout.capacity))  # fmt: skip
    start = 2 * layout.n_hosts
    grid = uplink[start : start + layout.cfg.n_leaves * layout.cfg.n_spines]
    grid = grid.reshape(layout.cfg.n_leaves, layout.cfg.n_spines)
    used = grid.sum(axis=1) > 0
    imbalance = grid[used].max(axis=1) / grid[used].mean(axis=1)
    return {
        "spine_bytes_gb": [float(b / 1e9) for b in per_spine],
        "uplink_max_over_mean": float(imbalance.mean()) if used.any() else 1.0,
    }


def spine_rates(flows, crossing, sizes, starts, finish, n_spines: int, bins: int = 60) -> dict:
    """Per spine, Gb/s carried per time bin, each flow's bytes spread evenly over its life."""
    edges = np.linspace(float(starts.min()), float(finish.max()), bins + 1)
    out = np.zeros((n_spines, bins))
    for (_, _, spine), up, size, a, b in zip(flows, crossing, sizes, starts, finish, strict=True):
        if not up:
            continue
        overlap = np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0, None)
        out[spine] += size * overlap / max(b - a, 1e-12)
    width = edges[1] - edges[0]
    return {"t_s": edges[:-1].tolist(), "gbps": (out * 8 / 1e9 / width).tolist()}


def run(cfg: SimConfig, seed: int, variants=VARIANTS) -> dict[str, dict]:
    """Every variant on the same trace and hash seed."""
    trace = build_trace(cfg, seed)
    return {v: run_variant(v, cfg, seed, trace) for v in variants}
