"""The bench on CPU: 2 gloo processes, a few steps. The figures mean little here; the flow, the
pairing, the JSON and the clean exit are what users rely on. Speed targets live in the bench's
GPU runs (the template's benchmarks), not in these tests."""

import argparse
import json
import statistics
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import PACKAGE, needs
from omegaconf import OmegaConf

from ddp_project import bench
from ddp_project.config.options import GptConfig, TokensConfig
from ddp_project.config.schema import TrainConfig
from ddp_project.core.world import World
from ddp_project.model import build_model


def test_bench_pairs_template_and_reference_and_leaves_only_its_json(
    tmp_path, monkeypatch, bench_main
):
    """The command in this process; its launch, torchrun's 2 gloo workers, for real."""
    monkeypatch.chdir(tmp_path)
    code, out, err = bench_main(
        "--pairs",
        "2",
        "--warmup",
        "10",
        "--steps",
        "10",
        "--json",
        "b.json",
        run_workers=bench.run_workers,
    )
    assert code == 0, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["processes"] == 2 and report["pairs"] == 2 and report["parameters"] > 0
    # --warmup 10 --steps 10 in whole windows of the default trainer.log_every, 25
    assert (report["window_steps"], report["warmup_steps"], report["timed_steps"]) == (25, 25, 25)
    assert sorted(report["step_ms"]) == ["1", "2"]
    for size, loops in report["step_ms"].items():
        assert sorted(loops) == ["reference", "template"]
        assert all(len(times) == 2 and min(times) > 0 for times in loops.values())
        ratios = [t / r for t, r in zip(loops["template"], loops["reference"], strict=True)]
        assert report["template_over_reference"][size]["median"] == pytest.approx(
            statistics.median(ratios), abs=1e-3
        )
    for loop in ("template", "reference"):
        assert 0 < report["scaling_efficiency"][loop]["median"] <= 1  # clamped: CPUs share cores
    assert report["gradient_allreduce"]["busbw_gbps"] > 0
    assert 0 <= report["comm_hidden_share"] <= 1
    assert "template / reference" in out and "scaling efficiency 1 -> 2" in out
    # the defaults' checkpoints and validations, every 100 steps, charged from the rows
    cadence = report["cadence"]
    assert cadence["every_steps"] == {"checkpoint": 100, "validation": 100}
    assert cadence["checkpoint_s"] > 0 and cadence["validation_s"] > 0
    assert 0 < report["goodput"] < 1
    line = (
        f"steady-state goodput at this config's cadence on 2 CPU processes: {report['goodput']:.3f}"
    )
    assert line in out


def test_goodput_spreads_each_cost_over_the_steps_between_and_leaves_out_what_is_off():
    cadence = {
        "every_steps": {"checkpoint": 500, "validation": 100},
        "checkpoint_s": 0.5,
        "validation_s": 0.2,
        "between_steps": 100,
    }
    # 0.1 s steps: 0.001 s of checkpoint and 0.002 s of validation per step
    assert bench.steady_goodput(cadence, 100.0) == round(0.1 / 0.103, 4)
    cadence["every_steps"]["validation"] = 0
    assert bench.steady_goodput(cadence, 100.0) == round(0.1 / 0.101, 4)
    assert bench.steady_goodput(None, 100.0) is None


def test_costs_are_measured_at_the_configs_cadence_up_to_about_10_s_of_steps():
    every = {"checkpoint": 2000, "validation": 500}
    assert bench.cadence_steps(every, 2.9, 25) == 500  # the config's, the shorter of the two
    assert bench.cadence_steps({"checkpoint": 2000, "validation": 0}, 2.9, 25) == 2000
    assert bench.cadence_steps({"checkpoint": 500, "validation": 500}, 66.0, 25) == 175  # 10 s
    assert bench.cadence_steps({"checkpoint": 500, "validation": 0}, 400.0, 25) == 100  # at least
    assert bench.cadence_steps({"checkpoint": 30, "validation": 0}, 6.0, 25) == 50  # whole windows


def test_both_loops_are_timed_over_the_log_windows_of_a_run_at_most_50_steps(compose_train):
    def window(*overrides):
        return bench.timed(OmegaConf.to_object(compose_train(*overrides))).trainer.log_every

    windows = [window(), window("trainer.log_every=7"), window("trainer.log_every=100000")]
    assert windows == [25, 7, 50]
    assert [bench.whole_windows(steps, 25) for steps in (0, 1, 25, 26)] == [0, 25, 25, 50]


def times(template_1, reference_1, template_2, reference_2):
    return {
        "1": {"template": template_1, "reference": reference_1},
        "2": {"template": template_2, "reference": reference_2},
    }


def result(step_ms, allreduce_ms=1.0, flops_per_token=None, peak_flops=None):
    return {
        "processes": 2,
        "step_ms": step_ms,
        "gradient_allreduce": {"time_ms": allreduce_ms},
        "batch_per_process": 4,
        "tokens_per_sample": 250,
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops,
    }


def test_figures_are_ratios_within_each_pair():
    # The machine slows down by half in the second pair: the ratios stay what they were.
    report = bench.figures(result(times([10.0, 15.0], [10.0, 15.0], [12.0, 18.0], [11.0, 16.5])))
    assert report["template_over_reference"]["1"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert report["template_over_reference"]["2"] == {
        "median": pytest.approx(12 / 11, abs=1e-4),
        "min": 1.0909,
        "max": 1.0909,
    }
    uneven = bench.figures(
        result(
            times([10.0, 10.0, 10.0], [10.0, 8.0, 5.0], [20.0, 30.0, 70.0], [20.0, 20.0, 20.0]),
            allreduce_ms=25.0,
        )
    )
    assert uneven["template_over_reference"]["1"] == {"median": 1.25, "min": 1.0, "max": 2.0}
    assert uneven["scaling_efficiency"]["template"] == {"median": 0.3333, "min": 0.1429, "max": 0.5}
    assert uneven["exposed_comm_ms"] == 20.0  # the median of 10, 20 and 60: not their mean, 30
    assert uneven["comm_hidden_share"] == 0.2  # 20 ms of a 25 ms all-reduce exposed
    assert report["scaling_efficiency"]["template"]["median"] == pytest.approx(10 / 12, abs=1e-4)
    assert report["scaling_efficiency"]["reference"]["median"] == pytest.approx(10 / 11, abs=1e-4)
    assert report["exposed_comm_ms"] == pytest.approx(2.5)  # median of 2 and 3
    assert (
        report["comm_hidden_share"] == 0.0 and report["noise"]
    )  # 2.5 ms exposed of a 1 ms all-reduce


def test_impossible_figures_are_clamped_and_named_as_noise():
    report = bench.figures(result(times([10.0], [10.0], [8.0], [9.0]), allreduce_ms=5.0))
    assert report["scaling_efficiency"]["template"]["median"] == 1.0
    assert report["scaling_efficiency"]["reference"]["median"] == 1.0
    assert report["comm_hidden_share"] == 1.0
    assert len(report["noise"]) == 3
    assert any("above 1, which cannot be" in note for note in report["noise"])
    assert "noise:" in bench.render({**report, **HEADER})


HEADER = {
    "device": "cpu",
    "torch": "2",
    "nccl": None,
    "nccl_profile": None,
    "parameters": 1e6,
    "batch_per_process": 8,
    "precision": "fp32",
    "pairs": 1,
    "timed_steps": 10,
    "warmup_steps": 10,
    "overrides": [],
    "gradient_allreduce": {"time_ms": 5.0, "mib": 4, "busbw_gbps": 1.0},
}


def test_bench_bad_override_is_one_line_and_writes_nothing(tmp_path, monkeypatch, bench_main):
    monkeypatch.chdir(tmp_path)
    code, out, err = bench_main("dist.bucket_cap_mb=0")
    assert (code, out) == (2, "")
    assert err.strip() == "config error: dist.bucket_cap_mb=0: must be at least 1"
    assert list(tmp_path.iterdir()) == []


def parameters(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg.model, cfg.data).parameters())


def test_the_mlp_bench_model_has_134m_parameters(compose_train):
    cfg: TrainConfig = OmegaConf.to_object(compose_train("experiment=mlp_134m"))
    assert parameters(cfg) == 8 * (4096 * 4096 + 4096) + 4096 * 8 + 8
    assert cfg.data.batch_size == 256 and cfg.data.on_device


def test_gpt2_small_is_gpt2_smalls_shape(compose_train):
    cfg: TrainConfig = OmegaConf.to_object(compose_train("experiment=gpt2_small"))
    assert isinstance(cfg.model, GptConfig) and isinstance(cfg.data, TokensConfig)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model) == (12, 12, 768)
    assert (cfg.data.seq_len, cfg.data.vocab_size, cfg.data.batch_size) == (1024, 50304, 32)
    block = 12 * 768**2 + 13 * 768  # attention 4d^2 + 4d, MLP 8d^2 + 5d, two layer norms 4d
    assert parameters(cfg) == 2 * 50304 * 768 + 1024 * 768 + 12 * block + 2 * 768  # a final norm
    assert cfg.trainer.compile  # on CUDA, where it wins; the bench's reference loop compiles too


# --- in-process: the command's arguments and the worker's run dirs, no launch ---------------


@pytest.fixture
def bench_main(monkeypatch, capsys):
    """bench_main(*args) -> (exit code, stdout, stderr) of bench's main, in this process, with
    the workers' run replaced by `result` (a dict) or by a failure when none is given; or the real
    one when `run_workers=bench.run_workers` is given."""

    def run(*args: str, result: dict | None = None, run_workers=None) -> tuple[int, str, str]:
        def canned(parsed, nproc):
            assert result is not None, "the bench launched despite a bad argument"
            return result

        monkeypatch.setattr(bench, "run_workers", run_workers or canned)
        monkeypatch.setattr(sys, "argv", ["bench", *args])
        try:
            code = bench.main()
        except SystemExit as stop:
            code = stop.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pairs", "0"], "argument --pairs: must be a whole number, at least 1; got '0'"),
        (["--pairs", "-1"], "argument --pairs: must be a whole number, at least 1; got '-1'"),
        (["--pairs", "abc"], "argument --pairs: must be a whole number, at least 1; got 'abc'"),
        (["--steps", "0"], "argument --steps: must be a whole number, at least 1; got '0'"),
        (["--warmup", "-5"], "argument --warmup: must be a whole number, at least 0; got '-5'"),
        (
            ["--timeout-s", "nan"],
            "argument --timeout-s: must be a number of seconds above 0; got 'nan'",
        ),
        (["--nproc", "2"], "unrecognized arguments: --nproc"),
        (
            ["--json", "missing/b.json"],
            "--json missing/b.json: cannot write the figures there: missing/ does not exist",
        ),
        (["--json", "."], "--json .: cannot write the figures there: it is a directory"),
    ],
)
def test_a_bad_argument_is_one_line_before_anything_runs(
    tmp_path, monkeypatch, bench_main, args, message
):
    monkeypatch.chdir(tmp_path)
    code, out, err = bench_main(*args)
    assert (code, out) == (2, "")
    assert err == f"{PACKAGE}.bench: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_figures_that_cannot_be_saved_are_printed_anyway(tmp_path, monkeypatch, bench_main):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "unwritable", lambda path: None)  # gone between check and write
    canned = {**result(times([10.0], [10.0], [12.0], [11.0])), **HEADER}
    code, out, err = bench_main("--json", "gone/b.json", result=canned)
    assert code == 1
    assert "template / reference" in out and "scaling efficiency 1 -> 2" in out
    assert err.startswith("bench: could not write gone/b.json: ") and err.count("\n") == 1


@pytest.mark.parametrize("logger", ["tensorboard", "csv"])
def test_the_template_loop_runs_in_a_run_dir_it_makes_whatever_the_logger(
    tmp_path, compose_train, logger
):
    cfg = OmegaConf.to_object(compose_train(f"logger={logger}"))
    run_dir = tmp_path / "scratch" / "template-1-0"  # as the worker names it; nothing made yet
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ms = bench.template_ms(cfg, World(), torch.device("cpu"), None, run_dir, 10, 10)
    finally:
        dist.destroy_process_group()
    assert ms > 0 and (run_dir / "metrics.jsonl").stat().st_size
    if logger == "csv":
        assert (run_dir / "metrics.csv").stat().st_size


def test_the_table_puts_each_figure_in_its_row_and_column():
    report = bench.figures(result(times([10.0], [8.0], [16.0], [10.0]), allreduce_ms=5.0))
    table = bench.render({**report, **HEADER, "gradient_allreduce": HEADER["gradient_allreduce"]})
    rows = {line[:22].strip(): line[22:].split("  ") for line in table.splitlines()[5:8]}
    cells = {name: [c.strip() for c in row if c.strip()] for name, row in rows.items()}
    assert cells == {
        "reference step ms": ["8.000 (8.000-8.000)", "10.000 (10.000-10.000)"],
        "template step ms": ["10.000 (10.000-10.000)", "16.000 (16.000-16.000)"],
        "template / reference": ["1.250 (1.250-1.250)", "1.600 (1.600-1.600)"],
    }
    assert table.splitlines()[4].split() == ["1", "CPU", "process", "2", "CPU", "processes"]
    assert "scaling efficiency 1 -> 2: template 0.625 (0.625-0.625), reference 0.800" in table
    assert (
        "all-reduce of the gradients (4 MiB fp32): 5.00 ms, 1.0 GB/s bus bandwidth; the "
        "2-process step is 6.00 ms longer than one (0% of the all-reduce hidden)"
    ) in table


def test_both_loops_mfu_comes_from_their_own_step_times_and_is_left_out_when_unknown():
    """1000 tokens per process and step, 1e9 FLOPs each, on a 1e14 FLOPS GPU: a 10 ms step is
    1e14 FLOPS, MFU 1.0, whatever the number of GPUs (the figures are per process)."""
    step_ms = times([10.0, 20.0], [8.0, 8.0], [12.5, 12.5], [10.0, 10.0])
    report = bench.figures(result(step_ms, flops_per_token=1e9, peak_flops=1e14))
    assert report["mfu"] == {
        "1": {
            "template": {"median": 0.75, "min": 0.5, "max": 1.0},
            "reference": {"median": 1.25, "min": 1.25, "max": 1.25},
        },
        "2": {
            "template": {"median": 0.8, "min": 0.8, "max": 0.8},
            "reference": {"median": 1.0, "min": 1.0, "max": 1.0},
        },
    }
    table = bench.render({**report, **HEADER})
    rows = {line[:22].strip(): line[22:].split() for line in table.splitlines()}
    assert rows["template MFU"] == ["0.750", "(0.500-1.000)", "0.800", "(0.800-0.800)"]
    assert rows["reference MFU"] == ["1.250", "(1.250-1.250)", "1.000", "(1.000-1.000)"]
    for unknown in ({"flops_per_token": 1e9}, {"peak_flops": 1e14}):  # a model of one's own, a CPU
        report = bench.figures(result(step_ms, **unknown))
        assert report["mfu"] is None
        table = bench.render({**report, **HEADER})
        assert "MFU" not in table


def test_a_failed_launch_names_the_root_cause(monkeypatch):
    from test_doctor import TORCHRUN_FAILURES

    output, cause = TORCHRUN_FAILURES["system_exit"]  # rank 0's consequence is labelled, too
    done = subprocess.CompletedProcess([], 1, stdout="", stderr=output)
    monkeypatch.setattr(bench.subprocess, "run", lambda *args, **kwargs: done)
    args = argparse.Namespace(pairs=1, warmup=10, steps=10, overrides=[], timeout_s=60)
    with pytest.raises(bench.BenchFailed) as failed:
        bench.run_workers(args, 2)
    assert str(failed.value) == f"exit 1: {cause}"


@pytest.mark.slow
@needs("mlflow")
def test_a_logger_that_cannot_start_ends_the_bench_in_one_line(tmp_path, not_mlflow):
    """As in train (test_metrics): rank 0's logger fails to start after the check passed; the
    bench says so in its one line, which carries rank 0's own."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            f"{PACKAGE}.bench",
            "--pairs",
            "1",
            "--warmup",
            "1",
            "--steps",
            "1",
            "logger=mlflow",
            f"logger.mlflow.tracking_uri={not_mlflow}",
            "dist.timeout_s=60",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith("bench failed: ") and "Traceback" not in done.stderr
    assert f"config error: logger.mlflow: could not start ({not_mlflow}): " in line
    assert list(tmp_path.iterdir()) == []  # no figures: nothing was measured


def test_the_first_step_of_two_fresh_processes_is_measured_cold_then_from_the_cache(tmp_path):
    """Where the model compiles (a GPU), the bench reports what a rescheduled pod waits for:
    the first step of a fresh process, cold, then from the cache the first one filled. On a CPU
    nothing compiles; the two launches still run the path the GPU takes."""
    args = argparse.Namespace(overrides=["trainer.compile=true"], timeout_s=240)
    first = bench.first_steps(args)
    assert list(first) == ["cold", "from_cache"]
    for step in first.values():
        assert step["compiled"] is None  # eager on a CPU
        assert 0 < step["seconds"] <= step["after_launch_s"]
    report = {**bench.figures(result(times([10.0], [8.0], [16.0], [10.0]))), **HEADER}
    table = bench.render({**report, "first_step": first})
    assert "the first step of a fresh process on 1 GPU (and from the process's start):" in table
    assert f"  from cache: {first['from_cache']['seconds']:.1f} s" in table
