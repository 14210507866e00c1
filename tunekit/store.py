"""The study store: SQLite (WAL) in ``.tunekit/`` of the working directory.

One source for reports, resume and warm start. Studies are keyed by the
workload's graph hash, the hardware fingerprint and the settings that change
what a trial measures (ranks, steps); trials are written as they finish;
expensive measurements (layer profiles, probes) are cached by key.

Everything stored is JSON text; nothing is pickled. A cell that is not valid
JSON (a damaged store) is a StoreError naming it, never a traceback.

One runner per study: :meth:`Store.lock_study` takes a lock per study key
(``locks/study-<key>.lock`` beside the database, :mod:`tunekit.locks`) that the
kernel releases when its holder exits, however it exits; a second runner is
refused with the holder's pid. Readers that must not change anything
(``tunekit report``) open the store read-only.

One module, though past 600 lines: the schema, its migrations and every query
on it, so that a column's meaning is read in one place.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunekit.errors import StoreError, TunekitError
from tunekit.locks import FileLock, LockHeld, describe_holder, holder_if_held

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

TABLES = ("studies", "trials", "cache", "events")
LOCKS_DIR = "locks"
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


class Store:
    """A connection to one study store file.

    ``readonly``: nothing is created, migrated or written (``tunekit report``); a
    store that lacks a table is refused as damaged instead of repaired.
    """

    def __init__(self, path: str | Path, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        try:
            if readonly:
                if not self.path.is_file():
                    raise StoreError(f"no study store at {self.path}")
                uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=ro"
                self.conn = sqlite3.connect(
                    uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False
                )
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # Tuners run in worker threads (asyncio.to_thread) one at a time: access is serialised.
                self.conn = sqlite3.connect(
                    self.path, timeout=30, isolation_level=None, check_same_thread=False
                )
            self.conn.row_factory = sqlite3.Row
            if not readonly:
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA foreign_keys=ON")
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"study store {self.path} was written by a newer tunekit (schema {version}); upgrade tunekit"
                )
            if readonly:
                self._check_tables()
            else:
                self.conn.executescript(_SCHEMA)
                self._migrate(version)
                self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self.conn.execute("SELECT count(*) FROM studies").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"study store {self.path} is unreadable or corrupt ({exc}); move it aside"
            ) from None
        except OSError as exc:
            raise StoreError(f"cannot open study store {self.path}: {exc}") from None

    def _check_tables(self) -> None:
        found = {
            r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        missing = [t for t in TABLES if t not in found]
        if missing:
            raise StoreError(
                f"study store {self.path} is damaged (no table {missing[0]!r}); "
                "it was left untouched: move it aside"
            )

    def _loads(self, text: str | None, what: str) -> Any:
        """A JSON cell; a damaged one is a StoreError that names it."""
        if not text:
            return None
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise StoreError(
                f"study store {self.path} is damaged: {what} is not valid JSON ({exc}); "
                "move the store aside or delete that row"
            ) from None

    def _migrate(self, version: int) -> None:
        """Bring a store written by an older tunekit up to this schema (columns only added)."""
        columns = {r["name"] for r in self.conn.execute("PRAGMA table_info(trials)")}
        if "corrected_s" not in columns:  # schema 1 -> 2
            self.conn.execute("ALTER TABLE trials ADD COLUMN corrected_s REAL")

    @classmethod
    def open_default(cls, directory: str | Path | None = None) -> Store:
        return cls(Path(directory or DEFAULT_DIR) / DB_NAME)

    # -- one runner per study --------------------------------------------------------

    def _lock_path(self, key: str) -> Path:
        return self.path.parent / LOCKS_DIR / f"study-{key}.lock"

    def lock_study(self, key: str, workload: str) -> FileLock:
        """Hold the studies keyed ``key`` for this process, or raise StoreError naming who does.

        Two runners of one study would run the same pending trials at once, in the
        same trial folders, and each would time the other's load.
        """
        path = self._lock_path(key)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            return FileLock(path, "tunekit auto", workload=workload).acquire()
        except LockHeld as exc:
            study = f"study {exc.holder['study']}" if exc.holder.get("study") else "a study"
            raise StoreError(
                f"{study} of {workload} with these settings is being run by "
                f"{describe_holder(exc.holder)}; wait for it to finish, or stop it and "
                "continue with `tunekit auto --resume`"
            ) from None
        except OSError as exc:
            raise StoreError(
                f"cannot lock a study in {path.parent}: {exc.strerror or exc}"
            ) from None

    def other_runners(self, key: str) -> list[dict[str, Any]]:
        """Who runs other studies in this store right now (they share this machine)."""
        folder = self.path.parent / LOCKS_DIR
        found = []
        for path in sorted(folder.glob("study-*.lock")) if folder.is_dir() else []:
            if path != self._lock_path(key) and (holder := holder_if_held(path)) is not None:
                found.append(holder)
        return found

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
        self,
        *,
        key: str,
        workload: str,
        graph_hash: str,
        hw_fingerprint: str,
        nproc: int,
        settings: dict[str, Any],
    ) -> int:
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO studies (key, workload, graph_hash, hw_fingerprint, nproc, settings, status, created)"
                " VALUES (?, ?, ?, ?, ?, ?, 'running', ?)",
                (
                    key,
                    workload,
                    graph_hash,
                    hw_fingerprint,
                    nproc,
                    json.dumps(settings),
                    time.time(),
                ),
            )
            assert cur.lastrowid is not None  # always set after an INSERT
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

    def _study(self, r: sqlite3.Row) -> StudyRow:
        where = f"study {r['id']}'s"
        return StudyRow(
            id=r["id"],
            key=r["key"],
            workload=r["workload"],
            graph_hash=r["graph_hash"],
            hw_fingerprint=r["hw_fingerprint"],
            nproc=r["nproc"],
            settings=self._loads(r["settings"], f"{where} settings") or {},
            status=r["status"],
            created=r["created"],
            finished=r["finished"],
            observation=self._loads(r["observation"], f"{where} observation"),
            decision=self._loads(r["decision"], f"{where} decision"),
        )

    # -- trials --------------------------------------------------------------------

    def add_trial(
        self,
        study_id: int,
        *,
        seq: int,
        role: str,
        plugin: str | None,
        config_id: str,
        config: dict[str, Any],
        predicted_s: float | None = None,
        corrected_s: float | None = None,
    ) -> int:
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO trials (study_id, seq, role, plugin, config_id, config, predicted_s, corrected_s,"
                " status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending')",
                (
                    study_id,
                    seq,
                    role,
                    plugin,
                    config_id,
                    json.dumps(config),
                    predicted_s,
                    corrected_s,
                ),
            )
            assert cur.lastrowid is not None  # always set after an INSERT
            return int(cur.lastrowid)

    def add_trials(
        self,
        study_id: int,
        rows: list[dict[str, Any]],
        observation: dict[str, Any] | None = None,
        drop_pending: bool = False,
    ) -> None:
        """Add several trials (each: seq, role, plugin, config_id, config, predicted_s?, corrected_s?)
        and, with ``observation``, set the study's: all in one transaction. ``drop_pending``
        first removes the pending trials after the first baseline (a plan being replaced).

        A planned schedule is written whole or not at all: a study interrupted while
        writing it is planned again on resume, never resumed with part of a plan.
        """
        with self._tx() as c:
            if drop_pending:
                c.execute(
                    "DELETE FROM trials WHERE study_id=? AND seq>0 AND status='pending'",
                    (study_id,),
                )
            for row in rows:
                c.execute(
                    "INSERT INTO trials (study_id, seq, role, plugin, config_id, config, predicted_s, corrected_s,"
                    " status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending')",
                    (
                        study_id,
                        row["seq"],
                        row["role"],
                        row.get("plugin"),
                        row["config_id"],
                        json.dumps(row["config"]),
                        row.get("predicted_s"),
                        row.get("corrected_s"),
                    ),
                )
            if observation is not None:
                c.execute(
                    "UPDATE studies SET observation = ? WHERE id = ?",
                    (json.dumps(observation), study_id),
                )

    def replace_pending_candidates(self, study_id: int, rows: list[dict[str, Any]]) -> None:
        """Fill the study's pending candidate slots with ``rows``, in one transaction.

        The slots are the seq numbers of the pending ``candidate`` rows, in order;
        ``rows`` (each with plugin, config_id, config, predicted_s, corrected_s) take
        them in turn, and slots left over are dropped. Baselines, searches and
        everything already run keep their rows.
        """
        with self._tx() as c:
            slots = [
                r["seq"]
                for r in c.execute(
                    "SELECT seq FROM trials WHERE study_id=? AND role='candidate' AND status='pending' ORDER BY seq",
                    (study_id,),
                )
            ]
            c.execute(
                "DELETE FROM trials WHERE study_id=? AND role='candidate' AND status='pending'",
                (study_id,),
            )
            for seq, row in zip(slots, rows, strict=False):
                c.execute(
                    "INSERT INTO trials (study_id, seq, role, plugin, config_id, config, predicted_s, corrected_s,"
                    " status) VALUES (?, ?, 'candidate', ?, ?, ?, ?, ?, 'pending')",
                    (
                        study_id,
                        seq,
                        row["plugin"],
                        row["config_id"],
                        json.dumps(row["config"]),
                        row.get("predicted_s"),
                        row.get("corrected_s"),
                    ),
                )
            self._drop_repeated_baselines(c, study_id)

    @staticmethod
    def _drop_repeated_baselines(c: sqlite3.Connection, study_id: int) -> None:
        """A pending baseline right after another baseline (the candidates between them were
        dropped) measures nothing new next to it: drop it."""
        previous = None
        for r in c.execute(
            "SELECT id, role, status FROM trials WHERE study_id=? ORDER BY seq", (study_id,)
        ).fetchall():
            if r["role"] == "baseline" and r["status"] == "pending" and previous == "baseline":
                c.execute("DELETE FROM trials WHERE id=?", (r["id"],))
                continue
            previous = r["role"]

    def start_trial(self, trial_id: int) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE trials SET status='running', started=? WHERE id=?", (time.time(), trial_id)
            )

    def finish_trial(
        self,
        trial_id: int,
        *,
        status: str,
        median_s: float | None = None,
        spread_s: float | None = None,
        samples_per_s: float | None = None,
        result: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        if status not in FINISHED_STATUSES:
            raise ValueError(f"not a final trial status: {status}")
        with self._tx() as c:
            c.execute(
                "UPDATE trials SET status=?, median_s=?, spread_s=?, samples_per_s=?, result=?, error=?, finished=?"
                " WHERE id=?",
                (
                    status,
                    median_s,
                    spread_s,
                    samples_per_s,
                    json.dumps(result) if result is not None else None,
                    error,
                    time.time(),
                    trial_id,
                ),
            )

    def set_corrected(self, trial_id: int, corrected_s: float | None) -> None:
        """Record a pending trial's prediction as corrected by the trials so far."""
        with self._tx() as c:
            c.execute("UPDATE trials SET corrected_s=? WHERE id=?", (corrected_s, trial_id))

    def set_trial_config(self, trial_id: int, config_id: str, config: dict[str, Any]) -> None:
        """Replace a trial's config (an in-job search records the config it settled on)."""
        with self._tx() as c:
            c.execute(
                "UPDATE trials SET config=?, config_id=? WHERE id=?",
                (json.dumps(config), config_id, trial_id),
            )

    def reset_unfinished(self, study_id: int) -> int:
        """Trials left 'running' by an interrupted study go back to 'pending'."""
        with self._tx() as c:
            cur = c.execute(
                "UPDATE trials SET status='pending', started=NULL WHERE study_id=? AND status='running'",
                (study_id,),
            )
            return cur.rowcount

    def trials(self, study_id: int) -> list[TrialRow]:
        rows = self._query("SELECT * FROM trials WHERE study_id = ? ORDER BY seq", (study_id,))
        return [
            TrialRow(
                id=r["id"],
                study_id=r["study_id"],
                seq=r["seq"],
                role=r["role"],
                plugin=r["plugin"],
                config_id=r["config_id"],
                config=self._loads(r["config"], f"trial {r['id']}'s config") or {},
                predicted_s=r["predicted_s"],
                status=r["status"],
                median_s=r["median_s"],
                spread_s=r["spread_s"],
                samples_per_s=r["samples_per_s"],
                result=self._loads(r["result"], f"trial {r['id']}'s result"),
                error=r["error"],
                started=r["started"],
                finished=r["finished"],
                corrected_s=r["corrected_s"] if "corrected_s" in r.keys() else None,  # noqa: SIM118 (schema 1, read-only)
            )
            for r in rows
        ]

    # -- cache and events ------------------------------------------------------------

    def cache_get(self, key: str) -> Any:
        rows = self._query("SELECT value FROM cache WHERE key = ?", (key,))
        return self._loads(rows[0]["value"], f"cache entry {key!r}") if rows else None

    def cache_put(self, key: str, value: Any) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO cache (key, value, created) VALUES (?, ?, ?)",
                (key, json.dumps(value), time.time()),
            )

    def cache_items(self, prefix: str) -> dict[str, Any]:
        """Every cached entry whose key starts with ``prefix``, keyed by the rest of the key."""
        rows = self._query(
            "SELECT key, value FROM cache WHERE substr(key, 1, ?) = ?", (len(prefix), prefix)
        )
        return {r["key"][len(prefix) :]: json.loads(r["value"]) for r in rows}

    def log_event(self, study_id: int | None, kind: str, payload: dict[str, Any]) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT INTO events (study_id, ts, kind, payload) VALUES (?, ?, ?, ?)",
                (study_id, time.time(), kind, json.dumps(payload, default=str)),
            )

    def events(self, study_id: int) -> list[dict[str, Any]]:
        rows = self._query(
            "SELECT ts, kind, payload FROM events WHERE study_id = ? ORDER BY id", (study_id,)
        )
        return [
            {
                "ts": r["ts"],
                "kind": r["kind"],
                "payload": self._loads(r["payload"], f"a {r['kind']!r} event"),
            }
            for r in rows
        ]


def load_study(store: Store, study: str | int | None) -> StudyRow:
    """A study by id, or the latest one."""
    if study is None:
        row = store.latest_study()
        if row is None:
            raise TunekitError(f"no studies in {store.path}; run `tunekit auto` first")
        return row
    try:
        return store.study(int(study))
    except ValueError:
        raise TunekitError(f"study must be a number, not {study!r}") from None


class StudyCache:
    """``obs.cache`` for tuners: the store's cache under a prefix (graph hash + hardware)."""

    def __init__(self, store: Store, prefix: str):
        self.store, self.prefix = store, prefix

    def get(self, key: str) -> Any:
        return self.store.cache_get(f"{self.prefix}:{key}")

    def put(self, key: str, value: Any) -> None:
        self.store.cache_put(f"{self.prefix}:{key}", value)

    def items(self) -> dict[str, Any]:
        """Every entry under the prefix (what a tuner in the workload's process starts with)."""
        return self.store.cache_items(f"{self.prefix}:")
