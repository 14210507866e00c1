"""Plugin authoring for real: scaffold, install, list, tune; the example plugin; API versions.

Packages are installed the way a user installs them, with this venv's pip,
into a throwaway ``--target`` folder that child processes get on PYTHONPATH
(the venv itself is never modified). Each is built from a copy, so the
source tree gets no ``build/`` or ``*.egg-info``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tunekit import API_VERSION
from tunekit.scaffold import scaffold
from tunekit.testing import check_conformance, synthetic_observation, tiny_hardware

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
WIDE = {"COLUMNS": "300"}  # rich tables: one row per line
# --min-effect 1: no leader to confirm (two more trials); these check the plugin, not decisions.
FAST = ["--steps", "4", "--warmup", "1", "--no-probe", "--min-effect", "1"]


def pip_install(package: Path, site: Path, work: Path) -> None:
    """``pip install --no-deps --no-build-isolation --target site`` from a copy of ``package``."""
    copy = work / "build-src" / package.name
    shutil.copytree(
        package, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(copy),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]


def on_path(*folders: Path) -> dict[str, str]:
    parts = [str(f) for f in folders] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return {"PYTHONPATH": os.pathsep.join(parts), **WIDE}


def plugin_rows(stdout: str) -> dict[str, str]:
    """``tunekit plugins`` table rows by plugin name."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 5:
            rows[cells[0]] = line
    return rows


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


# -- the scaffold, without installing (fast) --------------------------------------------------


def test_new_plugin_refuses_bad_names_and_used_folders_in_one_line(cli, workdir):
    for name, message in [
        ("2fast", "must be a lower-case Python identifier"),
        ("MyTuner", "must be a lower-case Python identifier"),
        ("class", "must be a lower-case Python identifier"),
        ("overlap_chunking", "'overlap_chunking' is a built-in tuner; choose another name"),
    ]:
        res = cli("new-plugin", name)
        assert res.returncode == 2, (name, res.stdout, res.stderr)
        assert message in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    (workdir / "taken").mkdir()
    (workdir / "taken" / "notes.txt").write_text("mine")
    res = cli("new-plugin", "fresh_name", "--dir", "taken")
    assert (
        res.returncode == 2 and "taken exists and is not empty; choose another --dir" in res.stderr
    )
    assert (workdir / "taken" / "notes.txt").read_text() == "mine"


def test_the_scaffolded_tuner_honours_the_contract_as_generated(tmp_path, monkeypatch):
    written = scaffold("prefetch_demo", tmp_path / "pkg")
    rel = sorted(str(p.relative_to(tmp_path / "pkg")) for p in written)
    assert rel == [
        "README.md",
        "pyproject.toml",
        "tests/test_prefetch_demo.py",
        "tunekit_prefetch_demo/__init__.py",
        "tunekit_prefetch_demo/model.py",
        "tunekit_prefetch_demo/plugin.py",
        "tunekit_prefetch_demo/runtime.py",
    ]
    pyproject = (tmp_path / "pkg" / "pyproject.toml").read_text()
    assert '[project.entry-points."tunekit.plugins"]' in pyproject
    assert 'prefetch_demo = "tunekit_prefetch_demo.plugin:PrefetchDemo"' in pyproject
    assert 'dependencies = ["tunekit>=' in pyproject
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    from tunekit_prefetch_demo.plugin import PrefetchDemo  # generated just now

    assert PrefetchDemo.api_version == API_VERSION[0]
    obs = synthetic_observation(
        nproc=1,
        hardware=tiny_hardware(1, cores=8),
        step_s=0.1,
        breakdown={"compute": 0.6, "data": 0.3, "optimizer": 0.1},
    )
    # One rank here (spawned ranks could not import a package on this test's path); the
    # installed package's own tests run the two-rank checks (the slow test below).
    report = check_conformance(PrefetchDemo(), obs, equivalence_ranks=(1,))
    assert report.diagnosis.applies and report.candidates
    # It writes its headline as the built-in tuners do: verdict · gain · the figure (issue 35).
    assert report.diagnosis.headline.startswith("applies · +")
    assert report.diagnosis.headline.endswith("getting the batch 30% of the step")
    assert [(c.knobs, c.outcome) for c in report.equivalence] == [
        ({"prefetch_batches": 1}, "same"),
        ({"prefetch_batches": 2}, "same"),
    ]


# -- installed for real (slow) ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.busy_ok
def test_a_scaffolded_plugin_installs_lists_and_runs_without_edits(cli, workdir):
    res = cli("new-plugin", "prefetch_demo", "--dir", "pkg")
    assert res.returncode == 0, res.stderr
    site = workdir / "site"
    pip_install(workdir / "pkg", site, workdir)
    env = on_path(site)

    listed = cli("plugins", "--knobs", env_extra=env)
    assert listed.returncode == 0, listed.stderr
    row = plugin_rows(listed.stdout)["prefetch_demo"]
    assert "tunekit-prefetch-demo 0.1.0" in row and "ok" in row
    assert "prefetch_batches" in listed.stdout

    # The generated tests pass against the installed package (real sessions, the harness),
    # run from outside the source folder so that the installed copy is the one imported.
    tests = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(workdir / "pkg" / "tests"),
        ],
        cwd=workdir,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]

    # Its diagnosis and plan in a study; no candidate trial (--trials 0): the runtime hook runs
    # inside real training workers in the live run below.
    tuned = cli(
        "auto", "example:cnn", "--plugins", "prefetch_demo", "--trials", "0", *FAST, env_extra=env
    )
    assert tuned.returncode == 0, tuned.stderr + tuned.stdout
    assert "prefetch_demo:" in tuned.stdout  # its diagnosis, whatever this machine's cores allow
    report = json.loads((workdir / "tunekit-out" / "report.json").read_text())
    assert report["study"]["status"] == "finished"

    # Its runtime hook inside real training workers: a live run started with the knob on.
    config = json.dumps({"plugins": {"prefetch_demo": {"prefetch_batches": 2}}})
    run = cli(
        "run", "example:cnn", "--nproc", "1", "--steps", "4", "--config", config, env_extra=env
    )
    assert run.returncode == 0, run.stderr + run.stdout
    status = json.loads(next((workdir / ".tunekit" / "runs").glob("*/status.json")).read_text())
    assert status["status"] == "finished" and status["step"] == 4
    assert status["config"]["plugins"] == {"prefetch_demo": {"prefetch_batches": 2}}


@pytest.mark.slow
@pytest.mark.busy_ok
def test_the_example_dataloader_plugin_tunes_the_slow_loader_end_to_end(cli, workdir):
    examples = workdir / "examples"  # a copy: the example's tests find the workload beside it
    shutil.copytree(
        EXAMPLES, examples, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    site = workdir / "site"
    pip_install(examples / "tunekit-dataloader", site, workdir)
    env = on_path(site)

    row = plugin_rows(cli("plugins", env_extra=env).stdout)["dataloader"]
    assert "tunekit-dataloader 0.1.0" in row and "ok" in row

    tests = subprocess.run(  # from outside the source folder: the installed package is imported
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(examples / "tunekit-dataloader" / "tests"),
        ],
        cwd=workdir,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]

    workload = f"{examples / 'workloads' / 'slow_loader.py'}:workload"
    # One compute thread: beside other tests, a rank's threads wait on each other
    # and training slows many times more than the single-threaded loading (CI saw
    # data at 4% of a 330 ms step); one thread keeps the shares of an idle machine.
    env = {**env, "OMP_NUM_THREADS": "1"}
    res = cli(
        "auto",
        workload,
        "--nproc",
        "1",
        "--plugins",
        "dataloader",
        "--json",
        "--trials",
        "1",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--no-probe",
        "--min-effect",
        "1",
        env_extra=env,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    evs = events(res.stdout)
    (diagnosis,) = [e for e in evs if e["event"] == "Diagnosed" and e["plugin"] == "dataloader"]
    # The baseline was profiled: the evidence is its step breakdown (py-spy adds to it where allowed).
    assert "data loading is" in diagnosis["summary"] and "step breakdown" in diagnosis["summary"]
    assert diagnosis["applies"], diagnosis["summary"]
    candidates = [e for e in evs if e["event"] == "TrialFinished" and e["plugin"] == "dataloader"]
    assert candidates and all(e["status"] == "ok" for e in candidates), candidates
    assert "num_workers=" in candidates[0]["description"]
    report = json.loads((workdir / "tunekit-out" / "report.json").read_text())
    assert report["study"]["status"] == "finished"
    # It writes no headline: the core derives one, a line beside the verdict (issue 35).
    head = diagnosis["headline"]
    assert head.startswith("applies · +") and "data loading is" in head and len(head) <= 100
    assert report["diagnoses"]["dataloader"]["headline"] == head
    assert f"| dataloader | {head} |" in (workdir / "tunekit-out" / "report.md").read_text()


FUTURE_PLUGIN = f"""
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner


class Future(Tuner):
    name, title, aspect = "future", "Built for the next API", Aspect.DATA
    api_version = {API_VERSION[0] + 1}

    def knobs(self):
        return [Knob("x", "int", 0, "x", low=0, high=1)]

    def diagnose(self, obs):
        return Diagnosis(False, "never")

    def plan(self, obs, limit):
        return []

    def apply(self, session, knobs):
        pass
"""


@pytest.mark.slow
@pytest.mark.busy_ok
def test_a_plugin_for_another_api_major_is_refused_and_the_others_still_load(cli, workdir):
    site = workdir / "site"  # installed as pip would leave it: a module and its dist-info
    site.mkdir()
    (site / "tunekit_future.py").write_text(FUTURE_PLUGIN)
    info = site / "tunekit_future-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tunekit-future\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[tunekit.plugins]\nfuture = tunekit_future:Future\n")
    env = on_path(site)

    listed = cli("plugins", env_extra=env)
    assert listed.returncode == 0, listed.stderr
    rows = plugin_rows(listed.stdout)
    major = API_VERSION[0]
    assert (
        f"incompatible: written for tuner API {major + 1}, this tunekit speaks {major}; "
        f"install a tunekit with API {major + 1} or update the plugin"
    ) in rows["future"]
    assert "tunekit-future 0.3" in rows["future"]
    for name in ("batch_ps_sizing", "cgdp", "hybrid_mp", "layer_split", "overlap_chunking"):
        assert rows[name].rstrip(" │").endswith("ok"), rows[name]

    refused = cli(
        "auto", "example:cnn", "--plugins", "future", "--trials", "1", *FAST, env_extra=env
    )
    assert refused.returncode == 2
    assert (
        "plugin 'future' from tunekit-future 0.3 is incompatible: written for tuner API"
        in refused.stderr
    )
    assert "Traceback" not in refused.stderr
