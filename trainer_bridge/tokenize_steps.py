"""`stepmill tokenize`: give steps without exact ids rendered ones, with their provenance."""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from stepmill.protocols import by_api
from stepmill.store import Store

from stepmill.trainer_bridge.render import Rendered, Renderer, load_tokenizer, template_tools


@dataclass
class TokenizeReport:
    rendered: int = 0
    spliced: int = 0
    divergent: int = 0
    skipped: int = 0
    failed: int = 0


def tokenize_steps(store: Store, tokenizer_path: str, *, where: str | None = None, params=(), splice: bool = False,
                   redo: bool = False, batch_size: int = 64, progress: bool | None = None) -> TokenizeReport:
    """Render the selected steps (parents before children) and store their ids.

    ``splice``: where the parent has exact ids, keep them and render only the new suffix.
    """
    renderer = Renderer(load_tokenizer(tokenizer_path), name=tokenizer_path)
    ids = store.steps_to_tokenize(where, params, redo=redo)  # never steps with engine-sampled (exact) ids
    report = TokenizeReport()
    bar = tqdm(total=len(ids), unit="step", desc="tokenize", disable=(not progress) if progress is not None else None)
    for start in range(0, len(ids), batch_size):
        batch = ids[start:start + batch_size]
        results = []
        for step_id in batch:
            try:
                results.append((step_id, _render_one(store, renderer, step_id, splice)))
            except Exception as exc:  # one odd step must not stop a long run
                report.failed += 1
                results.append((step_id, exc))
        with store.write():
            for step_id, result in results:
                if isinstance(result, Exception):
                    # Ids rendered earlier (maybe by another tokenizer) go: none may carry this tokenizer's name.
                    store.clear_tokens(step_id, tokenizer=renderer.name, fidelity="failed",
                                       fidelity_detail=f"{type(result).__name__}: {result}", in_transaction=True)
                    continue
                rendered, provenance = result
                if rendered is None:
                    report.skipped += 1
                    continue
                store.set_tokens(step_id, rendered.prompt_ids, rendered.response_ids, provenance=provenance,
                                 tokenizer=renderer.name, spliced_len=rendered.spliced_len,
                                 fidelity=rendered.fidelity, fidelity_detail="; ".join(rendered.details) or None,
                                 in_transaction=True)
                report.rendered += 1
                report.spliced += provenance == "spliced"
                report.divergent += rendered.fidelity != "ok"
        bar.update(len(batch))
    bar.close()
    return report


def _render_one(store: Store, renderer: Renderer, step_id: str, splice: bool):
    record = store.step(step_id, with_tokens=False)
    completion = record["completion"]
    if not completion:
        return None, None
    protocol = by_api(record.get("engine_api") or record["api"])  # the protocol of the kept exchange
    if protocol is not None and protocol.prompt_is_text:  # no chat template: the prompt is the text itself
        prompt = (record["params"] or {}).get("prompt")
        if not isinstance(prompt, str):
            return None, None
        prompt_ids = renderer.encode(prompt)
        return Rendered(prompt_ids, renderer.encode(completion.get("content") or "")), "rendered"
    tools = template_tools(record["api"], record["tools"])
    messages = record["messages"]
    parent = record["parent_step_id"]
    if splice and parent:
        parent_row = store.token_layout(parent)
        shared = store.token_layout(step_id)["messages_base_len"] or 0
        if parent_row["token_provenance"] in ("exact", "spliced") and shared == parent_row["message_count"] + 1:
            prompt, response, _ = store.token_sequences(parent)
            return renderer.splice(messages, completion, tools, list(prompt) + list(response), shared), "spliced"
    return renderer.render(messages, completion, tools), "rendered"

