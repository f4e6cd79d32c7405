"""The capture pipeline: everything between the proxy's event loop and the store, all of it off the loop.

- ``call_record``: the typed record a hook hands over (built on the loop, read off it).
- ``service``: the pipeline of one database, started and stopped by the addon (``Pipeline``).
- ``handoff``: the handoff thread: cleans (decode, redact) and appends to the journal.
- ``journal``: the append-only journal on disk, between the handoff and the writer.
- ``writer``: the writer, a thread or its own process (``python -m stepmill.pipeline.writer``):
  journal → ``ingest`` (parse, reassemble) → ``recording`` (step records) → store, in batches.
- ``state_watch``: a thread that tells the proxy of policy versions and runs set by other processes.
- ``redaction``, ``engine_render``: secrets taken out; ids rendered by a vLLM engine.
"""
