"""A real PostgreSQL for tests: the one `stepmill fleet up` starts (``stepmill.fleet.local_coordinator``),
in a temporary folder, on a free port of 127.0.0.1, stopped and deleted at the end.

Without PostgreSQL's binaries (Debian's ``postgresql``) the tests that need it skip and say so;
with ``STEPMILL_REQUIRE_ENGINES=1`` (CI) they fail instead.
"""

from __future__ import annotations

from stepmill.fleet.local_coordinator import SUPERUSER, PostgresServer, find_bindir, missing_reason, start_postgres

REQUIRE = "STEPMILL_REQUIRE_ENGINES"

__all__ = ["REQUIRE", "SUPERUSER", "PostgresServer", "find_bindir", "missing_reason", "start_postgres"]
