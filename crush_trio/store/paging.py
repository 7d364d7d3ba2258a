"""Cursor paging of the lists that grow without bound: sessions, messages, runs.

A cursor is the id of the last item a client has (``before``/``after``). It is resolved to the
item's fixed sort key ``(created_at, seq)`` (``seq``: SQLite's ``rowid``, PostgreSQL's identity
column), which never changes once the row exists, so paging through a list returns every item
once even while new items arrive (they sort after every cursor already handed out for messages,
and before the first page for sessions and runs, which page newest first). Updated items do not
move: sessions page by creation, not by ``updated_at``.

The SQL is built here once for both stores (``mark``: the driver's placeholder, ``seq``: the
column, ``scope``: the workspace filter PostgreSQL adds in front of every query).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import attrs

from ..core.ports import PageQuery as PageQuery  # noqa: TC001 (a re-export)
from ..defaults import DEFAULT_PAGE as DEFAULT_PAGE
from ..errors import CursorNotFound as CursorNotFound

if TYPE_CHECKING:
    from collections.abc import Sequence

#: The most items one page may ask for (``limit``).
MAX_PAGE: Final = 1000


def like_pattern(text: str) -> str:
    """``text`` as a LIKE pattern matching it anywhere (``\\`` escapes ``%`` and ``_``)."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


@attrs.frozen
class Dialect:
    mark: str  # "?" or "%s"
    seq: str  # "rowid" or "seq"
    scope: str = ""  # "workspace_id = %s AND " (PostgreSQL) or ""
    scope_params: tuple[Any, ...] = ()

    def _cursor(self, table: str, key: str) -> str:
        return f"SELECT created_at, {self.seq} FROM {table} WHERE {self.scope}{key} = {self.mark}"

    def sessions(self, columns: str, page: PageQuery) -> tuple[str, str | None, list[Any]]:
        """(query, cursor query or None, params): newest created first."""
        where = [f"{self.scope}1 = 1"]
        params: list[Any] = [*self.scope_params]
        if page.query:
            where.append(f"lower(title) LIKE lower({self.mark}) ESCAPE '\\'")
            params.append(like_pattern(page.query))
        cursor = None
        if page.before is not None:
            where.append(f"(created_at, {self.seq}) < ({self.mark}, {self.mark})")
            cursor = self._cursor("sessions", "id")
        sql = (
            f"SELECT {columns} FROM sessions WHERE {' AND '.join(where)} "
            f"ORDER BY created_at DESC, {self.seq} DESC LIMIT {self.mark}"
        )
        return sql, cursor, params

    def messages(
        self, columns: str, session_id: str, page: PageQuery
    ) -> tuple[str, str | None, list[Any], bool]:
        """(query, cursor query, params, reverse): ``before`` pages backwards (the query reads
        newest first; ``reverse`` says to turn the page back to oldest first)."""
        where = [f"{self.scope}session_id = {self.mark}"]
        params: list[Any] = [*self.scope_params, session_id]
        cursor = None
        order = "ASC"
        if page.after is not None:
            where.append(f"(created_at, {self.seq}) > ({self.mark}, {self.mark})")
            cursor = self._cursor("messages", "id")
        elif page.before is not None:
            where.append(f"(created_at, {self.seq}) < ({self.mark}, {self.mark})")
            cursor = self._cursor("messages", "id")
            order = "DESC"
        sql = (
            f"SELECT {columns} FROM messages WHERE {' AND '.join(where)} "
            f"ORDER BY created_at {order}, {self.seq} {order} LIMIT {self.mark}"
        )
        return sql, cursor, params, order == "DESC"

    def runs(self, columns: str, page: PageQuery) -> tuple[str, str | None, list[Any]]:
        """(query, cursor query, params): newest first."""
        where = [f"{self.scope}1 = 1"]
        params: list[Any] = [*self.scope_params]
        if page.statuses:
            where.append(f"status IN ({', '.join([self.mark] * len(page.statuses))})")
            params.extend(page.statuses)
        if page.session_id is not None:
            where.append(f"session_id = {self.mark}")
            params.append(page.session_id)
        cursor = None
        if page.before is not None:
            where.append(f"(created_at, {self.seq}) < ({self.mark}, {self.mark})")
            cursor = self._cursor("runs", "run_id")
        sql = (
            f"SELECT {columns} FROM runs WHERE {' AND '.join(where)} "
            f"ORDER BY created_at DESC, {self.seq} DESC LIMIT {self.mark}"
        )
        return sql, cursor, params


def run_page(
    execute: Any,
    sql: str,
    cursor_sql: str | None,
    cursor_id: str | None,
    params: Sequence[Any],
    limit: int,
    scope_params: Sequence[Any] = (),
) -> list[tuple[Any, ...]]:
    """Resolve the cursor (``CursorNotFound`` if it names nothing) and read one page.

    ``execute(sql, params)`` returns rows (a connection's execute + fetchall)."""
    args = list(params)
    if cursor_sql is not None:
        found = execute(cursor_sql, [*scope_params, cursor_id])
        if not found:
            raise CursorNotFound(cursor_id)
        args.extend(found[0])
    args.append(limit)
    return list(execute(sql, args))
