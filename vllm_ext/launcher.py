"""Compose a plain ``vllm serve`` command line from ``--plugins`` words.

vLLM has no ``--plugins`` flag; ``vllm-ext serve MODEL --plugins a,b [vllm args]``
turns each word into what that system needs — ``VLLM_PLUGINS`` names (general
and endpoint plugins; vLLM 0.32 loads endpoint routes only when allowlisted),
a ``--scheduler-cls``, a KV connector (several connectors become one
``MultiConnector``), extra flags — and prints the equivalent plain command.
Pure Python: it never imports vLLM, so it also runs where vLLM is broken.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_ext.common.parallel_gate import parallel_sizes


class LaunchError(ValueError):
    """The requested combination of plugins and vLLM flags cannot be composed."""


@dataclass(frozen=True)
class SystemLaunch:
    """What one ``--plugins`` word adds to ``vllm serve``.

    ``allowlist`` names plugins that load only when listed in ``VLLM_PLUGINS``
    (vLLM's ``vllm.endpoint_plugins``); general plugins load by default.
    ``flags`` are vLLM options the system needs (``("--load-format", "leap")``);
    a user value for the same option that differs is an error, with
    ``flag_reasons[option]`` saying why the system needs its value.
    """

    name: str
    allowlist: tuple[str, ...] = ()
    scheduler_cls: str | None = None
    kv_connector: Mapping | None = None
    flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    flag_reasons: Mapping[str, str] = field(default_factory=dict)
    # False where kv_connector is only a seam (nothing is transferred): see _reserved_cpu_env
    transfers_kv: bool = True


# Systems join this table as they land (their issue adds the entry).
SYSTEMS: dict[str, SystemLaunch] = {
    "leap": SystemLaunch(
        "leap",
        scheduler_cls="vllm_ext.leap.scheduler.make_scheduler",
        kv_connector={
            "kv_connector": "LeapConnector",
            "kv_connector_module_path": "vllm_ext.leap.connector",
        },
        flags=("--load-format", "leap"),
        transfers_kv=False,
        flag_reasons={
            "--load-format": "LEAP needs --load-format leap: its loader wraps the load "
            "format named in --model-loader-extra-config "
            "'{\"leap_inner_load_format\": ...}' (default auto) to install the length "
            "probe before compilation",
        },
    ),
    "histate": SystemLaunch(
        "histate",
        kv_connector={
            "kv_connector": "HiStateConnector",
            "kv_connector_module_path": "vllm_ext.histate.connector",
        },
        flags=("--enable-prefix-caching",),
        flag_reasons={
            "--enable-prefix-caching": "HiState needs --enable-prefix-caching: hybrid models "
            "keep block-aligned recurrent states (Mamba align mode) only with prefix caching",
        },
    ),
    "flide": SystemLaunch(
        "flide",
        allowlist=("flide",),
        flags=("--worker-extension-cls", "vllm_ext.flide.worker.FlideWorkerExtension"),
        flag_reasons={
            "--worker-extension-cls": "Flide runs its packed pass through a worker RPC: it "
            "needs --worker-extension-cls vllm_ext.flide.worker.FlideWorkerExtension",
        },
    ),
    "acct": SystemLaunch(
        "acct",
        kv_connector={
            "kv_connector": "AcctConnector",
            "kv_connector_module_path": "vllm_ext.acct.connector",
            # the online check hands a rejected import back to vLLM's own prefill
            "kv_load_failure_policy": "recompute",
        },
    ),
    # ARK: a P/D pair; the word names the instance's role (the proxy joins them)
    "ark-prefill": SystemLaunch(
        "ark-prefill",
        kv_connector={
            "kv_connector": "ArkConnector",
            "kv_connector_module_path": "vllm_ext.ark.connector",
            "kv_role": "kv_producer",
        },
    ),
    "ark-decode": SystemLaunch(
        "ark-decode",
        kv_connector={
            "kv_connector": "ArkConnector",
            "kv_connector_module_path": "vllm_ext.ark.connector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
        },
    ),
}


@dataclass(frozen=True)
class LaunchPlan:
    argv: tuple[str, ...]
    env: Mapping[str, str]

    def shell(self) -> str:
        """The plan as one copy-pasteable shell command."""
        env = " ".join(f"{key}={shlex.quote(val)}" for key, val in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


def parse_plugin_list(text: str, systems: Mapping[str, SystemLaunch]) -> list[str]:
    """``"leap, histate"`` → ``["leap", "histate"]``; unknown words raise, listing valid ones."""
    names = [word.strip() for word in text.split(",") if word.strip()]
    unknown = [name for name in names if name not in systems]
    if unknown:
        valid = ", ".join(sorted(systems)) or "(none yet)"
        raise LaunchError(f"unknown plugin(s) {', '.join(unknown)}; valid plugins: {valid}")
    if len(set(names)) != len(names):
        raise LaunchError(f"plugin listed twice in {text!r}")
    return names


def compose(
    model: str,
    plugins: Sequence[str],
    vllm_args: Sequence[str],
    environ: Mapping[str, str],
    general_plugins: Sequence[str] = (),
    systems: Mapping[str, SystemLaunch] = SYSTEMS,
) -> LaunchPlan:
    """Build the ``vllm serve`` argv and env for ``plugins`` on top of the user's args.

    Args:
        general_plugins: names of all installed ``vllm.general_plugins``; kept
            loadable when ``VLLM_PLUGINS`` must be set for an allowlisted plugin.
    """
    chosen = [systems[name] for name in plugins]
    args = list(vllm_args)
    user_kv = _pop_flag(args, "--kv-transfer-config")
    args += _scheduler_flags(chosen, args)
    connectors = [dict(s.kv_connector) for s in chosen if s.kv_connector]
    if user_kv is not None:
        connectors.insert(0, _parse_kv_json(user_kv))
    if connectors:
        args += ["--kv-transfer-config", json.dumps(_one_connector(connectors), sort_keys=True)]
    for system in chosen:
        args += _system_flags(system, args)
    env = _compose_env(chosen, environ, general_plugins)
    env.update(_reserved_cpu_env(chosen, user_kv, args, environ))
    return LaunchPlan(("vllm", "serve", model, *args), env)


# vLLM's CPU executor (vllm/utils/ompmultiprocessing.py) keeps one core per local rank free of
# the model's OpenMP threads, for the scheduler and API server, and one more per rank whenever
# a kv_transfer_config is set (meant for NIXL's P/D transfers). A system whose connector only
# hooks the scheduler and worker would take that extra core from the model; on a 2-core host
# the reservation (2 of 2) then fails and OpenMP binds every core, so any other busy process
# stalls the forward (LEAP beside one busy loop: 3.1x slower than FCFS, issue 37).
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def _reserved_cpu_env(
    chosen: Sequence[SystemLaunch], user_kv: str | None, args: Sequence[str],
    environ: Mapping[str, str],
) -> dict[str, str]:  # fmt: skip
    """Plain vLLM's CPU reservation when our connectors transfer nothing (CUDA ignores it)."""
    connectors = [s for s in chosen if s.kv_connector]
    if RESERVED_CPU_ENV in environ or user_kv is not None or not connectors:
        return {}
    if any(s.transfers_kv for s in connectors):
        return {}
    tensor, pipeline = parallel_sizes(args)
    return {RESERVED_CPU_ENV: str(max(1, tensor * pipeline))}


def _option_name(arg: str) -> str | None:
    """``--load_format=x`` → ``--load-format``; None for a value (vLLM accepts ``_`` for ``-``)."""
    if not arg.startswith("--"):
        return None
    return arg.split("=", 1)[0].replace("_", "-")


def _pop_flag(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if _option_name(arg) != flag:
            continue
        if "=" in arg:
            del args[i]
            return arg.split("=", 1)[1]
        if i + 1 >= len(args):
            raise LaunchError(f"{flag} needs a value")
        value = args[i + 1]
        del args[i : i + 2]
        return value
    return None


def _user_values(args: Sequence[str], flag: str) -> list[str | None]:
    """Values the user gave ``flag`` (None for a bare switch), in order."""
    values: list[str | None] = []
    for i, arg in enumerate(args):
        if _option_name(arg) != flag:
            continue
        if "=" in arg:
            values.append(arg.split("=", 1)[1])
        elif i + 1 < len(args) and _option_name(args[i + 1]) is None:
            values.append(args[i + 1])
        else:
            values.append(None)
    return values


def _split_options(flags: Sequence[str]) -> list[tuple[str, str | None]]:
    """``("--a", "1", "--b")`` → ``[("--a", "1"), ("--b", None)]``."""
    options: list[tuple[str, str | None]] = []
    for flag in flags:
        if _option_name(flag) is None:
            if not options or options[-1][1] is not None:
                raise LaunchError(f"malformed system flags {tuple(flags)!r}")
            options[-1] = (options[-1][0], flag)
        else:
            options.append((flag, None))
    return options


def _system_flags(system: SystemLaunch, args: Sequence[str]) -> list[str]:
    """The system's flags the user did not already pass; a conflicting user value raises.

    Compared per option, not per word: appending only the missing words of
    ``--load-format leap`` to a user's ``--load-format auto`` would leave a
    dangling ``leap`` argument (or silently let the user's value win).
    """
    added: list[str] = []
    for flag, value in _split_options(system.flags):
        given = _user_values(args, flag)
        negated = value is None and _user_values(args, "--no-" + flag[2:])
        if not given and not negated:
            added += [flag] if value is None else [flag, value]
            continue
        if negated or any(v != value for v in given):
            shown = [flag if v is None else f"{flag} {v}" for v in given]
            shown += [f"--no-{flag[2:]}"] if negated else []
            want = flag if value is None else f"{flag} {value}"
            reason = system.flag_reasons.get(flag, f"plugin {system.name} needs {want}")
            raise LaunchError(f"{reason}; you passed {' '.join(shown)}")
    return added


def _scheduler_flags(chosen: Sequence[SystemLaunch], args: Sequence[str]) -> list[str]:
    wanted = [s for s in chosen if s.scheduler_cls]
    if not wanted:
        return []
    if len(wanted) > 1:
        raise LaunchError(f"plugins {', '.join(s.name for s in wanted)} each replace the scheduler")
    if any(_option_name(a) == "--scheduler-cls" for a in args):
        raise LaunchError(f"plugin {wanted[0].name} sets --scheduler-cls; do not pass it as well")
    return ["--scheduler-cls", wanted[0].scheduler_cls]


def _parse_kv_json(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LaunchError(f"--kv-transfer-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict) or "kv_connector" not in value:
        raise LaunchError("--kv-transfer-config must be a JSON object with 'kv_connector'")
    return value


def _one_connector(connectors: list[dict]) -> dict:
    """vLLM has one KV-connector slot: several connectors share it through MultiConnector."""
    if len(connectors) == 1:
        return {"kv_role": "kv_both", **connectors[0]}
    inner = [{"kv_role": "kv_both", **c} for c in connectors]
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": inner},
    }
    # vLLM's scheduler reads the failure policy of the outer config only
    policies = {c["kv_load_failure_policy"] for c in inner if "kv_load_failure_policy" in c}
    if len(policies) > 1:
        raise LaunchError(f"connectors need different kv_load_failure_policy: {sorted(policies)}")
    if policies:
        multi["kv_load_failure_policy"] = policies.pop()
    return multi


def _compose_env(
    chosen: Sequence[SystemLaunch], environ: Mapping[str, str], general_plugins: Sequence[str]
) -> dict[str, str]:
    env: dict[str, str] = {}
    needed = [name for s in chosen for name in s.allowlist]
    existing = environ.get("VLLM_PLUGINS")
    # an unset VLLM_PLUGINS loads every general plugin; setting it (only when an
    # allowlisted plugin needs it) must not silently drop the others
    if needed or existing is not None:
        if existing is not None:
            names = [name.strip() for name in existing.split(",")]
        else:
            names = list(general_plugins)
        names += [name for name in needed if name not in names]
        env["VLLM_PLUGINS"] = ",".join(name for name in names if name)
    for system in chosen:
        for key, value in system.env.items():
            if env.get(key, value) != value:
                raise LaunchError(f"plugins disagree on {key}")
            env[key] = value
    return env
