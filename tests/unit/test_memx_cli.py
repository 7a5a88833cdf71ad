"""``vllm-ext memx plan|serve``: tables, JSON, the plot, and bad input named by field."""

from __future__ import annotations

import json

import pytest
import yaml

from vllm_ext.cli import main as vllm_ext_main
from vllm_ext.memx.cli import main
from vllm_ext.memx.spec import SpecError, cluster_from_dict, load_cluster, load_model

SPECS = "vllm_ext/memx/specs"
SMALL = {
    "cross_vendor_gbps": 25,
    "groups": [
        {
            "name": "nv",
            "vendor": "nvidia",
            "type": "A100-40GB",
            "count": 2,
            "gpus_per_node": 2,
            "mem_gib": 40,
            "bf16_tflops": 312,
            "mfu": 0.45,
            "hbm_gbps": 1555,
            "intra_gbps": 300,
            "inter_gbps": 25,
        },
        {
            "name": "amd",
            "vendor": "amd",
            "type": "MI250",
            "count": 2,
            "gpus_per_node": 2,
            "mem_gib": 128,
            "bf16_tflops": 362,
            "mfu": 0.35,
            "hbm_gbps": 3277,
            "intra_gbps": 100,
            "inter_gbps": 25,
        },
    ],
}
MODEL = {
    "name": "m",
    "layers": 8,
    "hidden": 2048,
    "ffn": 5504,
    "heads": 16,
    "kv_heads": 16,
    "vocab": 32000,
    "zero_stage": 0,
}


@pytest.fixture
def files(tmp_path):
    c, m = tmp_path / "c.yaml", tmp_path / "m.yaml"
    c.write_text(yaml.safe_dump(SMALL))
    m.write_text(yaml.safe_dump(MODEL))
    return str(c), str(m), tmp_path


def test_plan_prints_table_and_writes_json_and_plot(files, capsys):
    c, m, tmp = files
    rc = vllm_ext_main(
        [
            "memx",
            "plan",
            "--cluster",
            c,
            "--model",
            m,
            "--global-batch",
            "16",
            "--seq",
            "1024",
            "--top",
            "3",
            "--no-progress",
            "--json",
            str(tmp / "o.json"),
            "--plot",
            str(tmp / "o.png"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "MemX top plans" in out and "metis:" in out and "sailor:" in out
    data = json.loads((tmp / "o.json").read_text())
    assert data["evaluated"] > 0 and len(data["top"]["memx"]) == 3
    assert all(not p["oom"] for p in data["top"]["memx"])
    assert (tmp / "o.png").stat().st_size > 0


def test_shipped_specs_load():
    assert len(load_cluster(f"{SPECS}/three_vendor.yaml").groups) == 3
    assert load_model(f"{SPECS}/llama_33b_zero0.yaml").layers == 60
    assert load_model(f"{SPECS}/llama2_13b.yaml").zero_stage == 1


def test_no_plan_fits_names_the_binding_constraint(files, capsys):
    c, m, tmp = files
    big = tmp / "big.yaml"
    big.write_text(
        yaml.safe_dump(MODEL | {"hidden": 16384, "ffn": 65536, "heads": 128, "kv_heads": 128})
    )
    rc = main(
        [
            "plan",
            "--cluster",
            c,
            "--model",
            str(big),
            "--global-batch",
            "8",
            "--seq",
            "4096",
            "--no-progress",
        ]
    )
    assert rc == 1 and "binding constraint: memory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["groups"][1].update(mem_gib=0), r"cluster.groups\[1\].mem_gib must be > 0"),
        (lambda d: d["groups"][0].pop("vendor"), r"cluster.groups\[0\].vendor is missing"),
        (lambda d: d["groups"][0].update(mfu=1.5), r"cluster.groups\[0\].mfu"),
        (lambda d: d["groups"][0].update(count=3), r"cluster.groups\[0\].count \(3\)"),
        (lambda d: d.update(bogus=1), r"unknown field\(s\) \['bogus'\]"),
        (lambda d: d.pop("cross_vendor_gbps"), r"cluster.cross_vendor_gbps is missing"),
    ],
)
def test_bad_cluster_names_the_field(change, message):
    data = json.loads(json.dumps(SMALL))
    change(data)
    with pytest.raises(SpecError, match=message):
        cluster_from_dict(data)


def test_bad_cli_input_is_one_line(files, capsys):
    c, m, tmp = files
    assert (
        main(
            [
                "plan",
                "--cluster",
                str(tmp / "none.yaml"),
                "--model",
                m,
                "--global-batch",
                "8",
                "--seq",
                "64",
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                "--cluster",
                c,
                "--model",
                m,
                "--global-batch",
                "8",
                "--seq",
                "64",
                "--micro-batch",
                "3",
            ]
        )
        == 2
    )
    assert "--micro-batch sizes [3]" in capsys.readouterr().err
    bad = tmp / "bad.yaml"
    bad.write_text(yaml.safe_dump(MODEL | {"heads": 15}))
    assert (
        main(
            ["serve", "--cluster", c, "--model", str(bad), "--context", "10", "--concurrency", "1"]
        )
        == 2
    )
    assert "model.hidden (2048) is not a multiple of model.heads" in capsys.readouterr().err


def test_serve_emits_vllm_arguments_per_group(files, capsys):
    c, m, tmp = files
    rc = main(
        [
            "serve",
            "--cluster",
            c,
            "--model",
            m,
            "--hf-model",
            "org/m",
            "--context",
            "4096",
            "--concurrency",
            "8",
            "--json",
            str(tmp / "s.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.count("vllm serve org/m --tensor-parallel-size") == 2
    plans = json.loads((tmp / "s.json").read_text())
    for p in plans:
        assert p["tp"] * p["pp"] * p["replicas"] == 2 and p["util"] <= 0.9
    too_long = main(
        ["serve", "--cluster", c, "--model", m, "--context", "10000000", "--concurrency", "64"]
    )
    assert too_long == 2 and "do not fit" in capsys.readouterr().err
