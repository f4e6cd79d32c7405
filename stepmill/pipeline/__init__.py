"""Off the event loop: handoff, journal, writer, and decode -> redact -> parse -> record into the store."""
