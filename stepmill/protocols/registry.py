"""The protocols stepmill records, in route order: the built-in ones, then those other packages provide.

A package adds a protocol with an entry point in the group ``stepmill.protocols`` that names a
``Protocol`` (``contract.Protocol``), a list of them, or a module whose ``PROTOCOL`` (or ``PROTOCOLS``)
holds them::

    [project.entry-points."stepmill.protocols"]
    toy = "toy_protocol:PROTOCOL"

The registry is built once per process, on first use (``stepmill proxy`` builds it before it serves a
call, so the event loop only reads it). An entry point that does not load, names no protocol, or reuses
an api name stops it with a ``PluginError`` naming the entry point.
"""

from __future__ import annotations

import importlib.metadata
from types import ModuleType

from stepmill.errors import PluginError
from stepmill.protocols import anthropic_messages, gemini_generate, openai_chat, openai_responses, sglang_generate
from stepmill.protocols.contract import Protocol

GROUP = "stepmill.protocols"
# Paths are matched without the query string, at the end, so a vLLM or SGLang server under any prefix is
# recognised; the first match wins.
BUILT_IN: tuple[Protocol, ...] = (*openai_chat.PROTOCOLS, openai_responses.PROTOCOL, anthropic_messages.PROTOCOL,
                                  gemini_generate.PROTOCOL, sglang_generate.PROTOCOL)


class Registry:
    def __init__(self, protocols: list[Protocol]):
        self.protocols = tuple(protocols)
        self.by_api = {p.api: p for p in protocols}

    def match(self, path: str) -> Protocol | None:
        bare = path.split("?", 1)[0].rstrip("/")
        for protocol in self.protocols:
            if protocol.matches(bare):
                return protocol
        return None


def _provided(value, where: str) -> list[Protocol]:
    """The protocols an entry point's object gives: a Protocol, a list of them, or a module holding them."""
    if isinstance(value, ModuleType):
        value = getattr(value, "PROTOCOLS", None) or getattr(value, "PROTOCOL", None)
        if value is None:
            raise PluginError(f"{where} names a module without PROTOCOL or PROTOCOLS")
    found = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in found:
        if not isinstance(item, Protocol):
            raise PluginError(f"{where} gives {type(item).__name__} {item!r:.80}, not a "
                              "stepmill.protocols.contract.Protocol")
    if not found:
        raise PluginError(f"{where} gives no protocol")
    return found


def build(entry_points=None) -> Registry:
    """The built-in protocols and those of ``entry_points`` (default: the installed ones), checked."""
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=GROUP)
    protocols = list(BUILT_IN)
    seen = {p.api: "stepmill itself" for p in protocols}
    unique = {(ep.name, ep.value): ep for ep in entry_points}  # one distribution found twice on sys.path
    for (name, value), ep in sorted(unique.items()):
        dist = getattr(ep, "dist", None)
        where = f"the {GROUP} entry point {name} = {value}" + (f" (of {dist.name})" if dist is not None else "")
        try:
            loaded = ep.load()
        except Exception as exc:
            raise PluginError(f"{where} does not load: {type(exc).__name__}: {exc}") from exc
        for protocol in _provided(loaded, where):
            if protocol.api in seen:
                raise PluginError(f"{where} gives api {protocol.api!r}, which {seen[protocol.api]} provides already")
            seen[protocol.api] = where
            protocols.append(protocol)
    return Registry(protocols)


_registry: Registry | None = None


def load() -> Registry:
    """The registry of this process, built on first use."""
    global _registry
    if _registry is None:
        _registry = build()
    return _registry


def protocols() -> tuple[Protocol, ...]:
    return load().protocols


def match(path: str) -> Protocol | None:
    """The protocol of a request path, or None for other traffic."""
    return load().match(path)


def by_api(api: str | None) -> Protocol | None:
    """The protocol named ``api`` (a step's ``api`` or ``engine_api``), or None (``control``, one not installed)."""
    return load().by_api.get(api)
