"""$TUNEKIT_MEASURE_EFFORT: how much measuring diagnoses do (tunekit.effort)."""

from __future__ import annotations

import pytest

from tunekit.cli.main import main
from tunekit.effort import EFFORT_ENV, effort_repeats, effort_seconds, measure_effort
from tunekit.errors import ConfigError


def test_full_effort_by_default(monkeypatch):
    monkeypatch.delenv(EFFORT_ENV, raising=False)
    assert measure_effort() == 1.0
    assert effort_repeats(9, 4) == 9 and effort_seconds(45.0) == 45.0


def test_a_quarter_times_a_quarter_of_the_repeats_but_never_fewer_than_needed(monkeypatch):
    monkeypatch.setenv(EFFORT_ENV, "0.25")
    assert effort_repeats(9, 2) == 3  # rounded up
    assert effort_repeats(9, 4) == 4  # the least a measurement needs
    assert effort_repeats(3, 5) == 3  # never more than usual
    assert effort_seconds(45.0) == pytest.approx(11.25)


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "quick", "nan"])
def test_a_bad_value_is_one_line_before_any_work(monkeypatch, capsys, value):
    monkeypatch.setenv(EFFORT_ENV, value)
    with pytest.raises(ConfigError, match="give a fraction of the usual measuring"):
        measure_effort()
    assert main(["plugins"]) == 2  # the CLI refuses it before the command runs
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{EFFORT_ENV}={value!r}" in err
