"""Files and batch jobs kept across restarts: metadata in SQLite, file bodies under data_dir/files.

Each answered batch line is one row of ``batch_results`` keyed by (batch_id, line_no), written
in one transaction with INSERT OR IGNORE, so a line is answered at most once whatever happens
to the process; a restarted worker runs exactly the lines that have no row yet.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, total INTEGER NOT NULL DEFAULT 0,
    metadata TEXT, errors TEXT);
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, ok INTEGER NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (batch_id, line_no));
"""

DB_NAME = "pagedrs.sqlite3"  # under data_dir: files, batches and stored responses (responses_store.py)

# INVARIANT: a batch moves validating -> in_progress -> finalizing -> completed, or to failed,
# or (from validating / in_progress) cancelling -> cancelled; terminal states never change.
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
_TIMESTAMP = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


def _now() -> int:
    return int(time.time())


class BatchStore:
    """Thread-safe (one connection behind a lock); every call is short."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.data_dir / DB_NAME, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ------------------------------------------------------------------ files
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def create_file(
        self, content: bytes, filename: str, purpose: str, file_id: str | None = None
    ) -> dict[str, Any]:
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        path = self.file_path(file_id)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._exec(
            "INSERT OR REPLACE INTO files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?)",
            (file_id, filename, purpose, len(content), _now()),
        )
        info = self.get_file(file_id)
        assert info is not None
        return info

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        rows = self._exec("SELECT * FROM files WHERE id = ?", (file_id,))
        return _file_object(rows[0]) if rows else None

    def list_files(self, purpose: str | None = None, limit: int = 10000) -> list[dict[str, Any]]:
        if purpose:
            rows = self._exec(
                "SELECT * FROM files WHERE purpose = ? ORDER BY created_at DESC, id LIMIT ?", (purpose, limit)
            )
        else:
            rows = self._exec("SELECT * FROM files ORDER BY created_at DESC, id LIMIT ?", (limit,))
        return [_file_object(r) for r in rows]

    def read_file(self, file_id: str) -> bytes | None:
        if self.get_file(file_id) is None:
            return None
        try:
            return self.file_path(file_id).read_bytes()
        except FileNotFoundError:
            return None

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            deleted = cur.rowcount > 0
        if deleted:
            try:
                self.file_path(file_id).unlink()
            except FileNotFoundError:
                pass
        return deleted

    # ---------------------------------------------------------------- batches
    def create_batch(
        self, endpoint: str, input_file_id: str, completion_window: str, metadata: dict[str, str] | None
    ) -> dict[str, Any]:
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = _now()
        self._exec(
            "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
            "expires_at, metadata) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
            (
                batch_id,
                endpoint,
                input_file_id,
                completion_window,
                now,
                now + 24 * 3600,
                json.dumps(metadata) if metadata is not None else None,
            ),
        )
        batch = self.get_batch(batch_id)
        assert batch is not None
        return batch

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        rows = self._exec("SELECT * FROM batches WHERE id = ?", (batch_id,))
        if not rows:
            return None
        return self._batch_object(rows[0])

    def list_batches(self, limit: int = 20, after: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        if after:
            ref = self._exec("SELECT created_at, id FROM batches WHERE id = ?", (after,))
            if not ref:
                return [], False
            rows = self._exec(
                "SELECT * FROM batches WHERE (created_at < ?) OR (created_at = ? AND id > ?) "
                "ORDER BY created_at DESC, id LIMIT ?",
                (ref[0]["created_at"], ref[0]["created_at"], ref[0]["id"], limit + 1),
            )
        else:
            rows = self._exec("SELECT * FROM batches ORDER BY created_at DESC, id LIMIT ?", (limit + 1,))
        return [self._batch_object(r) for r in rows[:limit]], len(rows) > limit

    def active_batch_ids(self) -> list[str]:
        marks = ",".join("?" * len(ACTIVE))
        rows = self._exec(
            f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at, id", tuple(sorted(ACTIVE))
        )
        return [r["id"] for r in rows]

    def set_status(
        self, batch_id: str, status: str, *, only_from: frozenset[str] | None = None, **fields: Any
    ) -> bool:
        """Moves a batch to ``status`` (stamping its time); False if it was not in ``only_from``."""
        cols = {"status": status, **fields}
        if status in _TIMESTAMP:
            cols[_TIMESTAMP[status]] = _now()
        assign = ", ".join(f"{k} = ?" for k in cols)
        sql = f"UPDATE batches SET {assign} WHERE id = ?"
        args: tuple[Any, ...] = (*cols.values(), batch_id)
        if only_from is not None:
            sql += f" AND status IN ({','.join('?' * len(only_from))})"
            args += tuple(sorted(only_from))
        with self._lock:
            return self._db.execute(sql, args).rowcount > 0

    def set_total(self, batch_id: str, total: int) -> None:
        self._exec("UPDATE batches SET total = ? WHERE id = ?", (total, batch_id))

    def set_errors(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        self._exec("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id))

    # ---------------------------------------------------------------- results
    def record_result(
        self, batch_id: str, line_no: int, custom_id: str | None, ok: bool, body: dict[str, Any]
    ) -> bool:
        """Stores a line's answer once; False if the line was already answered."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO batch_results (batch_id, line_no, custom_id, ok, body) "
                "VALUES (?, ?, ?, ?, ?)",
                (batch_id, line_no, custom_id, int(ok), json.dumps(body)),
            )
            return cur.rowcount > 0

    def answered_lines(self, batch_id: str) -> set[int]:
        rows = self._exec("SELECT line_no FROM batch_results WHERE batch_id = ?", (batch_id,))
        return {r["line_no"] for r in rows}

    def results(self, batch_id: str, ok: bool) -> Iterator[str]:
        rows = self._exec(
            "SELECT body FROM batch_results WHERE batch_id = ? AND ok = ? ORDER BY line_no",
            (batch_id, int(ok)),
        )
        for r in rows:
            yield r["body"]

    def counts(self, batch_id: str) -> tuple[int, int]:
        rows = self._exec(
            "SELECT ok, COUNT(*) AS c FROM batch_results WHERE batch_id = ? GROUP BY ok", (batch_id,)
        )
        by = {r["ok"]: r["c"] for r in rows}
        return by.get(1, 0), by.get(0, 0)

    def _batch_object(self, row: sqlite3.Row) -> dict[str, Any]:
        completed, failed = self.counts(row["id"])
        errors = json.loads(row["errors"]) if row["errors"] else None
        return {
            "id": row["id"],
            "object": "batch",
            "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"],
            "status": row["status"],
            "output_file_id": row["output_file_id"],
            "error_file_id": row["error_file_id"],
            "created_at": row["created_at"],
            "in_progress_at": row["in_progress_at"],
            "expires_at": row["expires_at"],
            "finalizing_at": row["finalizing_at"],
            "completed_at": row["completed_at"],
            "failed_at": row["failed_at"],
            "expired_at": None,
            "cancelling_at": row["cancelling_at"],
            "cancelled_at": row["cancelled_at"],
            "request_counts": {"total": row["total"], "completed": completed, "failed": failed},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        }


def _file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }
