"""Regenerate the generated parts of README.md and docs/*.md (``make docs``).

A generated part sits between two marker comments::

    <!-- gen:KIND ARG -->
    ...replaced...
    <!-- /gen:KIND -->

Kinds: ``systems`` (README's table of systems and their headline figures, from
``benchmarks/results/*.json``), ``extras`` (pyproject's optional dependencies),
``results SYSTEM`` (a system's headlines with the command behind each), ``config
SYSTEM`` (its settings, from its config dataclass), ``metrics SYSTEM`` (its counters
on ``/metrics``, from their declarations). ``python docs/gen.py --check`` changes
nothing and exits 1 when a file is stale; ``tests/unit/test_docs_current.py`` runs the
same check. Imports no vLLM.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
# docs/compat.md is written by `make compat`, not here
FILES = (
    "README.md",
    "docs/leap.md",
    "docs/histate.md",
    "docs/flide.md",
    "docs/memx.md",
    "docs/tvq.md",
    "docs/etaps.md",
)
BLOCK = re.compile(
    r"(<!-- gen:(?P<kind>[a-z]+)(?: (?P<arg>[a-z_]+))? -->\n)(?P<body>.*?)"
    r"(<!-- /gen:(?P=kind) -->)",
    re.DOTALL,
)
DIRTY_MARK = "†"
DIRTY_NOTE = (
    f"{DIRTY_MARK} made from a checkout with uncommitted changes (`fingerprint.git.dirty` in the "
    "result file): the code behind the figure is not exactly a commit."
)
CONFIG_CLASSES = {
    "leap": "vllm_ext.leap.config:LeapConfig",
    "histate": "vllm_ext.histate.config:HiStateConfig",
    "flide": "vllm_ext.flide.config:FlideConfig",
    "tvq": "vllm_ext.tvq.config:TvqConfig",
}
# counters published through the KV connector get vLLM's per-engine labels
CONNECTOR_LABELS = "`model_name`, `engine`"


@dataclass(frozen=True)
class Headline:
    """One benchmark's headline (``benchmarks/results/<name>.json``)."""

    name: str
    system: str
    what: str
    metric: str
    ours: float
    baseline: float
    baseline_name: str
    ratio: float | None
    higher_is_better: bool
    target: object
    dirty: bool
    command: str | None
    spread: object


# the results the docs cite: (system, result name, what it measures) -- nothing else is quoted
CITED = (
    ("suite", "fcfs_sharegpt", "`vllm-ext serve` with no system vs plain vLLM, a ShareGPT burst"),
    ("leap", "leap_sharegpt_512_cal512_next_step_x2",
     "32 ShareGPT requests in one burst, outputs up to 512 tokens, 4 decode slots"),
    ("leap", "leap_sharegpt_512_cal512_rates", "the same requests, Poisson arrivals at 0.2 req/s"),
    ("leap", "leap_sched_overhead", "scheduler time per step, 256 running + 744 queued requests"),
    ("leap", "leap_replay", "LEAP's policy replayed on 100 recorded bursts (token-step model)"),
    ("leap", "leap_heads", "ranking quality of LEAP's ridge head vs other heads on the probe"),
    ("histate", "histate_sim", "simulated 7B hybrid on an H200 + NVMe, agentic traces"),
    ("histate", "histate_engine", "agentic sessions on the tiny hybrid, real engine, CPU"),
    ("histate", "histate_tails", "multi-turn ShareGPT chat, real engine: tails vs align mode"),
    ("histate", "histate_policies",
     "recomputed prefill tokens per policy, 3 traces, host DRAM sweep, Qwen3-Next-80B cost model"),
    ("flide", "flide", "64 BFCL questions about one 1024-token context, tiny hybrid"),
    ("memx", "memx", "plan search, 3-vendor 24-GPU cluster, LLaMA-33B, one core"),
    ("ark", "ark_testbed", "KV-sized TCP flows, netns leaf-spine (2 leaves x 4 hosts, 4 spines)"),
    ("ark", "ark_sim", "flow-level simulation, 256 hosts, 8 spines, 100 Gb/s, P/D trace"),
    ("acct", "acct", "import vs own prefill of 1K-8K-token contexts, SmolLM2-135M, CPU-s"),
    ("acct", "acct_quality", "next-64-token NLL after a 1024-token context, 2 held-out windows"),
    ("tvq", "tvq", "SmolLM2-135M MLPs at 3.02 bits, held-out ShareGPT, 12 TVQ steps"),
    ("tvq", "tvq_kernel", "vLLM CPU decode, 1 sequence, 3.02-bit VQ MLPs vs bf16, shared host"),
    ("etaps", "etaps", "SmolLM2-135M pruned to 50-90 %, held-out ShareGPT, equal tokens"),
    ("etaps", "etaps_kernel", "vLLM CPU decode, 1 sequence, 70/90 % sparse vs dense bf16"),
)  # fmt: skip
# the command lines of results that predate recording them (as their authors documented)
KNOWN_COMMANDS = {
    "fcfs_sharegpt": "python -m benchmarks.fcfs_sharegpt",
    "leap_sharegpt_512_cal512_rates": "python -m benchmarks.leap --max-tokens 512 "
    "--dtype float32 --calibration 512 --drift 32 --rates 0.12,0.2 --variants leap "
    "--repeats 1 --name leap_sharegpt_512_cal512_rates",
    "leap_sched_overhead": "python -m benchmarks.leap.sched_overhead",
    "leap_replay": "python -m benchmarks.leap.replay",
    "leap_heads": "python -m benchmarks.leap.heads",
    "histate_engine": "python -m benchmarks.histate --engine",
    "histate_sim": "python -m benchmarks.histate.sim",
    "flide": "python -m benchmarks.flide --quick --repeats 3",
}
SYSTEM_ROWS = (
    ("LEAP", "leap", "orders requests by predicted output length (a probe on one decoder "
     "layer + online RLS), preempting long runners for shorter arrivals"),
    ("HiState", "histate", "keeps recurrent-state snapshots of hybrid models in host memory "
     "and on SSD beside host KV, under one eviction queue"),
    ("Flide", "flide", "answers many classification questions about one context in one "
     "packed pass, equal to asking each alone"),
    ("MemX", "memx", "searches training parallel plans for mixed-vendor clusters, scoring "
     "time, peak memory and its variance across GPUs"),
    ("ARK", "ark", "picks KV-transfer source ports from peers' announcements so concurrent "
     "transfers hash onto different spines"),
    ("ACCT", "acct", "fills the target's KV cache for a long prefix from a cheaper source "
     "through trained converters, with a quality gate that falls back to prefill"),
    ("TVQ", "tvq", "vector-quantizes MLP weights (~2-3 bits) with trainable latents behind "
     "the codes, served by a `tvq` quantization method with a lookup-GEMV kernel"),
    ("ETAPS", "etaps", "prunes to high sparsity in stages with trained increments on fixed "
     "slots; serves the sparse checkpoint through an `etaps` method with a sparse kernel"),
    ("(none)", "suite", "`vllm-ext serve` with no system enabled: the suite's own overhead"),
)  # fmt: skip


def load_headline(system: str, name: str, what: str) -> Headline:
    data = json.loads((RESULTS / f"{name}.json").read_text())
    head = data["headline"]
    config = data.get("config") or {}
    command = data.get("command") or config.get("command")
    if isinstance(command, list):
        command = " ".join(command)
    return Headline(
        name=name, system=system, what=what, metric=head["metric"], ours=head["ours"],
        baseline=head["baseline"], baseline_name=head["baseline_name"], ratio=head["ratio"],
        higher_is_better=head["higher_is_better"], target=head.get("target"),
        dirty=bool(((data.get("fingerprint") or {}).get("git") or {}).get("dirty")),
        command=command, spread=head.get("spread"),
    )  # fmt: skip


def cited(system: str | None = None) -> list[Headline]:
    return [load_headline(s, n, w) for s, n, w in CITED if system in (None, s)]


def number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    if value == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{min(digits, 4)}f}"


def ratio_target(head: Headline) -> tuple[str, bool | None]:
    """The target on the ratio, and whether the ratio meets it (None: not a ratio target)."""
    target = head.target
    if isinstance(target, (int, float)) and not isinstance(target, bool):
        op = ">=" if head.higher_is_better else "<="
        bound = float(target)
    else:
        match = re.match(r"\s*ratio\s*(<=|>=|<|>)\s*([0-9.]+)(?:/([0-9.]+))?", str(target or ""))
        if not match:
            return str(target or "—"), None
        op, bound = match.group(1), float(match.group(2)) / float(match.group(3) or 1)
    ratio = head.ratio
    met = None if ratio is None else {
        "<=": ratio <= bound, ">=": ratio >= bound, "<": ratio < bound, ">": ratio > bound
    }[op]  # fmt: skip
    shown = op.replace("<=", "≤").replace(">=", "≥")
    return f"ratio {shown} {bound:.4g}", met


def _ours(head: Headline) -> str:
    mark = DIRTY_MARK if head.dirty else ""
    spread = ""
    if isinstance(head.spread, (list, tuple)) and len(head.spread) == 2:
        spread = f" ({number(head.spread[0])}–{number(head.spread[1])})"
    return f"{number(head.ours)}{spread}{mark}"


def _verdict(head: Headline, full: bool = False) -> str:
    """The ratio target and whether it is met; ``full`` adds the target as the result states it."""
    target, met = ratio_target(head)
    if met is None:
        return target
    verdict = f"{target}: {'met' if met else 'missed'}"
    text = head.target if isinstance(head.target, str) else ""
    if full and text and text.strip() != target:
        verdict += f" (stated: {text})"
    elif ";" in text:
        verdict += "; other targets in the docs"
    return verdict


def _result_link(head: Headline, prefix: str) -> str:
    return f"[`{head.name}`]({prefix}benchmarks/results/{head.name}.md)"


def render_systems(_: str | None) -> str:
    rows = [
        "| System | What it does | Headline (ours vs baseline) | Ratio | Target | Docs |",
        "|---|---|---|---|---|---|",
    ]
    dirty = False
    for title, system, what in SYSTEM_ROWS:
        head = cited(system)[0]
        dirty |= head.dirty
        figure = (f"{head.metric}: {_ours(head)} vs {number(head.baseline)} "
                  f"({head.baseline_name}), {_result_link(head, '')}")  # fmt: skip
        docs = "—" if system == "suite" else f"[docs/{system}.md](docs/{system}.md)"
        rows.append(f"| {title} | {what} | {figure} | {number(head.ratio)}× | {_verdict(head)} "
                    f"| {docs} |")  # fmt: skip
    return "\n".join(rows) + (f"\n\n{DIRTY_NOTE}" if dirty else "")


def render_results(system: str | None) -> str:
    heads = cited(system)
    rows = ["| Result | What | Metric | Ours | Baseline | Ratio | Target |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for head in heads:
        rows.append(f"| {_result_link(head, '../')} | {head.what} | {head.metric} | {_ours(head)} "
                    f"| {number(head.baseline)} ({head.baseline_name}) | {number(head.ratio)}× "
                    f"| {_verdict(head, full=True)} |")  # fmt: skip
    lines = [*rows, "", "Commands (run from a checkout after `make install`):", ""]
    for head in heads:
        if head.command:
            lines.append(f"- `{head.name}`: `{head.command}`")
        else:
            lines.append(f"- `{head.name}`: `{KNOWN_COMMANDS[head.name]}` (as documented when it "
                         "was run; this result file predates recorded commands)")  # fmt: skip
    if any(head.dirty for head in heads):
        lines += ["", DIRTY_NOTE]
    return "\n".join(lines)


def _config_class(system: str) -> type:
    module, _, name = CONFIG_CLASSES[system].partition(":")
    return getattr(importlib.import_module(module), name)


def render_config(system: str) -> str:
    from vllm_ext.common import config as common

    cls = _config_class(system)
    try:
        public = common.config_table(cls, system, experimental=False)
        experimental = common.config_table(cls, system, experimental=True)
    except TypeError:  # before the public/experimental split
        return common.config_table(cls, system)
    text = public
    if experimental.strip():
        text += ("\n\nExperimental settings (ablations; under `\"experimental\": {...}` in the "
                 f"same `{system}` block):\n\n{experimental}")  # fmt: skip
    return text


def counter_specs(system: str) -> tuple[list, str]:
    """``([spec or (counter, help)], labels)`` from the system's declarations, without
    importing vLLM."""
    if system == "leap":
        from vllm_ext.leap.runtime import COUNTERS

        return list(COUNTERS), CONNECTOR_LABELS
    if system == "histate":
        from vllm_ext.histate.runtime import COUNTER_SPECS

        return list(COUNTER_SPECS), CONNECTOR_LABELS
    # Flide's counters live in its API-server module, which imports vLLM: read them from source
    tree = ast.parse((REPO / "vllm_ext" / "flide" / "api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_COUNTERS":
            return list(ast.literal_eval(node.value).items()), CONNECTOR_LABELS
    raise LookupError("vllm_ext/flide/api.py no longer declares _COUNTERS; update docs/gen.py")


def unit_of(counter: str) -> str:
    if counter.endswith("_seconds"):
        return "seconds"
    if "bytes" in counter:
        return "bytes"
    if "tokens" in counter:
        return "tokens"
    if "log_error" in counter:
        return "log1p(tokens)"
    return "count"


def render_metrics(system: str) -> str:
    from vllm_ext.common.counters import GaugeSpec, HistogramSpec

    specs, labels = counter_specs(system)
    rows = ["| Name | Type | Unit | Labels | Meaning |", "|---|---|---|---|---|"]
    for spec in specs:
        name, doc = (spec.name, spec.doc) if hasattr(spec, "doc") else spec
        kind, suffix, own = "counter", "_total", labels
        if isinstance(spec, GaugeSpec):
            kind, suffix = "gauge", ""
            own = f"{labels}, `{spec.label}`" if spec.label else labels
        elif isinstance(spec, HistogramSpec):
            kind, suffix = "histogram", ""
        metric = f"vllm_ext:{system}_{name}{suffix}"
        rows.append(f"| `{metric}` | {kind} | {unit_of(name)} | {own} | {doc} |")
    return "\n".join(rows)


EXTRA_USES = {
    "cpu": "vLLM's CPU build (skip it if vLLM is installed)",
    "cuda": "CUDA vLLM (skip it if vLLM is installed)",
    "assets": "`python -m vllm_ext.assets`: SmolLM2-135M and tiny test models, built offline",
    "test": "the test tiers",
    "bench": "`make bench`",
    "memx": "`vllm-ext memx`: YAML specs and the memory plot",
    "nixl": "ARK over NIXL (`ArkNixlConnector`, the NIXL testbed)",
    "gptq": "TVQ's GPTQ baseline (`benchmarks/tvq/gptq.py`, in a venv of its own)",
}


def render_extras(_: str | None) -> str:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    rows = ["| Extra | Adds | For |", "|---|---|---|"]
    for name, requirements in extras["optional-dependencies"].items():
        if name not in EXTRA_USES:
            raise LookupError(f"extra {name!r} has no entry in EXTRA_USES (docs/gen.py)")
        adds = ", ".join(f"`{r}`" for r in requirements)
        rows.append(f"| `{name}` | {adds} | {EXTRA_USES[name]} |")
    return "\n".join(rows)


RENDERERS = {
    "extras": render_extras,
    "systems": render_systems,
    "results": render_results,
    "config": render_config,
    "metrics": render_metrics,
}


def regenerate(text: str) -> str:
    """``text`` with every generated block rendered anew."""

    def replace(match: re.Match) -> str:
        body = RENDERERS[match["kind"]](match["arg"])
        return f"{match.group(1)}{body}\n{match.group(5)}"

    return BLOCK.sub(replace, text)


def stale_files() -> list[str]:
    return [name for name in FILES if regenerate((REPO / name).read_text()) !=
            (REPO / name).read_text()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            sys.stderr.write(f"{name} is stale: run `make docs`\n")
        return 1 if stale else 0
    for name in FILES:
        path = REPO / name
        text = path.read_text()
        new = regenerate(text)
        if new != text:
            path.write_text(new)
            sys.stdout.write(f"updated {name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
