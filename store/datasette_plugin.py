"""Datasette plugin: readable views of a step's conversation and of a whole trajectory.

Routes (HTML, or JSON with a .json suffix):
  /-/stepmill/steps/<step_id>
  /-/stepmill/trajectories/<trajectory_id>
"""

from __future__ import annotations

import asyncio
import json
import threading

from datasette import hookimpl
from datasette.utils.asgi import Response
from markupsafe import Markup, escape

from .db import Store
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
    return {"step": record, "shared": shared or 0}


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
    return {"trajectory": trajectory, "steps": steps}


async def _view(datasette, request, what: str, load, key: str, template: str, as_data):
    """One readable page: HTML from ``template``, or JSON (``as_data`` of the loaded context) with .json."""
    as_json = bool(request.url_vars.get("ext"))
    try:
        db_name, context = await _call(datasette, request, load, request.url_vars[key])
    except KeyError:
        return _not_found(f"{what} {request.url_vars[key]}", as_json)
    if as_json:
        return Response.json(as_data(context), default=str)
    return Response.html(await datasette.render_template(template, {**context, "db_name": db_name}, request=request))


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


@hookimpl
def register_routes():
    return [
        (r"^/-/stepmill/steps/(?P<step_id>[^/]+?)(?P<ext>\.json)?$", step_view),
        (r"^/-/stepmill/trajectories/(?P<trajectory_id>[^/]+?)(?P<ext>\.json)?$", trajectory_view),
    ]


@hookimpl
def prepare_jinja2_environment(env):
    env.filters["stepmill_text"] = content_text
    env.filters["stepmill_pretty_args"] = _pretty_arguments


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
