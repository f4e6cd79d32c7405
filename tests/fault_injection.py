"""A mitmproxy script (``-s``) for tests/test_faults.py: faults injected into a real ``stepmill proxy``,
each only where the test asks for it. Its writer must be a thread (``stepmill_writer=thread``): the
faults are patched into this process.

- a request body holding ``fault:clean``: the handoff's cleaning raises;
- a chat request holding ``fault:parse``: the protocol's request parser raises;
- while the file ``fault-state-reads`` is in the proxy's working folder: the state watch's reads fail.
"""

import json
from pathlib import Path

from stepmill.pipeline.handoff import Handoff
from stepmill.pipeline.state_watch import StateWatch
from stepmill.protocols import openai_chat

STATE_READS_FAIL = Path("fault-state-reads").absolute()

_clean = Handoff.clean
_read = StateWatch._read


def clean(record, blobs):
    if blobs and b"fault:clean" in bytes(blobs[0]):
        raise RuntimeError("an injected cleaning fault")
    return _clean(record, blobs)


def read(watch):
    if STATE_READS_FAIL.exists():
        raise OSError("an injected failed read")
    return _read(watch)


def failing_parser(parse):
    def parse_request(body, api):
        if "fault:parse" in json.dumps(body):
            raise RuntimeError("an injected parser fault")
        return parse(body, api)
    return parse_request


Handoff.clean = staticmethod(clean)
StateWatch._read = read
for protocol in openai_chat.PROTOCOLS:  # the instances the protocol registry holds
    object.__setattr__(protocol, "parse_request", failing_parser(protocol.parse_request))
