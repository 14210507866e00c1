"""Headlines and bodies of diagnoses (tunekit.diagnosis_text)."""

from tunekit.contract import Diagnosis
from tunekit.diagnosis_text import HEADLINE_MAX, body_points, clip, headline_of


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
