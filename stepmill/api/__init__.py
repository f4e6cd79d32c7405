"""The control API: its routes, their checks and handlers (served by the proxy on its magic host)."""
