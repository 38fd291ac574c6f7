"""The bench on CPU: 2 gloo processes, a few steps. The figures mean little here; the flow, the
JSON and the clean exit are what users rely on."""

import json
import subprocess
import sys

from conftest import PACKAGE


def bench(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.bench", *args], cwd=cwd, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


def test_bench_reports_every_figure_and_leaves_only_its_json(tmp_path):
    done = bench(tmp_path, "--warmup", "10", "--steps", "10", "--json", "figures.json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json"]
    report = json.loads((tmp_path / "figures.json").read_text())
    runs = report["runs"]
    assert sorted(runs) == ["minimal_1", "no_grad_sync_2", "template_1", "template_2"]
    for run in runs.values():
        assert run["step_time_ms"] > 0 and run["samples_per_s"] > 0
        assert len(run["window_step_ms"]) == 1  # 10 timed steps: one window
    assert report["processes"] == 2 and report["parameters"] > 0
    expected = runs["template_2"]["samples_per_s"] / (2 * runs["template_1"]["samples_per_s"])
    assert abs(report["scaling_efficiency"] - round(expected, 3)) < 1e-3
    assert report["overhead_ratio"] > 0
    assert report["gradient_allreduce"]["busbw_gbps"] > 0
    assert 0 <= report["comm_hidden_share"] <= 1
    assert "scaling efficiency (1 -> 2)" in done.stdout
    assert "overhead ratio" in done.stdout


def test_bench_bad_override_is_one_line_and_writes_nothing(tmp_path):
    done = bench(tmp_path, "dist.bucket_cap_mb=0")
    assert done.returncode == 2
    assert done.stderr.strip() == "config error: dist.bucket_cap_mb=0: must be at least 1"
    assert list(tmp_path.iterdir()) == []


def test_bench_model_config_has_over_100m_parameters(compose_train):
    import torch
    from omegaconf import OmegaConf

    from {{ cookiecutter.package }}.config import TrainConfig
    from {{ cookiecutter.package }}.model import build_model

    cfg: TrainConfig = OmegaConf.to_object(compose_train("experiment=mlp_134m"))
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data)
    assert sum(p.numel() for p in model.parameters()) > 100e6
    assert cfg.data.batch_size == 256 and cfg.data.on_device
