"""Datasette plugin: readable views of steps and trajectories, reviews, and the lifecycle page.

Routes (HTML, or JSON with a .json suffix):
  /-/stepmill/steps/<step_id>
  /-/stepmill/trajectories/<trajectory_id>
  /-/stepmill/lifecycle
  /-/stepmill/sign-in?token=…       a named reviewer's token (``stepmill reviewer NAME``) → signed in
  POST /-/stepmill/review           a signed-in reviewer's label / trainable / tag / note / reward

Anonymous visitors read; only a signed-in actor (Datasette's root, or a named reviewer) writes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from urllib.parse import quote

from datasette import hookimpl
from datasette.utils.asgi import Response
from markupsafe import Markup, escape

from . import reviewers
from .db import Store
from .lifecycle import STAGES, lifecycle
from .linking import content_text

_stores: dict[str, Store] = {}
_lock = threading.RLock()  # one Store connection per file, used by one thread at a time


def _database(datasette, request):
    name = request.args.get("db")
    if name:
        return datasette.get_database(name)
    for db in datasette.databases.values():
        if db.path and not db.is_memory:
            return db
    return datasette.get_database()


def _store(path: str) -> Store:
    with _lock:
        if path not in _stores:
            _stores[path] = Store(path)
        return _stores[path]


async def _call(datasette, request, fn, *args):
    db = _database(datasette, request)

    def run():
        with _lock:
            return fn(_store(db.path), *args)

    return db.name, await asyncio.to_thread(run)


def _load_step(store: Store, step_id: str) -> dict:
    record = store.step(step_id)
    shared = store.query("SELECT messages_base_len FROM steps WHERE id = ?", [step_id])[0]["messages_base_len"]
    return {"step": record, "shared": shared or 0, "curation": store.curation(step_id), "target": step_id,
            "drift": _drift(store, record)}


_tokenizers: dict = {}


def _drift(store: Store, record: dict, width: int = 8) -> dict | None:
    """Where a child stops continuing its parent's ids: the tokens around it, side by side, decoded
    with the step's tokenizer when it is on this machine."""
    check = record["token_check"]
    if check["consistency"] != "divergent" or not record["parent_step_id"] or record["prompt_ids"] is None:
        return None
    prompt, response, _ = store.token_sequences(record["parent_step_id"])
    parent = list(prompt) + list(response)
    pos = check["divergence_pos"] or 0
    start = max(0, pos - width)
    sides = {"parent": [int(t) for t in parent[start:pos + width]], "child": record["prompt_ids"][start:pos + width]}
    decoded = None
    name = check["tokenizer"]
    if name:
        try:
            if name not in _tokenizers:
                from stepmill.trainer_bridge import load_tokenizer

                _tokenizers[name] = load_tokenizer(name)
            tokenizer = _tokenizers[name]
            decoded = {side: [tokenizer.decode([t]) for t in ids] for side, ids in sides.items()}
        except Exception:
            decoded = None  # the tokenizer is not here: ids only
    return {"pos": pos, "start": start, **sides, "decoded": decoded}


def _load_trajectory(store: Store, trajectory_id: str) -> dict:
    trajectory = store.trajectory(trajectory_id)
    if trajectory is None:
        raise KeyError(trajectory_id)
    shared = {row["id"]: row["messages_base_len"] or 0 for row in store.query(
        "SELECT id, messages_base_len FROM steps WHERE trajectory_id = ?", [trajectory_id])}
    steps = []
    for record in store.iter_steps("s.trajectory_id = ?", [trajectory_id], with_tokens=False):
        record["new_messages"] = record["messages"][shared[record["step_id"]]:]
        steps.append(record)
    steps.sort(key=lambda r: (r["step_index"] is None, r["step_index"]))
    for record in steps:
        record["review"] = store.curation(record["step_id"])["review"]
    tools = next((s["tools"] for s in steps if s.get("tools")), None)
    return {"trajectory": trajectory, "steps": steps, "tools": tools, "curation": store.curation(trajectory_id),
            "target": trajectory_id}


async def _readable(datasette, request) -> bool:
    """Our pages follow the instance's view permission (bound beyond localhost: signed-in actors only)."""
    return await datasette.allowed(action="view-instance", actor=request.actor)


async def _view(datasette, request, what: str, load, key: str, template: str, as_data):
    """One readable page: HTML from ``template``, or JSON (``as_data`` of the loaded context) with .json."""
    if not await _readable(datasette, request):
        return Response.html("<h1>Sign in to read</h1>", status=403)
    as_json = bool(request.url_vars.get("ext"))
    try:
        db_name, context = await _call(datasette, request, load, request.url_vars[key])
    except KeyError:
        return _not_found(f"{what} {request.url_vars[key]}", as_json)
    if as_json:
        return Response.json(as_data(context), default=str)
    context = {**context, "db_name": db_name, "actor": request.actor, "next": request.path}
    return Response.html(await datasette.render_template(template, context, request=request))


def _not_found(what: str, as_json: bool):
    if as_json:
        return Response.json({"error": f"not found: {what}"}, status=404)
    return Response.html(f"<h1>Not found</h1><p>{escape(what)}</p>", status=404)


async def step_view(datasette, request):
    return await _view(datasette, request, "step", _load_step, "step_id", "stepmill_step.html",
                       lambda context: context["step"])


async def trajectory_view(datasette, request):
    return await _view(datasette, request, "trajectory", _load_trajectory, "trajectory_id",
                       "stepmill_trajectory.html", lambda context: context)


async def lifecycle_view(datasette, request):
    if not await _readable(datasette, request):
        return Response.html("<h1>Sign in to read</h1>", status=403)
    db_name, data = await _call(datasette, request, lambda store: lifecycle(store.db.conn))
    if request.url_vars.get("ext"):
        return Response.json(data)
    return Response.html(await datasette.render_template(
        "stepmill_lifecycle.html", {"data": data, "stages": STAGES, "db_name": db_name}, request=request))


async def sign_in(datasette, request):
    """A named reviewer's token becomes Datasette's signed actor cookie."""
    token = request.args.get("token") or ""
    _, name = await _call(datasette, request, lambda store: reviewers.who(store.db.conn, token))
    if not name:
        return Response.html("<h1>Unknown or replaced reviewer token</h1>", status=403)
    response = Response.redirect("/-/stepmill/lifecycle")
    response.set_cookie("ds_actor", datasette.sign({"a": {"id": name, "stepmill": "reviewer"}}, "actor"),
                        httponly=True, samesite="lax")
    return response


REVIEW_ACTIONS = ("label", "trainable", "tag", "note", "reward")


async def review(datasette, request):
    """A reviewer's decision from a step or trajectory page: one append-only row, then back to the page."""
    if request.method != "POST":
        return Response.text("POST a form", status=405)
    actor = request.actor
    if not actor or not actor.get("id"):
        return Response.html("<h1>Sign in to review</h1><p>Anonymous visitors can read, not write.</p>",
                             status=403)
    form = await request.post_vars()
    target, action, value = form.get("target", ""), form.get("action", ""), (form.get("value") or "").strip()
    if action not in REVIEW_ACTIONS:
        return Response.text(f"unknown action {action!r}", status=400)

    def write(store: Store):
        if action == "reward":
            return store.add_reward(target, float(value), source="human", name=str(actor["id"]),
                                    note=(form.get("note") or None))
        return store.add_review(target, action, value or None, reviewer=str(actor["id"]))

    try:
        await _call(datasette, request, write)
    except KeyError:
        return Response.text(f"no step or trajectory {target!r}", status=404)
    except ValueError as exc:
        return Response.text(str(exc), status=400)
    following = form.get("next") or "/"
    return Response.redirect(following if following.startswith("/-/stepmill/") else "/")


@hookimpl
def register_routes():
    return [
        (r"^/-/stepmill/steps/(?P<step_id>[^/]+?)(?P<ext>\.json)?$", step_view),
        (r"^/-/stepmill/trajectories/(?P<trajectory_id>[^/]+?)(?P<ext>\.json)?$", trajectory_view),
        (r"^/-/stepmill/lifecycle(?P<ext>\.json)?$", lifecycle_view),
        (r"^/-/stepmill/sign-in$", sign_in),
        (r"^/-/stepmill/review$", review),
    ]


@hookimpl
def prepare_jinja2_environment(env):
    env.filters["stepmill_text"] = content_text
    env.filters["stepmill_pretty_args"] = _pretty_arguments
    env.filters["stepmill_quote"] = lambda value: quote(str(value), safe="")
    env.filters["stepmill_json"] = lambda value: json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _pretty_arguments(arguments):
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except (TypeError, ValueError):
        return arguments


@hookimpl
def render_cell(row, value, column, table):
    if table == "steps" and column == "completion" and value:
        try:
            message = json.loads(value)
        except (TypeError, ValueError):
            return None
        text = content_text(message.get("content"))[:160]
        calls = ", ".join((c.get("function") or {}).get("name") or "?" for c in message.get("tool_calls") or [])
        preview = escape(text) + (Markup(f" <em>→ {escape(calls)}</em>") if calls else "")
        return Markup(f'{preview} <a href="/-/stepmill/steps/{escape(row["id"])}">read</a>')
    if table == "trajectories" and column == "id" and value:
        return Markup(f'{escape(value)} <a href="/-/stepmill/trajectories/{escape(value)}">read</a>')
    return None


@hookimpl
def row_actions(datasette, database, table, row):
    if table == "steps":
        return [{"href": f"/-/stepmill/steps/{row['id']}", "label": "Read conversation",
                 "description": "Roles, tool calls and thinking of this step"}]
    if table == "trajectories":
        return [{"href": f"/-/stepmill/trajectories/{row['id']}", "label": "Read trajectory"}]
    return None
