import sqlite3

import pytest

from tunekit.errors import StoreError
from tunekit.store import Store


def _study(store):
    return store.create_study(
        key="k",
        workload="example:cnn",
        graph_hash="g",
        hw_fingerprint="h",
        nproc=2,
        settings={"steps": 4},
    )


def test_trials_are_written_as_they_finish(tmp_path):
    store = Store(tmp_path / "s.db")
    sid = _study(store)
    t0 = store.add_trial(sid, seq=0, role="baseline", plugin=None, config_id="base", config={})
    t1 = store.add_trial(
        sid,
        seq=1,
        role="candidate",
        plugin="p",
        config_id="c1",
        config={"plugins": {"p": {}}},
        predicted_s=0.1,
    )
    store.start_trial(t0)
    store.finish_trial(
        t0, status="ok", median_s=0.2, spread_s=0.01, samples_per_s=10, result={"measurement": None}
    )
    # A second connection (another process) sees the finished trial at once.
    other = Store(tmp_path / "s.db")
    rows = other.trials(sid)
    assert [(r.seq, r.status) for r in rows] == [(0, "ok"), (1, "pending")]
    assert rows[0].done and not rows[1].done and rows[1].predicted_s == 0.1
    store.start_trial(t1)
    assert store.reset_unfinished(sid) == 1
    assert store.trials(sid)[1].status == "pending"
    assert other.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_latest_unfinished_study_and_fields(tmp_path):
    store = Store(tmp_path / "s.db")
    a = _study(store)
    b = _study(store)
    store.set_study(b, status="finished", decision={"winner": "baseline"})
    assert store.latest_study("k", unfinished=True).id == a
    assert store.study(b).decision == {"winner": "baseline"}
    assert store.latest_study("other") is None
    with pytest.raises(StoreError, match="no study 99"):
        store.study(99)


def test_cache_roundtrip(tmp_path):
    store = Store(tmp_path / "s.db")
    assert store.cache_get("x") is None
    store.cache_put("x", {"a": [1, 2]})
    assert store.cache_get("x") == {"a": [1, 2]}


def test_corrupt_store_is_one_clear_error_and_left_untouched(tmp_path):
    path = tmp_path / "bad.db"
    junk = b"this is not a database" * 100
    path.write_bytes(junk)
    with pytest.raises(StoreError, match="unreadable or corrupt"):
        Store(path)
    assert path.read_bytes() == junk  # nothing the user had is lost


def test_store_from_a_newer_tunekit_is_refused(tmp_path):
    path = tmp_path / "new.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    with pytest.raises(StoreError, match="newer tunekit"):
        Store(path)
