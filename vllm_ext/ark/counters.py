"""ARK counters (``vllm_ext:ark_<name>_total``; drops carry a ``reason`` label on /metrics)."""

from __future__ import annotations

from vllm_ext.common.counters import Counters, CounterSpec

SYSTEM = "ark"
DROP_REASONS = ("malformed", "huge", "unknown_peer", "overflow", "bad_mac")
DROPPED = "announcements_dropped"  # labelled family: DROPPED + "_" + reason internally
COUNTER_SPECS = (
    CounterSpec("planned", "transfers whose source port ARK planned from its view"),
    CounterSpec("kept_port", "transfers that kept their port (small, same leaf, paths unknown)"),
    CounterSpec("fallback", "transfers sent on a random port because the sender had no view"),
    CounterSpec("announcements_sent", "announcement datagrams sent to peers"),
    CounterSpec("announcements_received", "valid announcement datagrams received"),
    *(CounterSpec(f"{DROPPED}_{r}", f"announcements dropped: {r}") for r in DROP_REASONS),
    CounterSpec("transfers_sent", "KV transfers pushed by this producer"),
    CounterSpec("transfer_bytes", "KV bytes pushed by this producer"),
    CounterSpec("transfer_failures", "KV transfers that failed (peer down, timeout, bad frame)"),
    CounterSpec("bind_fallbacks", "planned ports that were busy; sent from an ephemeral port"),
    CounterSpec("frames_rejected", "received KV frames dropped: malformed, too large, or expired"),
    CounterSpec("transfers_received", "KV transfers received by this consumer"),
    CounterSpec(
        "frames_unknown_sender",
        "KV connections refused unread: the sender's address is not in kv_senders",
    ),
    CounterSpec(
        "frames_unauthenticated",
        "received KV frames dropped: missing or wrong HMAC tag (forged, altered, other secret)",
    ),
    CounterSpec("load_timeouts", "requests whose KV never arrived in time (recomputed)"),
)


def new_counters() -> Counters:
    return Counters(SYSTEM, COUNTER_SPECS)


def drop_counter(reason: str) -> str:
    if reason not in DROP_REASONS:
        raise ValueError(f"unknown drop reason {reason!r}; one of {DROP_REASONS}")
    return f"{DROPPED}_{reason}"
