"""The baseline's one addon: stream Server-Sent Events through instead of buffering them."""


def responseheaders(flow):
    if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
        flow.response.stream = True
