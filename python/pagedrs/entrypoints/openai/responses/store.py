"""Stored responses of /v1/responses (`store: true`): the response object and the conversation that
led to it, in the server's SQLite database beside files and batches, so `GET /v1/responses/{id}` and
`previous_response_id` work across restarts."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

from pagedrs.entrypoints.openai.batches.store import DB_NAME

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    body TEXT NOT NULL, conversation TEXT NOT NULL);
"""

# INVARIANT: a stored response moves queued -> in_progress -> one of completed, incomplete, failed,
# cancelled; a terminal status never changes.
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


class ResponsesStore:
    """Thread-safe (one connection behind a lock); every call is short."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        path = Path(data_dir)
        path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path / DB_NAME, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def fail_unfinished(self, message: str) -> int:
        """At start-up: background responses a previous process left unfinished failed with it."""
        rows = self._exec("SELECT id, body FROM responses WHERE status IN ('queued', 'in_progress')")
        for row in rows:
            body = json.loads(row["body"])
            body["status"] = "failed"
            body["error"] = {"code": "server_error", "message": message}
            self.update(body)
        return len(rows)

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def create(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Stores a new response and the conversation (input items) that led to it."""
        self._exec(
            "INSERT INTO responses (id, created_at, status, body, conversation) VALUES (?, ?, ?, ?, ?)",
            (body["id"], body["created_at"], body["status"], json.dumps(body), json.dumps(conversation)),
        )

    def update(self, body: dict[str, Any]) -> bool:
        """Replaces a stored response that is not finished yet; False when it is finished (a cancel
        won the race) or gone (deleted)."""
        marks = ",".join("?" * len(TERMINAL))
        with self._lock:
            cur = self._db.execute(
                f"UPDATE responses SET status = ?, body = ? WHERE id = ? AND status NOT IN ({marks})",
                (body["status"], json.dumps(body), body["id"], *sorted(TERMINAL)),
            )
            return cur.rowcount > 0

    def statuses(self, response_ids: list[str]) -> dict[str, str]:
        """The status of each of these responses still stored (a deleted one is missing)."""
        if not response_ids:
            return {}
        marks = ",".join("?" * len(response_ids))
        rows = self._exec(f"SELECT id, status FROM responses WHERE id IN ({marks})", tuple(response_ids))
        return {row["id"]: row["status"] for row in rows}

    def get(self, response_id: str) -> dict[str, Any] | None:
        rows = self._exec("SELECT body FROM responses WHERE id = ?", (response_id,))
        return json.loads(rows[0]["body"]) if rows else None

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The input items that led to the response (previous turns included)."""
        rows = self._exec("SELECT conversation FROM responses WHERE id = ?", (response_id,))
        return json.loads(rows[0]["conversation"]) if rows else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
