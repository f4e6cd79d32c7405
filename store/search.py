"""The full-text index of conversations and completions (``steps_fts``, SQLite FTS5 over
``steps.messages_suffix`` and ``steps.completion``), filled after the steps are committed, not
with them.

A step indexed in the transaction that records it costs that commit a new FTS5 segment and its
merge work: about two thirds of the SQL time of recording one captured call. So steps are recorded without it
and indexed here in batches, every row above the ``search_indexed`` mark (a ``state`` key: the
highest steps rowid in the index), by the writer within ``SEARCH_WAIT`` (pipeline/writer.py) of
their commit, and by the UI before it answers a search. Rows at or under the mark are kept current
by the triggers of migration 16 (a delete or an edit of the two columns). The index names rows by
rowid: a rowid is given again only after the newest rows are deleted, and the mark comes down with
them (no ``VACUUM``, which may renumber rowids).
"""

from __future__ import annotations

from stepmill.store.connection import Transactions
from stepmill.store.migrations import SEARCH_MARK as MARK, SEARCH_MARK_SQL as MARK_SQL

BATCH_ROWS = 2000  # rows per transaction: a long catch-up takes the write lock in turns


class SearchIndex:
    """Bring ``steps_fts`` up to the newest step; say how far behind it is."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def search_behind(self) -> int:
        """Steps recorded but not yet in the full-text index (read without any lock)."""
        return self.tx.conn.execute(f"SELECT count(*) FROM steps WHERE rowid > {MARK_SQL}").fetchone()[0]

    def index_search(self) -> int:
        """Index every step above the mark, ``BATCH_ROWS`` to a transaction; returns how many. Each
        transaction reads the mark under the write lock, so writers of several processes never index a
        row twice."""
        indexed = 0
        if not self.search_behind():
            return 0  # nothing to do: no write lock taken
        while True:
            with self.tx.write() as conn:
                mark = conn.execute(f"SELECT {MARK_SQL}").fetchone()[0]
                last = conn.execute("SELECT max(rowid) FROM (SELECT rowid FROM steps WHERE rowid > ?"
                                    " ORDER BY rowid LIMIT ?)", [mark, BATCH_ROWS]).fetchone()[0]
                if last is None:
                    return indexed
                done = conn.execute("INSERT INTO steps_fts (rowid, messages_suffix, completion) SELECT rowid,"
                                    " messages_suffix, completion FROM steps WHERE rowid > ? AND rowid <= ?",
                                    [mark, last]).rowcount
                conn.execute("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)", [MARK, str(last)])
            indexed += done
