"""The capture pipeline: everything between the proxy's event loop and the store, all of it off the loop.

- ``call_record``: the one record of a call (built on the loop, enriched off it, mapped to a step by ``recording``).
- ``service``: the pipeline of one database, started and stopped by the addon (``Pipeline``).
- ``handoff``: the handoff thread: cleans (decode, redact) and appends to the journal.
- ``journal``: the append-only journal on disk, between the handoff and the writer.
- ``writer``: the writer, a thread or its own process (``python -m stepmill.pipeline.writer``):
  journal → ``ingest`` (parse, reassemble) → ``recording`` (step records) → store, in batches.
- ``state_watch``: a thread that tells the proxy of the runs other processes register (started by ``service``).
- ``redaction``, ``engine_render``: secrets taken out; ids rendered by a vLLM engine.
"""
