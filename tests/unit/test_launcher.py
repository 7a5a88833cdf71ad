"""vllm-ext serve: plugin words → one plain `vllm serve` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_ext.launcher import LaunchError, SystemLaunch, compose, parse_plugin_list

# launch descriptions shaped like real systems' (scheduler, connector, endpoint)
SCHED = SystemLaunch(
    "sched",
    scheduler_cls="pkg.sched:make_scheduler",
    kv_connector={"kv_connector": "SchedConnector"},
)
STORE = SystemLaunch(
    "store",
    kv_connector={"kv_connector": "StoreConnector", "kv_connector_extra_config": {"dir": "/tmp/x"}},
    flags=("--enable-prefix-caching",),
)
ROUTE = SystemLaunch("route", allowlist=("route_endpoint",))
SYSTEMS = {s.name: s for s in (SCHED, STORE, ROUTE)}
GENERAL = ("vllm_ext", "lora_filesystem_resolver")


def _kv(plan):
    argv = list(plan.argv)
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_no_plugins_is_plain_vllm_serve():
    plan = compose("m", [], ["--max-num-seqs", "4"], {}, GENERAL, SYSTEMS)
    assert plan.argv == ("vllm", "serve", "m", "--max-num-seqs", "4")
    assert plan.env == {}
    assert plan.shell() == "vllm serve m --max-num-seqs 4"


def test_unknown_plugin_lists_valid_ones():
    with pytest.raises(
        LaunchError, match="unknown plugin.*nope.*valid plugins: route, sched, store"
    ):
        parse_plugin_list("sched,nope", SYSTEMS)


def test_duplicate_plugin_rejected():
    with pytest.raises(LaunchError, match="twice"):
        parse_plugin_list("sched, sched", SYSTEMS)


def test_single_connector_goes_in_directly():
    plan = compose("m", ["store"], [], {}, GENERAL, SYSTEMS)
    kv = _kv(plan)
    assert kv["kv_connector"] == "StoreConnector" and kv["kv_role"] == "kv_both"
    assert "--enable-prefix-caching" in plan.argv


def test_two_connectors_share_the_slot_through_multiconnector():
    plan = compose("m", ["sched", "store"], [], {}, GENERAL, SYSTEMS)
    kv = _kv(plan)
    assert kv["kv_connector"] == "MultiConnector"
    inner = kv["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in inner] == ["SchedConnector", "StoreConnector"]
    assert all(c["kv_role"] == "kv_both" for c in inner)
    assert plan.argv[plan.argv.index("--scheduler-cls") + 1] == "pkg.sched:make_scheduler"


def test_user_connector_is_kept_beside_ours():
    user = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    plan = compose("m", ["sched"], ["--kv-transfer-config", user], {}, GENERAL, SYSTEMS)
    kv = _kv(plan)
    inner = kv["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in inner] == ["NixlConnector", "SchedConnector"]
    assert plan.argv.count("--kv-transfer-config") == 1


def test_user_scheduler_cls_conflicts_with_a_scheduler_plugin():
    with pytest.raises(LaunchError, match="--scheduler-cls"):
        compose("m", ["sched"], ["--scheduler-cls", "x.Y"], {}, GENERAL, SYSTEMS)


def test_allowlisted_plugin_sets_vllm_plugins_without_dropping_general_ones():
    plan = compose("m", ["route"], [], {}, GENERAL, SYSTEMS)
    assert plan.env["VLLM_PLUGINS"] == "vllm_ext,lora_filesystem_resolver,route_endpoint"


def test_existing_vllm_plugins_is_extended_not_replaced():
    plan = compose("m", ["route"], [], {"VLLM_PLUGINS": "mine"}, GENERAL, SYSTEMS)
    assert plan.env["VLLM_PLUGINS"] == "mine,route_endpoint"


def test_bad_user_kv_json_is_named():
    with pytest.raises(LaunchError, match="not valid JSON"):
        compose("m", [], ["--kv-transfer-config", "{oops"], {}, GENERAL, SYSTEMS)


def test_cli_dry_run_prints_equivalent_command_and_rejects_unknown():
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_ext.cli",
            "serve",
            "some/model",
            "--dry-run",
            "--max-num-seqs",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "vllm serve some/model --max-num-seqs 2" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "vllm_ext.cli", "serve", "m", "--plugins", "nope"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown plugin(s) nope; valid plugins:" in bad.stderr


def test_system_flag_is_added_once_and_a_matching_user_value_is_kept():
    plan = compose("m", ["leap"], [], {}, GENERAL)
    argv = list(plan.argv)
    assert argv[argv.index("--load-format") + 1] == "leap"
    for given in (["--load-format", "leap"], ["--load-format=leap"], ["--load_format", "leap"]):
        argv = compose("m", ["leap"], given, {}, GENERAL).argv
        # the user's spelling stays, nothing is appended (no dangling "leap")
        assert [a for a in argv if a == "leap" or "load" in a] == given


@pytest.mark.parametrize(
    "given", [["--load-format", "auto"], ["--load-format=safetensors"], ["--load_format", "dummy"]]
)
def test_leap_rejects_another_load_format_and_says_why(given):
    with pytest.raises(LaunchError, match="LEAP needs --load-format leap.*leap_inner_load_format"):
        compose("m", ["leap"], given, {}, GENERAL)


def test_conflicting_switch_or_value_of_a_system_flag_is_an_error():
    with pytest.raises(LaunchError, match="plugin store needs --enable-prefix-caching"):
        compose("m", ["store"], ["--no-enable-prefix-caching"], {}, GENERAL, SYSTEMS)
    valued = SystemLaunch("v", flags=("--block-size", "16"))
    with pytest.raises(LaunchError, match="needs --block-size 16; you passed --block-size 32"):
        compose("m", ["v"], ["--block-size", "32"], {}, GENERAL, {"v": valued})
    plan = compose("m", ["store"], ["--enable-prefix-caching"], {}, GENERAL, SYSTEMS)
    assert plan.argv.count("--enable-prefix-caching") == 1


def test_cli_dry_run_for_leap_prints_everything_leap_needs():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_ext.cli", "serve", "m", "--plugins", "leap", "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--scheduler-cls vllm_ext.leap.scheduler.make_scheduler" in out
    assert "--load-format leap" in out
    assert "VLLM_USE_V2_MODEL_RUNNER" not in out  # vLLM 0.34 raises on =0
    assert '"kv_connector": "LeapConnector"' in out


def test_flide_adds_its_worker_extension_and_allowlists_its_route():
    from vllm_ext.launcher import SYSTEMS

    plan = compose("m", ["flide", "leap"], [], {}, general_plugins=["vllm_ext", "leap"])
    argv = list(plan.argv)
    ext = argv.index("--worker-extension-cls")
    assert argv[ext + 1] == "vllm_ext.flide.worker.FlideWorkerExtension"
    assert plan.env["VLLM_PLUGINS"].split(",") == ["vllm_ext", "leap", "flide"]
    with pytest.raises(LaunchError, match="worker RPC"):
        compose("m", ["flide"], ["--worker-extension-cls", "other.Ext"], {}, systems=SYSTEMS)


def test_acct_adds_its_connector_with_recompute_also_behind_multiconnector():
    kv = _kv(compose("m", ["acct"], [], {}))
    assert kv["kv_connector"] == "AcctConnector"
    assert kv["kv_connector_module_path"] == "vllm_ext.acct.connector"
    assert kv["kv_load_failure_policy"] == "recompute"
    kv = _kv(compose("m", ["histate", "acct"], [], {}))
    assert kv["kv_connector"] == "MultiConnector"
    assert kv["kv_load_failure_policy"] == "recompute"  # the scheduler reads the outer one
    names = [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]]
    assert names == ["HiStateConnector", "AcctConnector"]
    user = '{"kv_connector": "X", "kv_load_failure_policy": "fail"}'
    with pytest.raises(LaunchError, match="kv_load_failure_policy"):
        compose("m", ["acct"], ["--kv-transfer-config", user], {})


@pytest.mark.parametrize(
    ("word", "role"), [("ark-prefill", "kv_producer"), ("ark-decode", "kv_consumer")]
)
def test_ark_words_set_the_ark_connector_and_its_role(word, role):
    from vllm.config import KVTransferConfig

    from vllm_ext.launcher import SYSTEMS as REAL

    plan = compose("m", parse_plugin_list(word, REAL), ["--port", "8001"], {}, GENERAL, REAL)
    kv = _kv(plan)
    assert kv["kv_connector"] == "ArkConnector"
    assert kv["kv_connector_module_path"] == "vllm_ext.ark.connector"
    assert kv["kv_role"] == role
    # vLLM accepts it as its own config, and it names the role ArkConnector checks
    config = KVTransferConfig(**kv)
    assert config.is_kv_producer == (role == "kv_producer")
    assert config.is_kv_consumer == (role == "kv_consumer")
    assert "VLLM_PLUGINS" not in plan.env


SEAM = SystemLaunch("seam", kv_connector={"kv_connector": "SeamConnector"}, transfers_kv=False)


@pytest.mark.parametrize(
    ("args", "reserved"),
    [
        ([], "1"),
        (["-tp", "2"], "2"),
        (["--tensor-parallel-size=2", "--pipeline-parallel-size", "2"], "4"),
        (["--tensor_parallel_size", "2", "-pp=3"], "6"),
    ],
)
def test_a_seam_only_connector_keeps_plain_vllms_cpu_reservation(args, reserved):
    # vLLM's CPU executor reserves one more core per rank for any kv_transfer_config: a
    # connector that transfers nothing must not take that core from the model
    systems = {**SYSTEMS, "seam": SEAM}
    plan = compose("m", ["seam"], args, {}, GENERAL, systems)
    assert plan.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == reserved
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" in compose("m", ["leap"], args, {}, GENERAL).env


@pytest.mark.parametrize(
    ("plugins", "args", "environ"),
    [
        (["seam", "store"], [], {}),  # a connector that transfers keeps vLLM's extra core
        (["seam"], ["--kv-transfer-config", '{"kv_connector": "X", "kv_role": "kv_both"}'], {}),
        (["seam"], [], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),  # the user's own choice
        (["route"], [], {}),  # no connector: vLLM reserves as plain
    ],
)
def test_the_reservation_is_left_to_vllm_otherwise(plugins, args, environ):
    systems = {**SYSTEMS, "seam": SEAM}
    plan = compose("m", plugins, args, environ, GENERAL, systems)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in plan.env
