"""A second mitmproxy script for the tests: sends the public API hosts to the local upstream.

There is no internet here; this keeps the agent's view (api.openai.com, api.anthropic.com)
while the bytes go to the test upstream. Loaded with an extra `-s`, it also shows that
`stepmill proxy` passes mitmproxy arguments through.
"""

from mitmproxy import ctx

REDIRECTED = ("api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com", "engine.local", "gateway.local", "sglang.local")


class RedirectHosts:
    def load(self, loader):
        loader.add_option("test_upstream_port", int, 0, "Port of the local test upstream.")

    def request(self, flow):
        host = flow.request.pretty_host
        if host in REDIRECTED and ctx.options.test_upstream_port:
            flow.request.host = "127.0.0.1"
            flow.request.port = ctx.options.test_upstream_port
            flow.request.host_header = host


addons = [RedirectHosts()]
