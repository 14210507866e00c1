"""The orchestrator's feedback step on a real study store: scripted trial results re-rank what is left."""

from __future__ import annotations

import pytest

from tunekit.config import TuningConfig
from tunekit.events import Reranked
from tunekit.orchestrator import _feedback
from tunekit.store import Store


def cfg(plugin: str, value: int) -> TuningConfig:
    return TuningConfig({plugin: {"k": value}})


POOL = [  # (plugin, knob, predicted step); the baseline runs 100 ms per step on 64 samples
    ("a", 1, 0.070),
    ("a", 2, 0.075),
    ("b", 1, 0.080),
    ("b", 2, 0.085),
    ("c", 1, 0.090),
]


@pytest.fixture
def study(tmp_path):
    store = Store(tmp_path / "tunekit.db")
    sid = store.create_study(
        key="k", workload="w", graph_hash="g", hw_fingerprint="h", nproc=2, settings={}
    )
    pool = [
        {
            "plugin": p,
            "config": cfg(p, k).to_dict(),
            "config_id": cfg(p, k).config_id,
            "predicted_s": pred,
            "global_batch": None,
        }
        for p, k, pred in POOL
    ]
    store.set_study(sid, observation={"pool": pool, "summary": {"global_batch": 64}})
    schedule = [
        ("baseline", None, None),
        ("a", 1, 0.070),
        ("b", 1, 0.080),
        ("c", 1, 0.090),
        ("baseline", None, None),
        ("a", 2, 0.075),
        ("baseline", None, None),
    ]
    for seq, (p, k, pred) in enumerate(schedule):
        c = TuningConfig() if p == "baseline" else cfg(p, k)
        store.add_trial(
            sid,
            seq=seq,
            role="baseline" if p == "baseline" else "candidate",
            plugin=None if p == "baseline" else p,
            config_id=c.config_id,
            config=c.to_dict(),
            predicted_s=pred,
        )
    yield store, sid
    store.close()


def finish(store, sid, seq: int, median_s: float) -> None:
    row = next(t for t in store.trials(sid) if t.seq == seq)
    store.finish_trial(
        row.id,
        status="ok",
        median_s=median_s,
        spread_s=0.001,
        result={"measurement": {"step_s": [median_s] * 4}},
    )


def pending(store, sid) -> list[tuple[str, str]]:
    return [(t.role, t.plugin or "") for t in store.trials(sid) if not t.done]


def test_a_tuner_whose_first_trial_missed_loses_its_next_slot(study):
    store, sid = study
    finish(store, sid, 0, 0.100)  # baseline
    finish(store, sid, 1, 0.102)  # a1: predicted 70 ms, ran at the baseline's speed
    event = _feedback(store, sid, 0.01)
    assert isinstance(event, Reranked)
    assert event.corrections["a"]["trials"] == 1
    # a's second candidate (75 ms raw) is now predicted slower than the baseline: dropped;
    # b's second candidate takes its slot; the untried tuners keep their raw predictions.
    assert [d["plugin"] for d in event.dropped] == ["a"]
    assert [(u["plugin"], u["predicted_s"]) for u in event.upcoming] == [
        ("b", 0.080),
        ("c", 0.090),
        ("b", 0.085),
    ]
    assert pending(store, sid) == [
        ("candidate", "b"),
        ("candidate", "c"),
        ("baseline", ""),
        ("candidate", "b"),
        ("baseline", ""),
    ]
    rows = [t for t in store.trials(sid) if not t.done and t.role == "candidate"]
    assert rows[0].corrected_s == pytest.approx(0.080)  # b has no trials: raw
    assert store.study(sid).observation["corrections"]["a"]["bias"] > 0.3


def test_without_reranking_the_schedule_stays_and_corrections_are_recorded(study):
    store, sid = study
    finish(store, sid, 0, 0.100)
    finish(store, sid, 1, 0.102)
    assert _feedback(store, sid, 0.01, rerank=False) is None
    rows = {t.seq: t for t in store.trials(sid)}
    assert [rows[s].plugin for s in (2, 3, 5)] == ["b", "c", "a"]  # as planned
    assert rows[5].corrected_s > 0.095  # a's own miss corrected its second candidate
    assert rows[2].corrected_s == pytest.approx(0.080)


def test_a_study_whose_candidates_were_all_predicted_slower_says_so(study):
    from tunekit.orchestrator import AutoSettings, _qualify
    from tunekit.trials.decide import decide

    store, sid = study
    finish(store, sid, 0, 0.100)
    baseline_only = [t for t in store.trials(sid) if t.seq == 0]
    decision = decide(baseline_only, 0.01)
    assert decision["reason"] == "no tuner proposed a candidate for this job"
    dropped = [{"plugin": "a", "config": cfg("a", 1).to_dict(), "predicted_s": 10.0}]
    _qualify(decision, baseline_only, AutoSettings(workload="example:cnn"), {"dropped": dropped})
    assert decision["reason"] == (
        "all 1 planned candidate(s) were predicted slower than the baseline, "
        "so none was tried (--no-rerank tries them anyway)"
    )
