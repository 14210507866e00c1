"""Sharded, checkpointed and memory-capped jobs through `tunekit auto` and `tunekit run`:
baselined as they are, their memory reported, a step over the cap an out-of-memory trial that
the study survives, bad layouts and caps refused in one line."""

from __future__ import annotations

import json

import pytest
from support import DATA

from tunekit.cli.main import main

SHARDED = DATA / "sharded_workloads.py"


def _one_line(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert any(needle in ln for ln in lines), err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", f"{SHARDED}:missing_block"], "checkpoint_blocks names blocks.9"),
        (["run", f"{SHARDED}:nothing_to_shard"], "sharding='fsdp' needs a model with parameters"),
        (
            ["run", f"{SHARDED}:tiny_sharded", "--memory-cap", "1KiB"],
            "--memory-cap 1.0 KiB is below this job's own parameters per rank",
        ),
        (["auto", "--memory-cap", "lots"], "is not a size like 2GiB"),
    ],
)
def test_bad_layouts_and_caps_are_one_line_before_any_rank_starts(workdir, capsys, args, needle):
    code = main(args)
    _one_line(code, capsys.readouterr().err, needle)
    assert not list((workdir / ".tunekit").glob("runs/*"))  # nothing was created


@pytest.mark.slow
@pytest.mark.busy_ok
def test_auto_refuses_a_layout_the_model_cannot_take(workdir, capsys):
    code = main(["auto", f"{SHARDED}:missing_block", "--no-probe"])
    _one_line(code, capsys.readouterr().err, "checkpoint_blocks names blocks.9")


@pytest.mark.slow
@pytest.mark.busy_ok
def test_auto_baselines_a_sharded_job_reports_its_memory_and_goes_on_after_a_capped_oom(
    cli, chaos_env, workdir
):
    plan = [{"mode": "hold_memory", "hold_mb": 64}]
    res = cli(
        *("auto", f"{SHARDED}:tiny_sharded", "--plugins", "chaos", "--trials", "1"),
        *("--steps", "3", "--warmup", "1", "--no-probe", "--no-rerank"),
        *("--memory-cap", "48MiB"),
        env_extra={**chaos_env, "TUNEKIT_CHAOS_PLAN": json.dumps(plan)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "memory per rank (fsdp (reshard after forward) + full checkpointing" in res.stdout
    report = json.loads((workdir / "tunekit-out" / "report.json").read_text())
    (held,) = [t for t in report["trials"] if t["role"] == "candidate"]
    assert held["status"] == "oom" and "over the memory cap" in (held.get("error") or "")
    assert report["decision"]["winner"] == "baseline"  # the study went on to its decision
    settings = report["study"]["settings"]  # `tunekit plan` tells it from a DDP study by them
    assert settings["layout"]["sharding"] == "fsdp" and settings["memory_cap_bytes"] == 48 * 2**20
    for rank in (0, 1):  # the baseline ran as the workload lays it out, never as DDP
        (found,) = (workdir / ".tunekit" / "trials").glob(f"study*/000-baseline/rank{rank}.json")
        result = json.loads(found.read_text())
        assert result["layout"]["sharding"] == "fsdp", result["layout"]
        assert result["layout"]["checkpointing"] == "full"
        assert result["peak_bytes"] > 0 and result["memory_method"] == "cpu-profiler"
    memory = report["observation"]["memory"]
    assert memory["measured_peak_bytes"] > 0 and memory["cap_bytes"] == 48 * 2**20
    parts = memory["predicted"]["parts"]
    assert parts["parameters"] > 0 and parts["optimizer"] > 0
    assert memory["predicted"]["peak_bytes"] == pytest.approx(memory["measured_peak_bytes"])


@pytest.mark.slow
@pytest.mark.busy_ok
def test_run_trains_a_sharded_job_checkpoints_its_shards_and_resumes(cli, workdir):
    res = cli("run", f"{SHARDED}:tiny_sharded", "--steps", "3", "--checkpoint-every", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (workdir / ".tunekit" / "runs").iterdir()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-00000002.dcp", "step-00000003.dcp"]
    status = json.loads((run / "status.json").read_text())
    assert status["layout"]["sharding"] == "fsdp" and status["memory"]["peak_bytes"] > 0
    assert "memory per rank (fsdp" in res.stdout
    spec = json.loads((run / "run.json").read_text())
    spec["steps"] = 5
    (run / "run.json").write_text(json.dumps(spec))
    res = cli("run", "--resume", run.name)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]


def test_the_report_line_names_the_layout_and_the_parts():
    from tunekit.cli.auto import memory_line

    line = memory_line(
        {
            "layout": "fsdp (reshard after forward)",
            "measured_peak_bytes": 3 * 2**20,
            "cap_bytes": 8 * 2**20,
            "predicted": {
                "peak_bytes": 3 * 2**20,
                "moment": "backward",
                "parts": {"parameters": 2**20, "activations": 2 * 2**20},
            },
        }
    )
    assert line == (
        "memory per rank (fsdp (reshard after forward)): 3.0 MiB measured peak of a 8.0 MiB "
        "cap; at the backward peak: activations and backward temporaries 2.0 MiB, "
        "parameters 1.0 MiB"
    )
    assert memory_line(None) == ""
