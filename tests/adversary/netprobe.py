"""A run that tries the network around it: the engine's admin route and its chat route straight (not
through the proxy) and through the proxy, a service on the host's loopback (the UI) straight and
through the proxy, a host on the internet through the proxy, and calls through the proxy naming a
trajectory nobody registered (credentials, a tagged path) or naming none. Then it answers honestly.

    python3 netprobe.py MODEL   (the task on standard input)
"""

import os
import sys

from common import attempt, call, chat_body, legit_answer, own_proxy, report

E = os.environ


def main() -> int:
    prompt, model = sys.stdin.read(), sys.argv[1]
    marker = E["INSIDER_MARKER"]
    host, port, user, secret = own_proxy()
    proxy, auth = (host, port), f"{user}:{secret}"
    base = E["OPENAI_BASE_URL"].rstrip("/")
    origin = base[:base.index("/", len("http://"))]
    out = {"trajectory": E["STEPMILL_TRAJECTORY"], "attempts": {}}
    A = out["attempts"]
    admin = {"method": "reload_weights", "args": [], "kwargs": {}}
    A["engine_admin_straight"] = attempt(call, "POST", origin + "/collective_rpc", admin, timeout=5)
    A["engine_chat_straight"] = attempt(call, "POST", base + "/chat/completions",
                                        chat_body(model, f"STRAIGHT-{marker}"), timeout=5)
    A["engine_admin_proxied"] = attempt(call, "POST", origin + "/collective_rpc", admin, proxy=proxy, auth=auth)
    A["engine_admin_proxied_dotted"] = attempt(call, "POST", origin + "/v1/../collective_rpc", admin, proxy=proxy,
                                               auth=auth)
    A["engine_models_proxied"] = attempt(call, "GET", base + "/models", proxy=proxy, auth=auth)
    ui = E["INSIDER_UI"].rstrip("/")
    A["ui_straight"] = attempt(call, "GET", ui + "/steps.json", timeout=5)
    A["ui_proxied"] = attempt(call, "GET", ui + "/steps.json", proxy=proxy, auth=auth)
    A["internet_proxied"] = attempt(call, "GET", "http://example.com/", proxy=proxy, auth=auth, timeout=10)
    A["health_proxied"] = attempt(call, "GET", "http://stepmill.local/v1/health", proxy=proxy)
    intruder = f"intruder-{marker}"
    A["intruder_credentials"] = attempt(call, "POST", base + "/chat/completions",
                                        chat_body(model, f"INTRUDER-creds-{marker}"), proxy=proxy, auth=f"{intruder}:x")
    A["intruder_path"] = attempt(call, "POST", f"{origin}/t/{intruder}/g/{intruder}-g{base[len(origin):]}/chat/completions",
                                 chat_body(model, f"INTRUDER-path-{marker}"), proxy=proxy)
    A["no_credentials"] = attempt(call, "POST", base + "/chat/completions", chat_body(model, f"ANONYMOUS-{marker}"),
                                  proxy=proxy)
    out["answer"] = legit_answer(model, prompt)
    report(out)
    print(out["answer"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
