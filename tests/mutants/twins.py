"""Disabled twins of each system's core decision (used only by ``make mutants``).

Each factory takes the original function or method and returns its replacement;
the replacement keeps the original's signature and does what the system would do
without the decision (FCFS instead of LEAP's order, LRU instead of HiState's
score, ...). Product code is untouched: :mod:`tests.mutants.patching` swaps these in.
"""

from __future__ import annotations

import random


def leap_unaged_key_fcfs(original):
    from vllm_ext.leap import policy

    def unaged_key(self, view):
        # every request ranks as unpredicted, by arrival: vLLM's FCFS
        return (policy._UNPREDICTED, view.arrival_time, 0.0)

    return unaged_key


def leap_running_order_fcfs(original):
    import numpy as np

    def order(policy, batch, now):
        # arrival order; the latest arrival is last, where vLLM preempts
        return np.lexsort((np.arange(len(batch)), batch.arrival_time))

    return order


def histate_score_lru(original):
    from vllm_ext.histate.policy import LruPolicy

    return LruPolicy.score


def histate_plan_load_cold(original):
    def plan_load(self, *args, **kwargs):
        return None  # every lookup misses: the request is recomputed from scratch

    return plan_load


def flide_ancestry_causal(original):
    import torch

    def _ancestry(parent):
        # every segment sees every earlier one: plain causal attention over the packed sequence
        return torch.ones(parent.numel(), parent.numel(), dtype=torch.bool).tril()

    return _ancestry


def flide_delta_rule_zero_start(original):
    import torch

    from vllm_ext.flide.recurrent import _segment_tokens

    def segmented_delta_rule(layout, q, k, v, g, beta, kernel):
        # every segment starts from zero state instead of its parent's final state
        out = torch.empty_like(v)
        depth = 0
        while True:
            segs = layout.segments_at_depth(depth)
            if segs.numel() == 0:
                return out
            tokens, cu_seqlens = _segment_tokens(layout, segs)
            states = kernel.zero_states(segs.numel(), v.shape[1], q.shape[2], v.shape[2],
                                        q.device)  # fmt: skip
            pick = [t[tokens][None] for t in (q, k, v, g, beta)]
            seg_out, _ = kernel(*pick, states, cu_seqlens)
            out[tokens] = seg_out[0]
            depth += 1

    return segmented_delta_rule


def ark_choose_random(original):
    from vllm_ext.ark.planner import PLANNED, Choice

    rng = random.Random()

    def choose(transfer, announced, fabric, oracle, candidates, *, min_bytes=0):
        # a random candidate, reported as planned: ECMP with extra steps
        port = rng.choice(list(candidates)) if candidates else transfer.port
        spine = oracle.spine(transfer.src, transfer.dst, port, transfer.dst_port)
        return Choice(port, spine, (0.0, 0.0), PLANNED)

    return choose


def acct_gate_always(original):
    def _passes(self, job):
        return True

    return _passes


def acct_gate_never(original):
    def _passes(self, job):
        return False

    return _passes


def tvq_relookup_once(original):
    def relookup(self):
        # the first lookup (at construction) happens; later ones are skipped
        if getattr(self, "_mutant_looked_up", False):
            return 0
        self._mutant_looked_up = True
        return original(self)

    return relookup


def etaps_migrate_none(original):
    import torch

    def migrate_slots(slots, delta, grad_sum, keep):
        # slots stay where they are, pruned weights included
        return slots, delta, torch.zeros(slots.shape, dtype=torch.bool, device=slots.device)

    return migrate_slots
