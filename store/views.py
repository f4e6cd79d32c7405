"""The queries behind the UI's pages (lifecycle, live dashboard, groups, step views)."""

from __future__ import annotations
