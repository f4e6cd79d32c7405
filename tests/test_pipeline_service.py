"""The pipeline of one database as the addon drives it: submit on the loop, wait until committed, close."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import pytest

from stepmill.errors import ConfigError
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.service import Pipeline
from stepmill.store import Store

REPLY = {"id": "c1", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                "finish_reason": "stop"}]}


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_submitted_calls_are_committed_when_flushed(tmp_path, writer):
    db = str(tmp_path / "p.db")
    pipeline = Pipeline(db, writer=writer, priority="normal")
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for i in range(3):
            request = {"model": "m", "messages": [{"role": "user", "content": f"call {i}"}]}
            pipeline.submit(CallRecord(kind="http", call=Call("openai.chat", "h", "/v1/chat/completions"),
                                       started=time.time(), ended=time.time(), http_status=200),
                            [json.dumps(request).encode(), json.dumps(REPLY).encode()])
        assert asyncio.run(pipeline.flushed(time.monotonic() + 30, executor))
        status = pipeline.status()
        assert status["writer"] == writer and status["journaled"] == 3 and status["uncommitted_bytes"] == 0
    finally:
        pipeline.close()
        executor.shutdown()
    store = Store(db)
    assert sorted(m["content"] for s in store.iter_steps() for m in s["messages"]) == [f"call {i}" for i in range(3)]
    assert not list(pipeline.journal.folder.parent.iterdir())  # committed journals are removed
    store.close()


def test_an_unknown_writer_is_refused(tmp_path):
    with pytest.raises(ConfigError):
        Pipeline(str(tmp_path / "x.db"), writer="thred")
