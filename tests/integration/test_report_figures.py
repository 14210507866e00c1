"""One measured truth: a report's step breakdown and every tuner's diagnosis quote the same figures."""

from __future__ import annotations

import re

import pytest

from tunekit.observe.truth import PART_LABELS

pytestmark = pytest.mark.slow


def quoted_shares(text: str) -> dict[str, list[int]]:
    """Every "<part> N%" (also "<part> ~N%", "<part> is N%") a sentence says about a step part."""
    found: dict[str, list[int]] = {}
    for part, label in PART_LABELS.items():
        for m in re.finditer(rf"{label}\s*(?:is|of|:)?\s*~?\s*(\d+(?:\.\d+)?)%", text):
            found.setdefault(part, []).append(round(float(m.group(1))))
    return found


def test_quoted_shares_finds_what_a_diagnosis_says():
    text = "exposed communication ~2% of the step; compute 61% · data loading 4%; idle is 13%"
    assert quoted_shares(text) == {"comm_exposed": [2], "compute": [61], "data": [4], "idle": [13]}


def test_every_diagnosis_agrees_with_the_measured_breakdown(demo_study):
    res = demo_study.result
    assert res.returncode == 0, res.stderr + res.stdout
    report = demo_study.report()
    truth = report["observation"]["truth"]
    assert truth and truth["parts_s"], "the baseline was profiled"
    assert sum(truth["parts_s"].values()) == pytest.approx(truth["step_s"], rel=1e-6)
    assert truth["step_s"] == pytest.approx(report["observation"]["baseline_median_s"])
    measured = {p: round(100 * f) for p, f in truth["fractions"].items()}
    diagnoses = report["diagnoses"]
    assert set(diagnoses) == {
        "batch_ps_sizing",
        "cgdp",
        "hybrid_mp",
        "layer_split",
        "overlap_chunking",
    }
    quoted_somewhere = set()
    for name, diag in diagnoses.items():
        for part, shares in quoted_shares(diag["summary"]).items():
            for share in shares:
                assert abs(share - measured[part]) <= 1, (
                    f"{name} says {PART_LABELS[part]} {share}% but the measured breakdown says "
                    f"{measured[part]}%: {diag['summary']}"
                )
            quoted_somewhere.add(part)
    # The communication tuners start from the measured exposed communication.
    assert "comm_exposed" in quoted_somewhere
    # The report's own breakdown table shows the same shares, at the measured step time.
    md = (demo_study.out / "report.md").read_text()
    for part, share in measured.items():
        assert f"| {PART_LABELS[part]} | " in md and f"| {share}% |" in md
    # The CLI's summary line says the same.
    assert f"{PART_LABELS['compute']} {measured['compute']}%" in res.stdout
