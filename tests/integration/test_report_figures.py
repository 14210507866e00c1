"""One measured truth: a report's step breakdown and every tuner's diagnosis quote the same figures,
and each verdict agrees with what its trials measured, or says why not."""

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


def table_rows(md: str, header: str) -> dict[str, list[str]]:
    """A report.md table's rows by their first cell."""
    lines = md[md.index(header) :].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


GAIN = re.compile(r" · ([+−]?\d+)%")


def test_every_diagnosis_agrees_with_the_measured_breakdown_and_with_its_trials(demo_study):
    # The demo study (tests/integration/conftest.py): one search trial (the tuner of the largest
    # expected gain) and, if it leads, its confirmation: enough for a verdict to meet what its
    # trials measured; the third-party dataloader tuner installed beside the built-in ones.
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
        "dataloader",
        "hybrid_mp",
        "layer_split",
        "overlap_chunking",
        "sharding",
    }
    quoted_somewhere = set()
    for name, diag in diagnoses.items():
        for text in (diag["summary"], diag["headline"]):
            for part, shares in quoted_shares(text).items():
                for share in shares:
                    assert abs(share - measured[part]) <= 1, (
                        f"{name} says {PART_LABELS[part]} {share}% but the measured breakdown "
                        f"says {measured[part]}%: {text}"
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

    # Headlines: one line each, the verdict first, in the terminal (bodies only with -v), the
    # report's table and report.json; the third-party tuner, which writes none, gets one too.
    assert "no DataLoader to tune" in diagnoses["dataloader"]["summary"]
    assert diagnoses["dataloader"]["headline"].startswith("does not apply · batches come from")
    tuners = {t["plugin"]: t for t in report["tuners"]}
    rows = table_rows(md, "| tuner | diagnosis | measured | outcome |")
    for name, diag in diagnoses.items():
        head = diag["headline"]
        assert 0 < len(head) <= 100 and "\n" not in head, head
        verdict = head.split(" · ")[0]
        assert verdict in (
            ("applies", "too close to call") if diag["applies"] else ("does not apply",)
        )
        body = " ".join(diag["summary"].split())
        assert diag["points"] and all(p in body for p in diag["points"])
        assert f"  {name}: {head}" in res.stdout
        if len(diag["points"]) > 1:
            assert diag["points"][-1] not in res.stdout, "bodies are printed with -v only"
        assert rows[name][0] == head and rows[name][1] == tuners[name]["measured"]
        assert f"### {name}" in md and f"- {diag['points'][0]}" in md

        # Verdict and table never contradict: a tuner whose model expected nothing (does not
        # apply, a gain of 0% or less) that then won, or measured a gain beyond noise, says why
        # in its row and in the terminal.
        t = tuners[name]
        gain = GAIN.search(head)
        expected_nothing = verdict == "does not apply" or (
            gain is not None and int(gain.group(1).replace("−", "-")) <= 1
        )
        outcome = rows[name][2]
        if (t["won"] or t["significant"]) and expected_nothing:
            assert "but" in outcome and f"{t['speedup']:.2f}x" in outcome, (name, head, outcome)
            assert f"  {name}: {t['note']}" in res.stdout
        elif t["won"]:
            assert outcome == "won", (name, head, outcome)
        if t["speedup"] is None:
            assert rows[name][1] == "not tried"

    # Where the time went: every stage, in order, each tuner's diagnosis and each trial among them.
    stages = [s["stage"] for s in report["timings"]]
    assert stages[:2] == ["start: tunekit itself", "start: load the tuners"]
    assert "observe: build and trace the model" in stages
    assert {f"diagnose {name}" for name in diagnoses} <= set(stages)
    ran = [t for t in report["trials"] if t["status"] == "ok"]
    assert [f"trial {t['seq']} {t['role']}" for t in ran] == [
        s for s in stages if s.startswith("trial ")
    ]
    assert all(s["wall_s"] >= 0 and (s["cpu_s"] or 0) >= 0 for s in report["timings"])
