"""Headlines and bodies of diagnoses (tunekit.diagnosis_text)."""

from tunekit.contract import Diagnosis
from tunekit.diagnosis_text import (
    HEADLINE_MAX,
    body_points,
    clip,
    compose_headline,
    headline_of,
    outcomes,
)


def test_a_tuners_own_headline_is_kept_and_clipped_to_one_line():
    d = Diagnosis(True, "long body", 0.1, headline="applies ·  +10% \n· exposed comm 12%")
    assert headline_of(d) == "applies · +10% · exposed comm 12%"
    long = Diagnosis(True, "body", headline="word " * 60)
    assert len(headline_of(long)) <= HEADLINE_MAX
    assert headline_of(long).endswith("…")


def test_a_headline_is_derived_from_verdict_gain_and_first_point_when_the_tuner_gives_none():
    d = Diagnosis(
        True,
        "exposed communication 12% of the step (4.8 ms, measured; chunked); "
        "overlap should recover ~25%",
        0.034,
    )
    assert headline_of(d) == (
        "applies · +3% · exposed communication 12% of the step (4.8 ms, measured; chunked)"
    )
    assert headline_of(Diagnosis(False, "no gradients to overlap", 0.2)) == (
        "does not apply · no gradients to overlap"
    )


def test_the_body_splits_at_semicolons_and_sentences_but_not_inside_parentheses():
    text = "measured A (x; y). Model: B; why C"
    assert body_points(text) == ["measured A (x; y).", "Model: B", "why C"]
    assert body_points("") == []


def test_clip_cuts_at_a_word_boundary():
    assert clip("short", 10) == "short"
    out = clip("alpha beta gamma delta epsilon", 16)
    assert len(out) <= 16 and out.endswith("…") and out.startswith("alpha beta")


def test_a_composed_headline_has_verdict_gain_with_its_range_and_the_figure():
    text = compose_headline(True, 0.034, (-0.012, 0.061), "exposed communication 12% of the step")
    assert text == "applies · +3% (−1…+6%) · exposed communication 12% of the step"
    assert compose_headline("too close to call", -0.004, (0.16, -0.16), "x") == (
        "too close to call · 0% (−16…+16%) · x"
    )
    assert compose_headline(False, figure="the workload fixes its batch") == (
        "does not apply · the workload fixes its batch"
    )
    # A long figure is cut, never the verdict or the gain.
    long = compose_headline(True, 0.2, (0.1, 0.3), "figure " * 40)
    assert len(long) <= HEADLINE_MAX and long.startswith("applies · +20% (+10…+30%) · figure")


def test_a_derived_headline_drops_the_first_points_asides_before_cutting_it():
    # examples/tunekit-dataloader supplies no headline: its evidence has a long aside.
    d = Diagnosis(
        True,
        "data loading is 31% of the step (24.9 of 80.2 ms, step breakdown of the profiled baseline; "
        "py-spy: decode in the loader, a slow collate); 2 loader worker(s) per rank should save ~27%",
        0.27,
    )
    assert headline_of(d) == "applies · +27% · data loading is 31% of the step"


def decision_with(rows, winner_trial=None, winner_plugins=()):
    winner = next((r for r in rows if r["trial_id"] == winner_trial), None)
    return {
        "winner": winner["description"] if winner else "baseline",
        "winner_trial": winner_trial,
        "winner_config": {"plugins": {p: {} for p in winner_plugins}},
        "min_effect": 0.01,
        "candidates": rows,
    }


def row(trial_id, plugin, role, description, speedup, significant, runs=1, plugins=None):
    return {
        "trial_id": trial_id,
        "plugin": plugin,
        "role": role,
        "description": description,
        "runs": runs,
        "config": {"plugins": {p: {} for p in (plugins or [plugin])}},
        "comparison": {"speedup": speedup, "significant": significant},
    }


DIAGNOSES = {
    "batch_ps_sizing": {"applies": False, "summary": "no batch is predicted to beat 32", "expected_gain": 0.0},
    "cgdp": {"applies": True, "summary": "too close to call", "expected_gain": 0.0,
             "headline": "too close to call · 0% (−12…+11%) · exposed communication 19% of the step"},
    "overlap_chunking": {"applies": True, "summary": "two chunks should recover 8%", "expected_gain": 0.08},
    "hybrid_mp": {"applies": False, "summary": "a chain", "expected_gain": None},
}  # fmt: skip


def test_a_verdict_that_the_trials_contradict_says_why_beside_them():
    rows = [
        row(2, "batch_ps_sizing", "search", "batch_ps_sizing(batch_size=128)", 1.36, True, 2),
        row(5, "batch_ps_sizing", "candidate", "batch_ps_sizing(batch_size=64)", 1.2, True),
        row(3, "cgdp", "search", "cgdp(chunk_size=5)", 1.03, True),
        row(4, "overlap_chunking", "candidate", "overlap_chunking(k=7)", 0.98, False),
    ]
    got = {o.plugin: o for o in outcomes(DIAGNOSES, decision_with(rows, 2, ["batch_ps_sizing"]))}
    batch = got["batch_ps_sizing"]
    assert batch.won and batch.measured() == "1.36x (2 runs; 2 configs tried)"
    assert batch.note == (
        "won: its model said it does not apply, but its in-job search found "
        "batch_ps_sizing(batch_size=128), which measured 1.36x"
    )
    # "gain 0%" beside a significant 1.03x: the note says the trial found it.
    assert got["cgdp"].headline.startswith("too close to call · 0%")
    assert "its trial measured 1.03x (cgdp(chunk_size=5)); another config won" in got["cgdp"].note
    assert got["overlap_chunking"].note == (
        "its model expected +8%; its trials measured 0.98x, no gain beyond noise"
    )
    assert got["hybrid_mp"].measured() == "not tried" and got["hybrid_mp"].note == ""
    assert got["hybrid_mp"].headline == "does not apply · a chain"


def test_a_winner_its_model_expected_needs_no_note_and_a_combination_is_named():
    rows = [
        row(4, "overlap_chunking", "candidate", "overlap_chunking(k=7)", 1.10, True, 2),
        row(9, "batch_ps_sizing+overlap_chunking", "combined", "batch 64 + k=8", 1.31, True, 2,
            plugins=["batch_ps_sizing", "overlap_chunking"]),
    ]  # fmt: skip
    decision = decision_with(rows, 9, ["batch_ps_sizing", "overlap_chunking"])
    got = {o.plugin: o for o in outcomes(DIAGNOSES, decision)}
    assert got["overlap_chunking"].won and got["overlap_chunking"].note == ""
    assert got["batch_ps_sizing"].note == (
        "won: its model said it does not apply, but combined with overlap_chunking "
        "(batch 64 + k=8), it measured 1.31x"
    )
