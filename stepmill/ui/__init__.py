"""The UI: the Datasette plugin, its pages (lifecycle, dashboard, groups), templates and settings."""
