"""The journal entries the writers committed, each by its identity: a call is stored exactly once.

An entry's identity is where it lies in its journal: ``<journal id>:<segment>:<offset just past it>``
(``pipeline/journal.py``). Nothing but that entry ever lies there (a journal's id is new for each
journal, and appends only go forward), and a replay or a retry reads it there again, so the identity
is the same however often the entry is read, even when its header cannot be read at all.

The writer takes an entry's identity in the same savepoint as the steps it writes for it: the
table's key refuses a second one, so an entry committed once is never written again, whatever the
writer believes about its position (a position cached past a commit that raised after COMMIT, a
journal replayed by another process, a batch retried). The rows of a journal go with it when it is
retired, once nothing of it can be read again.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from stepmill.store.connection import Transactions


class JournalEntries:
    """Which journal entries are committed, and the savepoint that commits one."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    @contextmanager
    def journal_entry(self, entry: str) -> Iterator[bool]:
        """Inside ``batch()``: a savepoint that takes ``entry``'s identity; yields False when it was
        committed before (then nothing is to be written for it). What the block writes and the identity
        commit together or not at all: a block that raises undoes both."""
        with self.tx.savepoint("journal_entry") as conn:
            fresh = conn.execute("INSERT OR IGNORE INTO journal_entries (entry) VALUES (?)", [entry]).rowcount == 1
            yield fresh

    def forget_journal(self, journal_id: str) -> None:
        """The identities of a retired journal's entries (it is gone: none of them can be read again)."""
        with self.tx.write() as conn:
            # Every identity of the journal sorts between "<id>:" and "<id>;" (';' follows ':').
            conn.execute("DELETE FROM journal_entries WHERE entry >= ? AND entry < ?", [f"{journal_id}:", f"{journal_id};"])
