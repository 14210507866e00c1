"""What a plugin author meets (issue 33): failures located in the plugin, plans shown when the
diagnosis does not apply, the report's trials and problems, the memory facts, the modules behind
a layer profile's names, import timing, the scaffold and the docs."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from harness_tuners import AppliesNever, RaisesInDiagnose

from tunekit.planning import TunerFailed, TunerPlanned, diagnose_and_plan_here
from tunekit.store import Store
from tunekit.testing import (
    ConformanceError,
    check_conformance,
    synthetic_observation,
    synthetic_telemetry,
    tiny_gpt_workload,
)

ROOT = Path(__file__).resolve().parents[2]
PLUGINS_DOC = ROOT / "docs" / "plugins.md"

# -- a hook that raises: one line, where in the plugin, and the traceback ------------------------


def test_a_diagnose_that_raises_is_located_in_the_plugin_with_its_traceback():
    obs = synthetic_observation(nproc=1)
    (step,) = list(diagnose_and_plan_here({"raises_in_diagnose": RaisesInDiagnose()}, obs, 4))
    assert isinstance(step, TunerFailed) and step.hook == "diagnose"
    assert step.problem == "KeyError: 'used_mb'"
    assert re.fullmatch(r"harness_tuners\.py:\d+ in _used_mb", step.where)
    assert 'harness_tuners.py", line' in step.traceback and "in _used_mb" in step.traceback
    event = step.event()  # the console's one line says where; the event carries the traceback
    assert re.fullmatch(
        r"KeyError: 'used_mb' \(at harness_tuners\.py:\d+ in _used_mb\)", event.error
    )
    assert "\n" not in event.error and event.traceback == step.traceback


def test_the_harness_shows_where_a_diagnose_raised():
    with pytest.raises(ConformanceError) as err:
        check_conformance(RaisesInDiagnose(), synthetic_observation(nproc=1))
    message = str(err.value)
    assert re.search(
        r"diagnose raised KeyError: 'used_mb' at harness_tuners\.py:\d+ in _used_mb", message
    )
    assert "Traceback (most recent call last)" in message
    assert 'return memory["used_mb"]' in message


# -- plan --always-plan ------------------------------------------------------------------------


def test_plans_are_made_on_request_when_the_diagnosis_does_not_apply():
    obs = synthetic_observation(nproc=1)
    tuners = {"applies_never": AppliesNever()}
    (only,) = list(diagnose_and_plan_here(tuners, obs, 4))
    assert not only.diagnosis.applies and not isinstance(only, TunerPlanned)
    steps = list(diagnose_and_plan_here(tuners, obs, 4, plan_always=True))
    assert isinstance(steps[-1], TunerPlanned) and not steps[-1].diagnosis.applies
    assert [c.knobs for c in steps[-1].candidates] == [{"x": 1}]


# -- the report: trials per sample, with their reasons; problems with tracebacks ---------------


def _study(tmp_path: Path) -> tuple[Store, int]:
    """A study whose candidate trains twice the baseline's global batch in a longer step."""
    store = Store(tmp_path / "s.db")
    sid = store.create_study(
        key="k", workload="w", graph_hash="g", hw_fingerprint="h", nproc=2, settings={}
    )
    why = "batch 16/rank (32 global): +24% samples/s, predicted 4.1 s per step"
    store.set_study(
        sid,
        observation={
            "summary": {"global_batch": 16},
            "plans": {"batch_ps_sizing": [{"knobs": {"batch_size": 16}, "rationale": why}]},
            "pool": [
                {"plugin": "batch_ps_sizing", "config_id": "c1", "global_batch": 32},
            ],
            "problems": [
                {
                    "plugin": "act_ckpt",
                    "what": "diagnose failed",
                    "error": "KeyError: 'used_mb'",
                    "where": "tunekit_act_ckpt/plugin.py:42 in diagnose",
                    "traceback": 'Traceback (most recent call last):\n  File "plugin.py", line 42\n',
                }
            ],
        },
    )
    for seq, role, plugin, batch, median in [
        (0, "baseline", None, 16, 2.599),
        (1, "candidate", "batch_ps_sizing", 32, 4.182),
    ]:
        t = store.add_trial(sid, seq=seq, role=role, plugin=plugin, config_id=f"c{seq}", config={})
        store.finish_trial(
            t,
            status="ok",
            median_s=median,
            spread_s=0.01,
            samples_per_s=batch / median,
            result={"ranks": [{"global_batch": batch}, {"global_batch": batch}]},
        )
    return store, sid


def test_the_trials_table_compares_per_sample_and_says_why(tmp_path):
    from tunekit.report import report_data
    from tunekit.report.markdown import render_markdown
    from tunekit.trials.launcher import LaunchOptions

    store, sid = _study(tmp_path)
    data = report_data(store, sid, {}, LaunchOptions())
    rows = {r["seq"]: r for r in data["trials"]}
    assert (rows[0]["global_batch"], rows[1]["global_batch"]) == (16, 32)
    assert rows[1]["rationale"].startswith("batch 16/rank (32 global)")
    md = render_markdown(data)
    table = md[md.index("## Trials") :].splitlines()
    header = next(r for r in table if r.startswith("| # |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert {"global batch", "samples/s", "why"} <= set(cols)
    cells = {
        int(r.split("|")[1]): dict(
            zip(cols, (c.strip() for c in r.strip("|").split("|")), strict=True)
        )
        for r in table
        if re.match(r"\| \d+ \|", r)
    }
    # The longer step trains twice the samples: per sample it is the faster one.
    assert cells[0]["global batch"] == "16" and cells[0]["samples/s"] == "6.2"
    assert cells[1]["global batch"] == "32" and cells[1]["samples/s"] == "7.7"
    assert cells[1]["why"].startswith("batch 16/rank (32 global): +24% samples/s")


def test_the_report_lists_every_tuner_that_could_not_take_part(tmp_path):
    from tunekit.report import write_report

    store, sid = _study(tmp_path)
    paths = write_report(store, sid, tmp_path / "out", {})
    report = json.loads(paths["report_json"].read_text())
    assert [p["plugin"] for p in report["problems"]] == ["act_ckpt"]
    md = paths["report_md"].read_text()
    section = md[md.index("## Problems") : md.index("## Trials")]
    assert (
        "| act_ckpt | diagnose failed | KeyError: 'used_mb' | tunekit_act_ckpt/plugin.py:42 in diagnose |"
        in section
    )
    assert (
        '```text\nTraceback (most recent call last):\n  File "plugin.py", line 42\n```' in section
    )


# -- memory facts, documented and exported ------------------------------------------------------


def test_the_memory_facts_plugins_read_are_exported_documented_and_real():
    from tunekit.api import Device, Host, LayerTiming

    doc = PLUGINS_DOC.read_text()
    section = doc[doc.index("## Memory") :]
    section = section[: section.index("\n## ", 1)]
    for cls, field in [
        (Host, "memory_bytes"),
        (Device, "memory_bytes"),
        (LayerTiming, "activation_bytes"),
        (LayerTiming, "peak_bytes"),
        (LayerTiming, "memory_method"),
    ]:
        assert field in {f.name for f in dataclasses.fields(cls)}
        assert f"`{cls.__name__}.{field}`" in section, (cls.__name__, field)
    host = synthetic_telemetry(nproc=2)["host"]  # the real summariser's keys
    assert host["ranks"]["1"]["rss_max_bytes"] > 0 and host["system_mem_used_max_bytes"] > 0
    for key in ('host["ranks"][r]["rss_max_bytes"]', 'host["system_mem_used_max_bytes"]'):
        assert key in section, key
    assert 'nvml["rank_gpu_memory_max_bytes"]' in section
    assert "saved_tensors" in section and "cuda_memory" in section


# -- from a layer profile's names to the modules ----------------------------------------------


def test_layer_profile_names_lead_to_their_modules_and_blocks():
    from tunekit.api import layer_modules

    workload = tiny_gpt_workload()
    obs = synthetic_observation(workload, nproc=1, layer_profile=True)
    model = workload.model()
    found = layer_modules(obs.graph, model)
    assert set(obs.layer_profile.layers) <= set(found)  # every timing has its module
    qkv = found["blocks_0_attn_qkv"]
    assert (qkv.path, qkv.type, qkv.block) == ("blocks.0.attn.qkv", "Linear", "blocks.0")
    assert qkv.module is model.blocks[0].attn.qkv
    attention = found["softmax_1"]  # a function: no module, but the block it runs in
    assert (attention.path, attention.type, attention.block, attention.module) == (
        None,
        "",
        "blocks.1",
        None,
    )
    assert found["head"].block is None and found["head"].module is model.head


# -- import timing: the plugin, not the core ----------------------------------------------------

PROBE_PLUGIN = """
import sys

CORE_FIRST = "torch" in sys.modules and "tunekit.api" in sys.modules
from tunekit.contract import Aspect, Diagnosis, Knob, Tuner


class Probe(Tuner):
    name, title, aspect = "probe", "Probe (tests only)", Aspect.DATA

    def knobs(self):
        return [Knob("x", "int", 0, "x", low=0, high=1)]

    def diagnose(self, obs):
        return Diagnosis(False, "never")

    def plan(self, obs, limit):
        return []

    def apply(self, session, knobs):
        pass
"""


def test_a_plugins_import_is_timed_after_the_cores(tmp_path):
    (tmp_path / "probe_plugin.py").write_text(PROBE_PLUGIN)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from importlib.metadata import EntryPoint
        from tunekit.plugin_loading import load
        rec = load(EntryPoint("probe", "probe_plugin:Probe", "tunekit.plugins"))
        import probe_plugin
        print(rec.status, probe_plugin.CORE_FIRST)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    # A fresh process: torch came in with the core before the plugin's import was timed.
    assert res.stdout.split() == ["ok", "True"]


# -- the scaffold and the docs ------------------------------------------------------------------


def test_the_scaffold_shares_work_through_the_observation_and_imports_the_api(
    tmp_path, monkeypatch
):
    from tunekit.scaffold import scaffold

    scaffold("memo_demo", tmp_path / "pkg")
    test_text = (tmp_path / "pkg" / "tests" / "test_memo_demo.py").read_text()
    assert "from tunekit.api import Session" in test_text and "tunekit.runtime" not in test_text
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    from tunekit_memo_demo.plugin import MemoDemo  # generated just now

    tuner = MemoDemo()
    obs = synthetic_observation(nproc=1, breakdown={"compute": 0.6, "data": 0.3, "optimizer": 0.1})
    tuner.diagnose(obs)
    tuner.plan(obs, 4)
    assert vars(tuner) == {}  # no state on the instance: the live job reuses it
    assert "memo_demo:times" in obs._memo


def test_auto_help_and_the_readme_list_every_example():
    from click.testing import CliRunner

    from tunekit.cli.main import cli
    from tunekit.examples import EXAMPLES

    shown = CliRunner().invoke(cli, ["auto", "--help"], terminal_width=200).output
    readme = (ROOT / "README.md").read_text()
    for name in EXAMPLES:
        assert f"example:{name} " in shown, name
        assert f"`example:{name}`" in readme, name


def test_the_plugin_docs_cover_the_helpers_an_author_needs():
    doc = PLUGINS_DOC.read_text()
    for needle in (
        "tiny_gpt_workload()",
        'if __name__ == "__main__":',
        "changes_math",
        "equivalence_ranks",
        "layer_modules(",
        "--always-plan",
        "obs.memo(",
    ):
        assert needle in doc, needle


def test_loader_workers_build_batches_in_the_training_processs_dtype():
    # A spawned (or forkserver) worker starts from float32; the float64 equivalence runs on
    # spawned ranks, whose loader workers are spawned too.
    import multiprocessing

    from tunekit.api import LoaderOptions, Session
    from tunekit.testing import default_dtype, tiny_dataset_workload

    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    try:
        with default_dtype(torch.float64):
            session = Session(tiny_dataset_workload())
            try:
                session.data.set_options(LoaderOptions(num_workers=1))
                inputs, _ = session.data.batch(0)
            finally:
                session.close()
    finally:
        multiprocessing.set_start_method(before, force=True)
    assert inputs.dtype == torch.float64
