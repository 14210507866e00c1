"""The study store: SQLite (WAL) in ``.tunekit/`` of the working directory.

One source for reports, resume and warm start. Studies are keyed by the
workload's graph hash, the hardware fingerprint and the settings that change
what a trial measures (ranks, steps); trials are written as they finish;
expensive measurements (layer profiles, probes) are cached by key.

Everything stored is JSON text; nothing is pickled.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunekit.errors import StoreError

DEFAULT_DIR = ".tunekit"
DB_NAME = "tunekit.db"
SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    workload TEXT NOT NULL,
    graph_hash TEXT NOT NULL,
    hw_fingerprint TEXT NOT NULL,
    nproc INTEGER NOT NULL,
    settings TEXT NOT NULL,
    status TEXT NOT NULL,          -- running | finished | interrupted
    created REAL NOT NULL,
    finished REAL,
    observation TEXT,              -- JSON summary of what was observed
    decision TEXT                  -- JSON: the winner and its comparison
);
CREATE INDEX IF NOT EXISTS studies_key ON studies(key);
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY,
    study_id INTEGER NOT NULL REFERENCES studies(id),
    seq INTEGER NOT NULL,          -- position in the study's schedule
    role TEXT NOT NULL,            -- baseline | candidate | combined | search
    plugin TEXT,
    config_id TEXT NOT NULL,
    config TEXT NOT NULL,
    predicted_s REAL,              -- the tuner's own prediction (seconds per step)
    corrected_s REAL,              -- that prediction corrected by the trials before this one ran
    status TEXT NOT NULL,          -- pending | running | ok | crash | oom | hang | too_slow | skipped
    median_s REAL,
    spread_s REAL,
    samples_per_s REAL,
    result TEXT,                   -- JSON: measurement, per-rank summaries, metrics
    error TEXT,
    started REAL,
    finished REAL,
    UNIQUE (study_id, seq)
);
CREATE TABLE IF NOT EXISTS cache (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    study_id INTEGER,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL
);
"""

FAILED_STATUSES = ("crash", "oom", "hang", "too_slow")
"""A trial ran and measured nothing: it crashed, ran out of memory, stopped
finishing steps (hang) or outlived the trial timeout while its steps kept
finishing (too_slow)."""
FINISHED_STATUSES = ("ok", *FAILED_STATUSES, "skipped")
"""Final: ``--resume`` never runs these again (``skipped``: not run, with the reason)."""


@dataclass
class StudyRow:
    id: int
    key: str
    workload: str
    graph_hash: str
    hw_fingerprint: str
    nproc: int
    settings: dict[str, Any]
    status: str
    created: float
    finished: float | None
    observation: dict[str, Any] | None
    decision: dict[str, Any] | None


@dataclass
class TrialRow:
    id: int
    study_id: int
    seq: int
    role: str
    plugin: str | None
    config_id: str
    config: dict[str, Any]
    predicted_s: float | None
    status: str
    median_s: float | None
    spread_s: float | None
    samples_per_s: float | None
    result: dict[str, Any] | None
    error: str | None
    started: float | None
    finished: float | None
    corrected_s: float | None = None
    """``predicted_s`` corrected by the trials that finished before this one ran."""

    @property
    def done(self) -> bool:
        return self.status in FINISHED_STATUSES


def _loads(text: str | None) -> Any:
    return json.loads(text) if text else None


class Store:
    """A connection to one study store file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Tuners run in worker threads (asyncio.to_thread) one at a time: access is serialised.
            self.conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"study store {self.path} was written by a newer tunekit (schema {version}); upgrade tunekit"
                )
            self.conn.executescript(_SCHEMA)
            self._migrate(version)
            self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self.conn.execute("SELECT count(*) FROM studies").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"study store {self.path} is unreadable or corrupt ({exc}); move it aside") from None
        except OSError as exc:
            raise StoreError(f"cannot open study store {self.path}: {exc}") from None

    def _migrate(self, version: int) -> None:
        """Bring a store written by an older tunekit up to this schema (columns only added)."""
        columns = {r["name"] for r in self.conn.execute("PRAGMA table_info(trials)")}
        if "corrected_s" not in columns:  # schema 1 -> 2
            self.conn.execute("ALTER TABLE trials ADD COLUMN corrected_s REAL")

    @classmethod
    def open_default(cls, directory: str | Path | None = None) -> Store:
        return cls(Path(directory or DEFAULT_DIR) / DB_NAME)

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"study store {self.path}: {exc}") from None

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        try:
            return self.conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"study store {self.path}: {exc}") from None

    # -- studies -------------------------------------------------------------------

    def create_study(
        self, *, key: str, workload: str, graph_hash: str, hw_fingerprint: str, nproc: int, settings: dict[str, Any]
    ) -> int:
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO studies (key, workload, graph_hash, hw_fingerprint, nproc, settings, status, created)"
                " VALUES (?, ?, ?, ?, ?, ?, 'running', ?)",
                (key, workload, graph_hash, hw_fingerprint, nproc, json.dumps(settings), time.time()),
            )
            return int(cur.lastrowid)

    def study(self, study_id: int) -> StudyRow:
        rows = self._query("SELECT * FROM studies WHERE id = ?", (study_id,))
        if not rows:
            raise StoreError(f"no study {study_id} in {self.path}")
        return self._study(rows[0])

    def studies(self) -> list[StudyRow]:
        return [self._study(r) for r in self._query("SELECT * FROM studies ORDER BY id")]

    def latest_study(self, key: str | None = None, unfinished: bool = False) -> StudyRow | None:
        sql, args = "SELECT * FROM studies", []
        where = []
        if key is not None:
            where.append("key = ?")
            args.append(key)
        if unfinished:
            where.append("status != 'finished'")
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._query(sql + " ORDER BY id DESC LIMIT 1", tuple(args))
        return self._study(rows[0]) if rows else None

    def set_study(self, study_id: int, **fields: Any) -> None:
        cols = []
        vals: list[Any] = []
        for k, v in fields.items():
            if k not in ("status", "finished", "observation", "decision"):
                raise ValueError(f"cannot set study field {k}")
            cols.append(f"{k} = ?")
            vals.append(json.dumps(v) if k in ("observation", "decision") else v)
        with self._tx() as c:
            c.execute(f"UPDATE studies SET {', '.join(cols)} WHERE id = ?", (*vals, study_id))

    @staticmethod
    def _study(r: sqlite3.Row) -> StudyRow:
        return StudyRow(
            id=r["id"], key=r["key"], workload=r["workload"], graph_hash=r["graph_hash"],
            hw_fingerprint=r["hw_fingerprint"], nproc=r["nproc"], settings=json.loads(r["settings"]),
            status=r["status"], created=r["created"], finished=r["finished"],
            observation=_loads(r["observation"]), decision=_loads(r["decision"]),
        )

    # -- trials --------------------------------------------------------------------

    def add_trial(
        self, study_id: int, *, seq: int, role: str, plugin: str | None, config_id: str,
        config: dict[str, Any], predicted_s: float | None = None, corrected_s: float | None = None,
    ) -> int:
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO trials (study_id, seq, role, plugin, config_id, config, predicted_s, corrected_s,"
                " status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending')",
                (study_id, seq, role, plugin, config_id, json.dumps(config), predicted_s, corrected_s),
            )
            return int(cur.lastrowid)

    def replace_pending_candidates(self, study_id: int, rows: list[dict[str, Any]]) -> None:
        """Fill the study's pending candidate slots with ``rows``, in one transaction.

        The slots are the seq numbers of the pending ``candidate`` rows, in order;
        ``rows`` (each with plugin, config_id, config, predicted_s, corrected_s) take
        them in turn, and slots left over are dropped. Baselines, searches and
        everything already run keep their rows.
        """
        with self._tx() as c:
            slots = [r["seq"] for r in c.execute(
                "SELECT seq FROM trials WHERE study_id=? AND role='candidate' AND status='pending' ORDER BY seq",
                (study_id,))]
            c.execute("DELETE FROM trials WHERE study_id=? AND role='candidate' AND status='pending'", (study_id,))
            for seq, row in zip(slots, rows, strict=False):
                c.execute(
                    "INSERT INTO trials (study_id, seq, role, plugin, config_id, config, predicted_s, corrected_s,"
                    " status) VALUES (?, ?, 'candidate', ?, ?, ?, ?, ?, 'pending')",
                    (study_id, seq, row["plugin"], row["config_id"], json.dumps(row["config"]),
                     row.get("predicted_s"), row.get("corrected_s")),
                )
            self._drop_repeated_baselines(c, study_id)

    @staticmethod
    def _drop_repeated_baselines(c: sqlite3.Connection, study_id: int) -> None:
        """A pending baseline right after another baseline (the candidates between them were
        dropped) measures nothing new next to it: drop it."""
        previous = None
        for r in c.execute("SELECT id, role, status FROM trials WHERE study_id=? ORDER BY seq", (study_id,)).fetchall():
            if r["role"] == "baseline" and r["status"] == "pending" and previous == "baseline":
                c.execute("DELETE FROM trials WHERE id=?", (r["id"],))
                continue
            previous = r["role"]

    def start_trial(self, trial_id: int) -> None:
        with self._tx() as c:
            c.execute("UPDATE trials SET status='running', started=? WHERE id=?", (time.time(), trial_id))

    def finish_trial(
        self, trial_id: int, *, status: str, median_s: float | None = None, spread_s: float | None = None,
        samples_per_s: float | None = None, result: dict[str, Any] | None = None, error: str | None = None,
    ) -> None:
        if status not in FINISHED_STATUSES:
            raise ValueError(f"not a final trial status: {status}")
        with self._tx() as c:
            c.execute(
                "UPDATE trials SET status=?, median_s=?, spread_s=?, samples_per_s=?, result=?, error=?, finished=?"
                " WHERE id=?",
                (status, median_s, spread_s, samples_per_s, json.dumps(result) if result is not None else None,
                 error, time.time(), trial_id),
            )

    def set_corrected(self, trial_id: int, corrected_s: float | None) -> None:
        """Record a pending trial's prediction as corrected by the trials so far."""
        with self._tx() as c:
            c.execute("UPDATE trials SET corrected_s=? WHERE id=?", (corrected_s, trial_id))

    def set_trial_config(self, trial_id: int, config_id: str, config: dict[str, Any]) -> None:
        """Replace a trial's config (an in-job search records the config it settled on)."""
        with self._tx() as c:
            c.execute("UPDATE trials SET config=?, config_id=? WHERE id=?", (json.dumps(config), config_id, trial_id))

    def reset_unfinished(self, study_id: int) -> int:
        """Trials left 'running' by an interrupted study go back to 'pending'."""
        with self._tx() as c:
            cur = c.execute(
                "UPDATE trials SET status='pending', started=NULL WHERE study_id=? AND status='running'", (study_id,)
            )
            return cur.rowcount

    def trials(self, study_id: int) -> list[TrialRow]:
        rows = self._query("SELECT * FROM trials WHERE study_id = ? ORDER BY seq", (study_id,))
        return [
            TrialRow(
                id=r["id"], study_id=r["study_id"], seq=r["seq"], role=r["role"], plugin=r["plugin"],
                config_id=r["config_id"], config=json.loads(r["config"]), predicted_s=r["predicted_s"],
                status=r["status"], median_s=r["median_s"], spread_s=r["spread_s"],
                samples_per_s=r["samples_per_s"], result=_loads(r["result"]), error=r["error"],
                started=r["started"], finished=r["finished"], corrected_s=r["corrected_s"],
            )
            for r in rows
        ]

    # -- cache and events ------------------------------------------------------------

    def cache_get(self, key: str) -> Any:
        rows = self._query("SELECT value FROM cache WHERE key = ?", (key,))
        return json.loads(rows[0]["value"]) if rows else None

    def cache_put(self, key: str, value: Any) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO cache (key, value, created) VALUES (?, ?, ?)",
                (key, json.dumps(value), time.time()),
            )

    def log_event(self, study_id: int | None, kind: str, payload: dict[str, Any]) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT INTO events (study_id, ts, kind, payload) VALUES (?, ?, ?, ?)",
                (study_id, time.time(), kind, json.dumps(payload, default=str)),
            )

    def events(self, study_id: int) -> list[dict[str, Any]]:
        rows = self._query("SELECT ts, kind, payload FROM events WHERE study_id = ? ORDER BY id", (study_id,))
        return [{"ts": r["ts"], "kind": r["kind"], "payload": json.loads(r["payload"])} for r in rows]


class StudyCache:
    """``obs.cache`` for tuners: the store's cache under a prefix (graph hash + hardware)."""

    def __init__(self, store: Store, prefix: str):
        self.store, self.prefix = store, prefix

    def get(self, key: str) -> Any:
        return self.store.cache_get(f"{self.prefix}:{key}")

    def put(self, key: str, value: Any) -> None:
        self.store.cache_put(f"{self.prefix}:{key}", value)
