"""A call served through an engine's chat completions is stored under the protocol the agent spoke (``api``)
with the engine's beside it (``engine_api``): steps recorded before that column are read that way too."""

from __future__ import annotations

import json

import sqlite_utils

from stepmill.protocols import gemini_via_chat, messages_via_chat
from stepmill.store import Store, migrations

OLD = [  # (id, api, metadata) as the release before engine_api stored them
    ("messages", "openai.chat", {"notes": [messages_via_chat.NOTE]}),
    ("gemini", "openai.chat", {"notes": ["the system prompt differs from the parent step's", gemini_via_chat.NOTE]}),
    ("plain", "openai.chat", None),
    ("noted", "openai.chat", {"notes": ["the engine returned response ids without prompt ids"]}),
    ("own", "anthropic.messages", {"notes": [messages_via_chat.NOTE]}),  # not served through chat: left alone
    ("odd", "openai.chat", "not JSON"),
]


def test_the_migration_gives_translated_steps_the_agents_protocol(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    db = sqlite_utils.Database(path)
    before = migrations.MIGRATIONS[:[m[0] for m in migrations.MIGRATIONS].index("engine_api")]  # as the release before made it
    monkeypatch.setattr(migrations, "MIGRATIONS", before)
    migrations.migrate(db)
    assert "engine_api" not in db["steps"].columns_dict
    db["steps"].insert_all([{"id": step_id, "api": api, "status": "ok", "started_at": "2026-01-01T00:00:00",
                             "metadata": metadata if isinstance(metadata, str) else json.dumps(metadata)}
                            for step_id, api, metadata in OLD])
    db.close()
    monkeypatch.undo()

    store = Store(path)  # a writer's open migrates
    try:
        rows = {row["id"]: (row["api"], row["engine_api"])
                for row in store.query("SELECT id, api, engine_api FROM steps")}
    finally:
        store.close()
    assert rows == {"messages": ("anthropic.messages", "openai.chat"), "gemini": ("gemini.generate", "openai.chat"),
                    "plain": ("openai.chat", None), "noted": ("openai.chat", None),
                    "own": ("anthropic.messages", None), "odd": ("openai.chat", None)}


def test_the_migration_knows_the_notes_the_translations_write():
    # The migration keeps its own copy of the notes (a shipped migration never changes): they must be the ones
    # the translations wrote.
    assert migrations.TRANSLATED_NOTES == {"anthropic.messages": messages_via_chat.NOTE,
                                           "gemini.generate": gemini_via_chat.NOTE}
