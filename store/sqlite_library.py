"""sqlite_utils, imported without its optional pandas and numpy.

When they are installed, sqlite_utils imports pandas and numpy at once, only to map their types to
column types; the store never hands it such values. pandas alone is ~70 MiB in every process that
opens a store (each proxy worker and its writer), so both are hidden while sqlite_utils loads,
unless the process already holds them.
"""

from __future__ import annotations

import sys


def _import_without_dataframes():
    hidden = [name for name in ("pandas", "numpy") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import pandas` raises ImportError, which sqlite_utils takes as absent
    try:
        import sqlite_utils
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return sqlite_utils


sqlite_utils = _import_without_dataframes()

__all__ = ["sqlite_utils"]
