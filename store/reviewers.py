"""Named reviewer tokens for the UI: shown once when created, kept only as a hash (minted and hashed
as the runner's run secrets are, ``stepmill.auth.secret_hashes``)."""

from __future__ import annotations

from stepmill.auth.secret_hashes import new_secret, secret_hash, secret_matches
from stepmill.store.connection import Transactions
from stepmill.store.ids import now_iso


class Reviewers:
    """Create reviewers and find a sign-in token's."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def create_reviewer(self, name: str) -> str:
        """A new sign-in token for ``name``, replacing any earlier one; only its hash is kept."""
        token = new_secret()
        with self.tx.write() as conn:
            conn.execute("INSERT OR REPLACE INTO reviewers (name, token_hash, created_at) VALUES (?, ?, ?)",
                         [name, secret_hash(token), now_iso()])
        return token

    def reviewer_for_token(self, token: str) -> str | None:
        """The named reviewer a sign-in token belongs to, or None."""
        for name, stored in self.tx.conn.execute("SELECT name, token_hash FROM reviewers"):
            if secret_matches(token, stored):
                return name
        return None
