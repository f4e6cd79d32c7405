"""The stepmill_* options: declared in ``load``, checked in ``configure`` (before anything starts).

mitmproxy shows ``choices`` in ``--help`` and its option reference, but a value given with
``--set`` is not checked against them: ``configure`` does that, and raising ``OptionsError``
there makes mitmproxy refuse the value (at start-up: exit with the message, before ``running``,
where the pipeline starts).
"""

from __future__ import annotations

from collections.abc import Sequence

from mitmproxy import ctx, exceptions

from stepmill.pipeline.service import DURABILITY, PRIORITIES, WRITERS

CHOICES = {"stepmill_writer": WRITERS, "stepmill_writer_priority": PRIORITIES, "stepmill_durability": DURABILITY}
# a change restarts the pipeline
PIPELINE_OPTIONS = {"stepmill_db", "stepmill_writer", "stepmill_writer_priority", "stepmill_durability"}


class StepmillOptions:
    def load(self, loader):
        loader.add_option("stepmill_db", str, "stepmill.db", "SQLite file the steps are written to.")
        loader.add_option("stepmill_hosts", Sequence[str], [],
                          "Capture only these hosts. Empty: any host whose path is an LLM API path.")
        loader.add_option("stepmill_keep_raw", bool, False,
                          "Keep raw request and response bodies (secrets redacted) for every step, not only failed ones.")
        loader.add_option("stepmill_channel", str, "train", "Channel of new trajectories not tagged with one.")
        loader.add_option("stepmill_engine_hosts", str, "auto",
                          "Hosts treated as open-model engines (vLLM, SGLang) asked for token ids: "
                          "'auto' (hosts that answer a probe as vLLM or SGLang), 'none', or a comma list of "
                          "host[:port] (forced).")
        loader.add_option("stepmill_engine_inject", bool, True,
                          "Ask engines for token ids and logprobs the agent did not ask for.")
        loader.add_option("stepmill_messages_via_chat", bool, True,
                          "Serve Anthropic Messages calls to an engine through its chat completions (asked for "
                          "exact token ids) and translate the answer back, streamed event by event. Off: they go "
                          "to the engine's /v1/messages, which has no ids.")
        loader.add_option("stepmill_engine_strip", bool, True,
                          "Remove from the agent's response the fields only that request caused.")
        loader.add_option("stepmill_control_host", str, "stepmill.local",
                          "Host name the control API answers on through the proxy (no DNS needed).")
        loader.add_option("stepmill_writer", str, "process",
                          "Where steps are parsed and written: 'process' (a writer process of its own, on "
                          "another core) or 'thread' (a thread of the proxy).", choices=CHOICES["stepmill_writer"])
        loader.add_option("stepmill_writer_priority", str, "idle",
                          "CPU priority of the writer process: 'idle' (it runs only when a core is free, never "
                          "delaying the proxy, agents or engines; commits lag while every core is busy), 'low' "
                          "(nice 10) or 'normal'.", choices=CHOICES["stepmill_writer_priority"])
        loader.add_option("stepmill_durability", str, "gathered",
                          "When a finished call reaches the journal (where a kill -9 of the proxy cannot lose it): "
                          "'gathered' (calls ending within 50 ms of each other share one append: under load a "
                          "call waits up to about 90 ms, for less CPU) or 'call' (each at once, about 1 ms, for "
                          "more CPU under load).", choices=CHOICES["stepmill_durability"])
        loader.add_option("stepmill_max_body", int, 64 * 1024 * 1024,
                          "Bytes stepmill keeps of one call's request and of its response (decoded too); past it "
                          "the bytes still pass through unchanged, and the step is recorded as truncated. "
                          "Bounds the proxy's memory for a stream that never ends. 0: no limit.")

    def configure(self, updated):
        for name in updated & CHOICES.keys():
            value = getattr(ctx.options, name)
            if value not in CHOICES[name]:
                raise exceptions.OptionsError(f"{name} must be one of {', '.join(CHOICES[name])}, not {value!r}")
        if "stepmill_max_body" in updated and ctx.options.stepmill_max_body < 0:
            raise exceptions.OptionsError("stepmill_max_body must be 0 (no limit) or a number of bytes")
