"""What the orchestrator makes of memory and searches in tuners' plans: a search starts from
the candidate its tuner marked (never over the cap), predicted peaks reach the report and
events, and winners whose measured peaks add up over the cap are not combined."""

from __future__ import annotations

from tunekit.config import TuningConfig
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.orchestrator import AutoSettings, _Planning, combined_over_cap
from tunekit.planning import TunerPlanned
from tunekit.store import TrialRow
from tunekit.trials.feedback import measured_peak, predicted_peaks

MiB = 2**20


class Searching(Tuner):
    name = "searching"
    title = "a tuner with an in-job search"
    aspect = Aspect.LAYOUT

    def knobs(self):
        return [Knob("k", "int", 0, "a knob", low=0, high=9)]

    def diagnose(self, obs):
        return Diagnosis(True, "applies")

    def plan(self, obs, limit):
        return []

    def apply(self, session, knobs):
        pass

    def search(self, session, knobs, max_steps):
        return SearchResult(dict(knobs))


def planned(*candidates: Candidate) -> TunerPlanned:
    tuner = Searching()
    configs = [TuningConfig({tuner.name: tuner.validate(c.knobs)}) for c in candidates]
    return TunerPlanned(tuner.name, Diagnosis(True, "applies", 0.1), list(candidates), configs)


def test_a_search_starts_from_the_candidate_its_tuner_marked():
    got = _Planning()
    start = Candidate({"k": 3}, 0.05, search=True, predicted_peak_bytes=30 * MiB)
    other = Candidate({"k": 4}, 0.06, predicted_peak_bytes=20 * MiB)
    got.keep(planned(start, other), Searching(), AutoSettings(memory_cap_bytes=40 * MiB))
    [search] = got.searches
    assert search.config.plugins == {"searching": {"k": 3}}
    assert search.predicted_s == 0.05 and search.search["plugin"] == "searching"
    assert [e["config"]["plugins"] for e in got.pool] == [{"searching": {"k": 4}}]


def test_without_a_marked_candidate_the_search_starts_from_the_defaults():
    got = _Planning()
    got.keep(planned(Candidate({"k": 4}, 0.06)), Searching(), AutoSettings())
    [search] = got.searches
    assert search.config.plugins == {"searching": {"k": 0}}
    assert len(got.pool) == 1


def test_a_search_start_predicted_over_the_cap_is_not_scheduled():
    got = _Planning()
    start = Candidate({"k": 3}, 0.05, search=True, predicted_peak_bytes=50 * MiB)
    got.keep(planned(start), Searching(), AutoSettings(memory_cap_bytes=40 * MiB))
    assert got.searches == [] and got.pool == []


def test_without_in_job_searches_a_marked_candidate_is_a_candidate():
    got = _Planning()
    start = Candidate({"k": 3}, 0.05, search=True)
    got.keep(planned(start), Searching(), AutoSettings(in_job_search=False))
    assert got.searches == [] and len(got.pool) == 1


def row(seq: int, config: TuningConfig, peak: float | None, status: str = "ok") -> TrialRow:
    ranks = [{"peak_bytes": peak}, {"peak_bytes": peak * 0.9 if peak else None}]
    return TrialRow(
        seq, 1, seq, "candidate", None, config.config_id, config.to_dict(), None, status,
        0.1, 0.0, 1.0, {"ranks": ranks}, None, None, None,
    )  # fmt: skip


def test_winners_whose_measured_rises_add_up_over_the_cap_are_not_combined():
    base, a, b = TuningConfig(), TuningConfig({"a": {"k": 1}}), TuningConfig({"b": {"k": 1}})
    trials = [row(0, base, 30 * MiB), row(1, a, 36 * MiB), row(2, b, 37 * MiB)]
    over = combined_over_cap(
        trials, [a.config_id, b.config_id], AutoSettings(memory_cap_bytes=40 * MiB)
    )
    assert "43 MiB" in over and "40 MiB" in over  # 30 + 6 + 7
    assert not combined_over_cap(
        trials, [a.config_id, b.config_id], AutoSettings(memory_cap_bytes=48 * MiB)
    )
    assert not combined_over_cap(trials, [a.config_id, b.config_id], AutoSettings())
    failed = [row(0, base, 30 * MiB), row(1, a, None, "oom"), row(2, b, 37 * MiB)]
    assert not combined_over_cap(  # nothing measured for one: nothing to add
        failed, [a.config_id, b.config_id], AutoSettings(memory_cap_bytes=40 * MiB)
    )


def test_predicted_and_measured_peaks_for_the_report():
    obs = {
        "pool": [{"config_id": "c1", "predicted_peak_bytes": 10.0}, {"config_id": "c2"}],
        "plans": {"sharding": [{"search": False}, {"search": True, "predicted_peak_bytes": 7.0}]},
    }
    assert predicted_peaks(obs) == {"c1": 10.0, "search:sharding": 7.0}
    assert measured_peak({"ranks": [{"peak_bytes": 5}, {"peak_bytes": 9}, {}]}) == 9.0
    assert measured_peak(None) is None
