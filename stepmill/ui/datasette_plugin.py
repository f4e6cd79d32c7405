"""The Datasette plugin ``stepmill ui`` loads: readable views of steps, trajectories and groups,
reviews, the lifecycle and live pages, and the sign-in gate in front of all of Datasette.

Routes (HTML, or JSON with a .json suffix):
  /-/stepmill/steps/<step_id>
  /-/stepmill/trajectories/<trajectory_id>
  /-/stepmill/groups/<group_id>      a group's rollouts side by side and their prefix tree
  /-/stepmill/lifecycle              the lifecycle in numbers and charts
  /-/stepmill/live                   runs and steps of the last minutes, refreshing itself (live.json)
  /-/stepmill/training?run=NAME      a training run's numbers per policy version beside its control
  /-/stepmill/sign-in?token=…       a named reviewer's token (``stepmill reviewer NAME``) → signed in;
                                    without a token: how to sign in
  POST /-/stepmill/review           a signed-in reviewer's label / trainable / tag / note / reward

Only signed-in actors (Datasette's root through the link ``stepmill ui`` prints, or a named
reviewer) read or write anything, on localhost too: agents on this machine must not read tasks'
answers or change rewards. Anonymous requests get 403 (a page: a redirect to the sign-in page),
except the sign-in routes and static assets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
from urllib.parse import quote, unquote

from datasette import hookimpl
from datasette.plugins import pm
from datasette.tokens import TokenInvalid
from datasette.utils import await_me_maybe, tilde_encode
from datasette.utils.asgi import Request, Response
from markupsafe import Markup, escape

from stepmill.errors import NotFound
from stepmill.protocols.messages import content_text
from stepmill.store import Store, views
from stepmill.ui import dashboard
from stepmill.ui import fleet as fleet_view
from stepmill.ui import training as training_view
from stepmill.ui.lifecycle import STAGES, lifecycle

SIGN_IN = "/-/stepmill/sign-in"
# What anonymous visitors may fetch: the sign-in routes and static assets, nothing with data in it.
_OPEN = re.compile(r"^/(?:-/(?:auth-token|logout|stepmill/sign-in|static/.*|static-plugins/.*)|favicon\.ico)$")


def stepmill_path(kind: str, item_id, ext: str = "") -> str:
    """``/-/stepmill/<kind>/<id><ext>``, the id one percent-encoded path segment. Dots are encoded too,
    so an id ending in ``.json`` is not read as the JSON of a shorter id."""
    return f"/-/stepmill/{kind}/{quote(str(item_id), safe='').replace('.', '%2E')}{ext}"


def _segment(request, key: str) -> str:
    """The id in the path: Datasette routes on the raw, still percent-encoded path; decoded once here."""
    return unquote(request.url_vars[key])


log = logging.getLogger("stepmill")

_stores: dict[str, Store] = {}
# One Store connection per file; one lock for all of them (a Store's connection is not shared between
# threads), so the pages of every file served take turns.
_lock = threading.RLock()


def _files(datasette) -> list:
    """The stepmill files Datasette serves (one per node of a fleet, or the one file), in its order."""
    return [db for db in datasette.databases.values() if db.path and not db.is_memory]


def _database(datasette, request, kind: str | None = None, item_id: str | None = None):
    """The file a page reads: ``?db=NAME``; else, for an id, the file that holds it (ids never collide
    across nodes); else the first file."""
    name = request.args.get("db")
    if name:
        return datasette.get_database(name)
    files = _files(datasette)
    if kind and item_id is not None and len(files) > 1:
        for db in files:
            with _lock:
                if views.holds(_store(db.path), kind, item_id):
                    return db
    return files[0] if files else datasette.get_database()


def _store(path: str) -> Store:
    with _lock:
        if path not in _stores:
            _stores[path] = Store(path, readonly=not os.access(path, os.W_OK))
        return _stores[path]


async def _call(datasette, request, fn, *args, kind: str | None = None):
    db = await asyncio.to_thread(_database, datasette, request, kind, args[0] if kind and args else None)

    def run():
        with _lock:
            return fn(_store(db.path), *args)

    return db.name, await asyncio.to_thread(run)


def _load_step(store: Store, step_id: str) -> dict:
    record = store.step(step_id)
    if record is None:
        raise NotFound(f"step {step_id!r}")
    shared = views.messages_base_len(store, step_id)
    results, called = _pair_tools(record["messages"] + ([record["completion"]] if record["completion"] else []))
    return {"step": record, "shared": shared or 0, "curation": store.curation(step_id), "target": step_id,
            "drift": _drift(store, record), "tool_results": results, "tool_calls_shown": called}


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
    tokenizer = _tokenizer(check["tokenizer"])
    if tokenizer is not None:
        decoded = {side: [tokenizer.decode([t]) for t in ids] for side, ids in sides.items()}
    return {"pos": pos, "start": start, **sides, "decoded": decoded}


def _tokenizer(name: str | None):
    """The named tokenizer when it is on this machine, else None (pages then show ids only)."""
    if not name:
        return None
    if name not in _tokenizers:
        try:
            from stepmill.trainer_bridge import load_tokenizer

            _tokenizers[name] = load_tokenizer(name)
        except Exception:
            _tokenizers[name] = None
    return _tokenizers[name]


def _pair_tools(messages) -> tuple[dict, set]:
    """Tool results by the id of the call they answer, and the ids of the calls on the page: a result
    is drawn beside its call, and folded where it comes later as a message of its own."""
    results, called = {}, set()
    for message in messages:
        if message.get("role") == "tool" and message.get("tool_call_id"):
            results.setdefault(message["tool_call_id"], message)
        for call in message.get("tool_calls") or []:
            if call.get("id"):
                called.add(call["id"])
    return results, called


def _load_trajectory(store: Store, trajectory_id: str) -> dict:
    trajectory = store.trajectory(trajectory_id)
    if trajectory is None:
        raise NotFound(f"trajectory {trajectory_id!r}")
    shared = views.messages_base_lens(store, trajectory_id)
    steps = []
    for record in views.trajectory_steps(store, trajectory_id):
        record["new_messages"] = record["messages"][shared[record["step_id"]]:]
        steps.append(record)
    steps.sort(key=lambda r: (r["step_index"] is None, r["step_index"]))
    for record in steps:
        record["review"] = store.curation(record["step_id"])["review"]
    tools = next((s["tools"] for s in steps if s.get("tools")), None)
    shown = [m for s in steps for m in s["new_messages"] + ([s["completion"]] if s["completion"] else [])]
    results, called = _pair_tools(shown)
    return {"trajectory": trajectory, "steps": steps, "tools": tools, "curation": store.curation(trajectory_id),
            "target": trajectory_id, "tool_results": results, "tool_calls_shown": called}


async def _readable(datasette, request) -> bool:
    """Our pages follow the instance's view permission (bound beyond localhost: signed-in actors only)."""
    return await datasette.allowed(action="view-instance", actor=request.actor)


async def _view(datasette, request, what: str, load, key: str, template: str, as_data):
    """One readable page: HTML from ``template``, or JSON (``as_data`` of the loaded context) with .json."""
    if not await _readable(datasette, request):
        return Response.html("<h1>Sign in to read</h1>", status=403)
    as_json = bool(request.url_vars.get("ext"))
    item_id = _segment(request, key)
    try:
        db_name, context = await _call(datasette, request, load, item_id, kind=_KINDS[key])
    except NotFound:
        return _not_found(f"{what} {item_id}", as_json)
    if as_json:
        return Response.json(as_data(context), default=str)
    kind = _KINDS[key]
    if kind == "groups":  # a group is no row: its trajectories, filtered
        row_url = f"{datasette.urls.table(db_name, 'trajectories')}?group_id={quote(item_id, safe='')}"
    else:
        row_url = datasette.urls.row(db_name, kind, tilde_encode(item_id))
    context = {**context, "db_name": db_name, "actor": request.actor, "next": stepmill_path(kind, item_id),
               "row_url": row_url}
    return Response.html(await datasette.render_template(template, context, request=request))


_KINDS = {"step_id": "steps", "trajectory_id": "trajectories", "group_id": "groups"}


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


async def group_view(datasette, request):
    return await _view(datasette, request, "group", dashboard.group, "group_id", "stepmill_group.html",
                       lambda context: context)


def _lifecycle_and_charts(store: Store) -> dict:
    data = lifecycle(store)
    data["charts"] = dashboard.charts(store)
    return data


async def lifecycle_view(datasette, request):
    if not await _readable(datasette, request):
        return Response.html("<h1>Sign in to read</h1>", status=403)
    db_name, data = await _call(datasette, request, _lifecycle_and_charts)
    data["database"] = db_name
    data["databases"] = [db.name for db in _files(datasette)]
    data["fleet"] = await asyncio.to_thread(fleet_view.fleet)
    if request.url_vars.get("ext"):
        return Response.json(data)
    return Response.html(await datasette.render_template(
        "stepmill_lifecycle.html", {"data": data, "stages": STAGES, "db_name": db_name}, request=request))


async def live_view(datasette, request):
    """The live page polls live.json: one indexed query per refresh (see ``dashboard.live``)."""
    if not await _readable(datasette, request):
        return Response.html("<h1>Sign in to read</h1>", status=403)
    try:
        minutes = min(max(int(request.args.get("minutes") or 30), 1), 24 * 60)
    except ValueError:
        return Response.text("minutes: a whole number", status=400)
    if request.url_vars.get("ext"):
        _, data = await _call(datasette, request, lambda store: dashboard.live(store, minutes))
        for run in data["running"]:
            run["url"] = stepmill_path("trajectories", run["trajectory_id"])
        return Response.json(data, headers={"Cache-Control": "no-store"})
    return Response.html(await datasette.render_template(
        "stepmill_live.html", {"minutes": minutes, "db": request.args.get("db") or ""}, request=request))


async def train_view(datasette, request):
    """A training run (``?run=``, default the first with a control) beside its paired control."""
    if not await _readable(datasette, request):
        return Response.html("<h1>Sign in to read</h1>", status=403)
    run = request.args.get("run") or None
    try:
        tolerance = float(request.args["tolerance"]) if request.args.get("tolerance") else None
        if tolerance is not None and not 0 < tolerance < float("inf"):
            raise ValueError(tolerance)
    except ValueError:
        return Response.text("tolerance: a positive number", status=400)
    as_json = bool(request.url_vars.get("ext"))
    try:
        _, data = await _call(datasette, request, lambda store: training_view.training(store, run, tolerance))
    except NotFound:
        return _not_found(f"training run {run}", as_json)
    if as_json:
        return Response.json(data)
    return Response.html(await datasette.render_template(
        "stepmill_training.html", {"data": data, "fmt": training_view.fmt, "db": request.args.get("db") or ""},
        request=request))


async def sign_in(datasette, request):
    """A named reviewer's token becomes Datasette's signed actor cookie; without one, how to sign in."""
    token = request.args.get("token") or ""
    name = None
    if token:  # a reviewer made with `stepmill reviewer` in any of the files served
        def find():
            for db in _files(datasette):
                with _lock:
                    found = _store(db.path).reviewer_for_token(token)
                if found:
                    return found
            return None

        name = await asyncio.to_thread(find)
    if not name:
        page = await datasette.render_template(
            "stepmill_sign_in.html", {"refused": bool(token), "actor": request.actor}, request=request)
        return Response.html(page, status=403 if token else 200)
    response = Response.redirect("/-/stepmill/lifecycle")
    response.set_cookie("ds_actor", datasette.sign({"a": {"id": name, "stepmill": "reviewer"}}, "actor"),
                        httponly=True, samesite="lax")
    return response


REVIEW_ACTIONS = ("label", "trainable", "tag", "note", "reward")


def _holder(datasette, target: str):
    """The file that holds a review's target (a step or a trajectory)."""
    files = _files(datasette)
    for db in files:
        with _lock:
            store = _store(db.path)
            if views.holds(store, "steps", target) or views.holds(store, "trajectories", target):
                return db
    return files[0]  # an upstream response id or an unknown target: the store says what it is


def _locked(fn, store: Store):
    with _lock:
        return fn(store)


async def review(datasette, request):
    """A reviewer's decision from a step or trajectory page: one append-only row, then back to the page."""
    if request.method != "POST":
        return Response.text("POST a form", status=405)
    actor = request.actor
    if not actor or not actor.get("id"):
        return Response.html("<h1>Sign in to review</h1><p>Only signed-in reviewers read or write: sign in with "
                             "the link <code>stepmill reviewer NAME</code> prints.</p>", status=403)
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
        holder = await asyncio.to_thread(_holder, datasette, target)
        await asyncio.to_thread(lambda: _locked(write, _store(holder.path)))
    except NotFound:
        return Response.text(f"no step or trajectory {target!r}", status=404)
    except ValueError as exc:
        return Response.text(str(exc), status=400)
    following = form.get("next") or "/"
    return Response.redirect(following if following.startswith("/-/stepmill/") else "/")


async def _signed_in(datasette, scope, receive) -> bool:
    """Whether the request carries an actor, found the way Datasette's router finds it."""
    if scope.get("actor"):
        return True
    found = False
    for result in pm.hook.actor_from_request(datasette=datasette, request=Request(scope, receive)):
        try:
            found = bool(await await_me_maybe(result)) or found  # every coroutine awaited, as Datasette does
        except TokenInvalid:
            pass
    return found


def _refusal(path: str, method: str) -> Response:
    if path.endswith(".json"):
        return Response.json({"ok": False, "status": 403, "error": "Sign in to read: open the link `stepmill ui` "
                              "printed, or a `stepmill reviewer NAME` link"}, status=403)
    if method in ("GET", "HEAD"):
        return Response.redirect(SIGN_IN)
    return Response.html("<h1>Sign in first</h1>", status=403)


_SEARCHES = re.compile(rb"(^|[?&])_search|steps_fts")  # a table search, or SQL over the full-text index


def _searches(path: str, query: bytes) -> bool:
    """Whether a request reads the full-text index: the stored search query or the index's own table
    (any format), a table's search box, or SQL that names it."""
    return path.rpartition("/")[2].partition(".")[0] in ("search", "steps_fts") or bool(_SEARCHES.search(query))


def _index_search(datasette) -> None:
    """Every writable file's newest steps into its full-text index (the writer indexes within a
    second; a search answers with all of them)."""
    for db in _files(datasette):
        with _lock:
            try:
                store = _store(db.path)
                if not store.readonly:
                    store.index_search()
            except Exception as exc:  # locked past the timeout, no stepmill file: search what is indexed
                log.warning(f"stepmill: the search index of {db.path} could not be brought up to date "
                            f"({type(exc).__name__}: {exc})")


@hookimpl
def asgi_wrapper(datasette):
    """Nobody anonymous reads anything: every page, table, query and JSON API, ours and Datasette's
    (its own permissions leave some of them open, e.g. /-/versions.json)."""

    def wrap(app):
        async def signed_in_only(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1").partition("?")[0]
            base = datasette.setting("base_url")
            if base != "/" and path.startswith(base):
                path = "/" + path[len(base):]
            if _OPEN.match(path) or await _signed_in(datasette, scope, receive):
                if _searches(path, scope.get("query_string") or b""):
                    await asyncio.to_thread(_index_search, datasette)
                return await app(scope, receive, send)
            await _refusal(path, scope.get("method", "GET")).asgi_send(send)

        return signed_in_only

    return wrap


@hookimpl
def register_routes():
    return [
        (r"^/-/stepmill/steps/(?P<step_id>[^/]+?)(?P<ext>\.json)?$", step_view),
        (r"^/-/stepmill/trajectories/(?P<trajectory_id>[^/]+?)(?P<ext>\.json)?$", trajectory_view),
        (r"^/-/stepmill/groups/(?P<group_id>[^/]+?)(?P<ext>\.json)?$", group_view),
        (r"^/-/stepmill/lifecycle(?P<ext>\.json)?$", lifecycle_view),
        (r"^/-/stepmill/live(?P<ext>\.json)?$", live_view),
        (r"^/-/stepmill/training(?P<ext>\.json)?$", train_view),
        (r"^/-/stepmill/sign-in$", sign_in),
        (r"^/-/stepmill/review$", review),
    ]


@hookimpl
def prepare_jinja2_environment(env):
    env.filters["stepmill_text"] = content_text
    env.filters["stepmill_pretty_args"] = _pretty_arguments
    env.filters["stepmill_step_url"] = lambda value: stepmill_path("steps", value)
    env.filters["stepmill_trajectory_url"] = lambda value: stepmill_path("trajectories", value)
    env.filters["stepmill_group_url"] = lambda value: stepmill_path("groups", value)
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
        return Markup(f'{preview} <a href="{escape(stepmill_path("steps", row["id"]))}">read</a>')
    if table == "trajectories" and column == "id" and value:
        return Markup(f'{escape(value)} <a href="{escape(stepmill_path("trajectories", value))}">read</a>')
    return None


@hookimpl
def row_actions(datasette, database, table, row):
    if table == "steps":
        return [{"href": stepmill_path("steps", row["id"]), "label": "Read conversation",
                 "description": "Roles, tool calls and thinking of this step"}]
    if table == "trajectories":
        return [{"href": stepmill_path("trajectories", row["id"]), "label": "Read trajectory"}]
    return None
