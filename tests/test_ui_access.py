"""`stepmill ui` shows nothing to anyone who has not signed in, on localhost too (agents on this
machine must not read answers or change rewards), and every id, whatever its characters, has
pages that open and links that lead to them."""

import json
import re
import subprocess
import urllib.parse
from html import unescape

import pytest
from hypothesis import given
from hypothesis import strategies as st
from markupsafe import escape as html_escape

from stepmill.store import StepRecord, Store
from stepmill.ui.datasette_plugin import register_routes, stepmill_path

from .browser import UI
from .conftest import STEPMILL

ANSWER = "the-answer-is-1729"
ODD_IDS = ["has space", 'has"quote', "café", "a/b", "what?", "hash#tag", "100%", "50%25", "run.json", "plus+tilde~"]
QUERY = "/steps/-/query.json?sql=" + urllib.parse.quote("select json_extract(metadata,'$.answer') from trajectories")


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    db = tmp_path_factory.mktemp("ui-access") / "steps.db"
    store = Store(str(db))
    for trajectory_id in ["plain", *ODD_IDS]:
        store.start_trajectory(trajectory_id=trajectory_id, metadata={"answer": ANSWER})
        messages = [{"role": "user", "content": f"task of {trajectory_id}"}]
        for turn in range(2):
            completion = {"role": "assistant", "content": f"turn {turn}"}
            store.record_step(StepRecord(api="openai.chat", model="m", trajectory_id=trajectory_id,
                                         messages=messages, completion=completion))
            messages = messages + [completion, {"role": "user", "content": "go on"}]
    store.close()
    with UI(db) as ui:
        yield ui


ANONYMOUS_PATHS = [
    "/", "/-/", "/-/versions.json", "/-/plugins.json", "/-/settings.json", "/-/config.json", "/-/databases.json",
    "/-/actor.json", "/-/schema.json", "/-/jump.json?q=tra", "/-/queries.json", "/-/api", "/-/allow-debug",
    "/-/patterns", "/-/permissions", "/steps", "/steps.json", "/steps.db", "/steps/trajectories",
    "/steps/trajectories.json", "/steps/trajectories/plain", "/steps/trajectories/plain.json",
    "/steps/-/query?sql=select+*+from+trajectories", "/steps/-/queries.json", "/steps/search.json?q=task",
    "/steps/-/schema.json", "/steps/unreviewed", "/-/stepmill/lifecycle", "/-/stepmill/lifecycle.json",
    "/-/stepmill/trajectories/plain", "/-/stepmill/trajectories/plain.json", "/steps/trajectories.csv",
]


def test_anonymous_visitors_read_nothing_on_localhost(ui):
    status, body, _ = ui.get(QUERY, anonymous=True)
    assert status == 403 and ANSWER not in body
    for path in ANONYMOUS_PATHS:
        status, body, headers = ui.get(path, anonymous=True)
        assert ANSWER not in body and "task of" not in body, path
        if path.endswith(".json") or ".json?" in path:
            assert status == 403, path
        else:  # a page: to the page that says how to sign in
            assert (status, headers["location"]) == (302, "/-/stepmill/sign-in"), path
    form = urllib.parse.urlencode({"target": "plain", "action": "reward", "value": "1"}).encode()
    assert ui.get("/-/stepmill/review", anonymous=True, data=form)[0] == 403
    status, page, _ = ui.get("/-/stepmill/sign-in", anonymous=True)
    assert status == 200 and "stepmill ui" in page and "stepmill reviewer NAME" in page and ANSWER not in page
    assert ui.get("/-/static/app.css", anonymous=True)[0] == 200
    assert ui.get("/-/auth-token?token=wrong", anonymous=True)[0] == 403


def test_signed_in_actors_read_root_and_named_reviewers(ui):
    status, body, _ = ui.get(QUERY)  # root, through the link `stepmill ui` printed
    rows = [list(row.values()) for row in json.loads(body)["rows"]]
    assert status == 200 and rows == [[ANSWER]] * (len(ODD_IDS) + 1)
    link = subprocess.run(STEPMILL + ["reviewer", "ana", "--db", str(ui.db), "--url", ui.base],
                          capture_output=True, text=True, check=True).stdout.strip()
    ana = ui.sign_in(link)
    status, body, _ = ui.get(QUERY, jar=ana)
    assert status == 200 and ANSWER in body
    for path in ["/", "/steps", "/steps/trajectories", "/steps/trajectories.json", "/steps/search.json?q=task",
                 "/-/stepmill/lifecycle", "/-/stepmill/trajectories/plain", "/-/stepmill/trajectories/plain.json"]:
        assert ui.get(path, jar=ana)[0] == 200, path
    form = urllib.parse.urlencode({"target": "plain", "action": "reward", "value": "0.5",
                                   "next": "/-/stepmill/trajectories/plain"}).encode()
    status, _, headers = ui.get("/-/stepmill/review", jar=ana, data=form)
    assert (status, headers["location"]) == (302, "/-/stepmill/trajectories/plain")
    assert Store(str(ui.db), readonly=True).trajectory("plain")["reward"] == 0.5


def _links(page: str, kind: str) -> list[str]:
    return [unescape(href) for href in re.findall(rf'href="(/-/stepmill/{kind}/[^"]*)"', page)]


def test_odd_ids_open_their_pages_and_links_lead_to_them(ui):
    for trajectory_id in ODD_IDS:
        url = stepmill_path("trajectories", trajectory_id)
        status, page, _ = ui.get(url)
        assert status == 200, (trajectory_id, url)
        assert f"Trajectory {escape(trajectory_id)}" in page
        status, body, _ = ui.get(stepmill_path("trajectories", trajectory_id, ".json"))
        assert status == 200 and json.loads(body)["trajectory"]["id"] == trajectory_id
        steps = [link for link in _links(page, "steps") if not link.endswith(".json")]
        assert len(steps) == 2, trajectory_id
        row = re.search(r'<a href="([^"]*)">row</a>', page).group(1)
        status, row_page, _ = ui.get(unescape(row))
        assert status == 200 and escape(trajectory_id) in row_page, row
        # Datasette's row page: the plugin's "read" link in the id cell and its "Read trajectory" action
        assert _links(row_page, "trajectories").count(url) == 2, _links(row_page, "trajectories")
        for step_link in steps:
            status, step_page, _ = ui.get(step_link)
            assert status == 200 and f"task of {escape(trajectory_id)}" in step_page, step_link
            assert url in _links(step_page, "trajectories")  # back to its trajectory
            status, _, _ = ui.get(unescape(re.search(r'<a href="([^"]*)">row</a>', step_page).group(1)))
            assert status == 200
        # the review form sends the id back as it is, and returns to the same page
        form = urllib.parse.urlencode({"target": trajectory_id, "action": "tag", "value": "odd",
                                       "next": url}).encode()
        status, _, headers = ui.get("/-/stepmill/review", data=form)
        assert (status, headers["location"]) == (302, url)
    # the "read" links of the steps table (its completion column)
    steps = ui.get("/steps/steps?_size=max")[1]
    for link in _links(steps, "steps"):
        assert ui.get(link)[0] == 200, link
    assert len(_links(steps, "steps")) == 2 * (len(ODD_IDS) + 1)


def escape(text: str) -> str:
    return str(html_escape(text))


ROUTES = {view.__name__: re.compile(pattern) for pattern, view in register_routes()}


@given(st.text(min_size=1), st.sampled_from(["", ".json"]))
def test_a_link_names_exactly_the_id_it_was_made_from(item_id, ext):
    for kind, view, key in (("steps", "step_view", "step_id"), ("trajectories", "trajectory_view", "trajectory_id")):
        path = stepmill_path(kind, item_id, ext)
        assert path.isascii() and not set(path) & set("?# \"<>")
        found = ROUTES[view].match(path)
        assert found and urllib.parse.unquote(found[key]) == item_id and (found["ext"] or "") == ext
