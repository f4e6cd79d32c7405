"""Adversarial: the agents `stepmill rollout` records are RL policies that run shell commands and will
take any path to their own reward. Here real agent processes (tests/adversary/), started by the real
runner against a real proxy, Datasette and the simulated LLM, try every such path as insiders (their
environment names the database, the confdir, the dataset, the journal, the UI and another run's
trajectory and group). Each test names a path and why it fails, checked twice: in what the attacker
reported it got, and in the database afterwards.

Every black-box attack runs with ``isolation = sandbox`` (bubblewrap) and ``isolation = user`` (a uid
per concurrent run). The runner's own files live outside /tmp (so the sandbox's own mounts hide them,
not its empty /tmp) in folders other users may enter (so in user mode file modes protect them, not
the folders around them). The runner has STEPMILL_TOKEN in its environment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from stepmill.store import Store
from stepmill.rewards.functions import math_answer
from stepmill.rewards.scoring import trajectory_input

from stepmill.runner import isolation as iso
from stepmill.children import free_port
from stepmill.auth.write_token import ensure_token

from .conftest import STEPMILL, TESTS, answers, http_json, wait_until

ADVERSARY = TESTS / "adversary"
SYSTEM_PYTHON = "/usr/bin/python3"  # stdlib only: reachable by other uids (the venv's may not be)
FIRST_UID = 62000
MODEL = "qwen-sim"
REPORT, LURKER_REPORT, TOOL_REPORT = "STEPMILL-ADVERSARY-REPORT ", "STEPMILL-LURKER-REPORT ", "STEPMILL-TOOL-REPORT "
TASKS = [{"id": "t01", "prompt": "What is 17 * 23 + 4?", "answer": "395"},
         {"id": "t02", "prompt": "What is (125 - 37) * 3?", "answer": "264"}]
REFUSED_HIJACKS = [
    "header_without_credentials", "header_intruder_in_victim_group", "credentials_victim_without_secret",
    "credentials_victim_guessed_secret", "credentials_victim_group_as_password",
    "credentials_intruder_in_victim_group", "path_victim_guessed_secret", "path_victim_group_with_own_credentials",
    "reverse_victim_guessed_secret", "reverse_victim_without_secret", "reverse_victim_group",
    "reverse_intruder_in_victim_group",
]
CONTROL_ENDPOINTS = ["stats", "own_trajectory", "victim_trajectory", "human_reward", "feedback", "submit_step",
                     "policy_version", "steal_victim_credentials", "complete_with_reward", "patch_metadata", "review"]


def _mode_problem(mode: str) -> str | None:
    if mode == "sandbox":
        return iso.bwrap_problem()
    if os.geteuid() != 0:
        return "isolation = user needs the runner to be root"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is needed: the agents of user mode run as other uids"
    return None


# -- the stack: proxy, Datasette, database, confdir, dataset, outside /tmp -------------------------------
@dataclass
class Stack:
    mode: str
    marker: str
    base: Path  # /var/tmp/stepmill-adversarial-…: what a user's project folder would be
    logs: Path  # the test's own logs (in pytest's private tmp)
    home: Path  # the runner's HOME; its ~/.mitmproxy is the confdir
    confdir: Path
    db: Path
    token: str
    port: int
    reverse_port: int
    ui_port: int
    sim_url: str
    processes: list = field(default_factory=list)
    rollouts: dict = field(default_factory=dict)
    proxy_log: str = ""

    @property
    def journal(self) -> Path:
        return Path(f"{self.db}.journal")

    def env(self, **extra) -> dict:
        """The runner's environment: no proxy of the test session's, the write token set."""
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != "SSL_CERT_FILE"}
        return {**env, "HOME": str(self.home), "STEPMILL_TOKEN": self.token, **extra}

    def private(self, path: Path, text: str) -> Path:
        """A file the test writes: world-readable for the sandbox (so hiding, not modes, protects it);
        owner-only in user mode (a dataset readable by others is refused there)."""
        path.write_text(text)
        path.chmod(0o644 if self.mode == "sandbox" else 0o600)
        return path


def start_stack(mode: str, logs: Path, sim_url: str) -> Stack:
    marker = f"{mode[:3]}{os.urandom(4).hex()}"
    base = Path(tempfile.mkdtemp(prefix="stepmill-adversarial-", dir="/var/tmp"))
    for folder in (base, base / "home", base / "data", base / "cfg"):
        folder.mkdir(exist_ok=True)
        folder.chmod(0o755)
    home = base / "home"
    confdir, db = home / ".mitmproxy", base / "data" / "steps.db"
    token = ensure_token(str(confdir))  # stepmill's own token file, as a first `stepmill proxy` leaves it
    Store(str(db)).close()
    parts = urllib.parse.urlsplit(sim_url)
    stack = Stack(mode, marker, base, logs, home, confdir, db, token, free_port(), free_port(), free_port(), sim_url)
    proxy_log = (logs / "proxy.log").open("wb")
    stack.processes.append(subprocess.Popen(
        STEPMILL + ["proxy", "--port", str(stack.port), "--db", str(db), "--confdir", str(confdir),
                    "--mode", f"regular@{stack.port}",
                    "--mode", f"reverse:{parts.scheme}://{parts.netloc}@{stack.reverse_port}",
                    "--set", "connection_strategy=lazy"],
        stdout=proxy_log, stderr=subprocess.STDOUT, env=stack.env()))
    stack.processes.append(subprocess.Popen(
        STEPMILL + ["ui", "--db", str(db), "--port", str(stack.ui_port)],
        stdout=(logs / "ui.log").open("wb"), stderr=subprocess.STDOUT, env=stack.env()))
    wait_until(lambda: http_json("GET", "http://stepmill.local/v1/health", proxy=f"http://127.0.0.1:{stack.port}")[0]
               == 200 if answers(f"http://127.0.0.1:{stack.port}") else False, timeout=90, interval=0.3,
               what="the proxy")
    wait_until(lambda: answers(f"http://127.0.0.1:{stack.ui_port}/"), timeout=90, interval=0.3, what="Datasette")
    return stack


def stop_stack(stack: Stack) -> None:
    for process in stack.processes:
        process.terminate()
    for process in stack.processes:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
    stack.proxy_log = (stack.logs / "proxy.log").read_text(errors="replace")


def kill_leftovers(marker: str) -> list[int]:
    """Processes the lurker agent of this test left behind (found by their marker): killed by pid."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"--leftover" in command and marker.encode() in command:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


# -- rollouts ---------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    stack: Stack
    dataset: str
    done: subprocess.CompletedProcess
    trajectories: dict  # id -> row (metadata parsed)
    logs: dict  # id -> agent.log text

    def reports(self, trajectory: str, tag: str = REPORT) -> list[dict]:
        return [json.loads(line[len(tag):]) for line in self.logs.get(trajectory, "").splitlines()
                if line.startswith(tag)]

    def report(self, trajectory: str, tag: str = REPORT) -> dict:
        found = self.reports(trajectory, tag)
        assert found, f"{trajectory} printed no report; its log:\n{self.logs.get(trajectory, '')[-3000:]}"
        return found[-1]

    def tid(self, task: str, agent: str) -> str:
        return f"{self.dataset}-{task}-{agent}-0"


def run_rollout(stack: Stack, name: str, *, agents: str, run_agents: list[str], tasks: list[dict],
                concurrency: int, timeout: int = 120, route: str = "") -> Rollout:
    dataset = f"{name}-{stack.marker}"
    cfg = stack.base / "cfg"
    marker = stack.marker
    stack.private(cfg / f"{name}.jsonl", "".join(
        json.dumps({**task, "difficulty": "easy", "key_note": f"ANSWER-KEY-{marker}"}) + "\n" for task in tasks))
    isolation = f'mode = "{stack.mode}"' + (f"\nfirst_uid = {FIRST_UID}" if stack.mode == "user" else "")
    config = stack.private(cfg / f"{name}.toml", f"""
[proxy]
url = "http://127.0.0.1:{stack.port}"
db = "{stack.db}"

[route]
base_url = "{stack.sim_url}"
{route}

{agents}

[[dataset]]
name = "{dataset}"
path = "{name}.jsonl"
public = ["difficulty"]

[isolation]
{isolation}

[run]
agent = {json.dumps(run_agents)}
dataset = "{dataset}"
n = 1
concurrency = {concurrency}
timeout = {timeout}
model = "{MODEL}"
policy_version = "pv-{marker}"

[[reward]]
name = "math-{marker}"
function = "stepmill.rewards.functions:math_answer"
""")
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=300, env=stack.env(), check=False)
    store = Store(str(stack.db))
    try:
        rows = store.query("SELECT * FROM trajectories WHERE id LIKE ? ORDER BY id", [f"{dataset}-%"])
    finally:
        store.close()
    trajectories, logs = {}, {}
    for row in rows:
        row = dict(row, metadata=json.loads(row["metadata"] or "{}"))
        trajectories[row["id"]] = row
        workdir = row["metadata"].get("workdir")
        if workdir and Path(workdir, "agent.log").exists():
            logs[row["id"]] = Path(workdir, "agent.log").read_text(errors="replace")
    return Rollout(stack, dataset, done, trajectories, logs)


def insider_env(stack: Stack, dataset: str, config_name: str, victim: str, victim_group: str, **extra) -> str:
    """What the attacker knows: where everything is, and another run's trajectory and group."""
    values = {
        "INSIDER_MARKER": stack.marker, "INSIDER_DB": str(stack.db), "INSIDER_JOURNAL": str(stack.journal),
        "INSIDER_CONFDIR": str(stack.confdir), "INSIDER_RUNNER_HOME": str(stack.home),
        "INSIDER_DATASET": str(stack.base / "cfg" / f"{config_name}.jsonl"),
        "INSIDER_CONFIG": str(stack.base / "cfg" / f"{config_name}.toml"),
        "INSIDER_UI": f"http://127.0.0.1:{stack.ui_port}", "INSIDER_REVERSE": f"http://127.0.0.1:{stack.reverse_port}",
        "INSIDER_VICTIM": victim, "INSIDER_VICTIM_GROUP": victim_group, **extra,
    }
    return "{ " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in values.items()) + " }"


def black_box(name: str, script: str, env: str) -> str:
    return f"""[[agent]]
name = "{name}"
command = ["{SYSTEM_PYTHON}", "{ADVERSARY / script}", "{{model}}"]
env = {env}
"""


def attack_rollout(stack: Stack) -> Rollout:
    """Two tasks; per task an honest victim and an attacker, concurrently. The t01 attacker attacks the
    t01 victim (which stays a while) and squats the t02 victim's trajectory id before it starts."""
    dataset = f"attack-{stack.marker}"
    victim, group = f"{dataset}-t01-victim-0", f"{dataset}-t01-victim"
    agents = (black_box("victim", "victim.py", '{ INSIDER_LINGER = "8", INSIDER_LINGER_ON = "t01" }')
              + black_box("attacker", "attack.py", insider_env(
                  stack, dataset, "attack", victim, group, INSIDER_ATTACK_ON="t01",
                  INSIDER_SQUAT=f"{dataset}-t02-victim-0",
                  INSIDER_WAIT_FOR_VICTIM="8" if stack.mode == "user" else "0")))
    return run_rollout(stack, "attack", agents=agents, run_agents=["victim", "attacker"], tasks=TASKS, concurrency=2)


def lurker_rollout(stack: Stack) -> Rollout:
    """One slot: the lurker's run ends first and leaves a process behind; the victim's run comes next
    (in user mode on the same uid, the only slot's)."""
    agents = (black_box("lurker", "lurker.py", f'{{ INSIDER_MARKER = "{stack.marker}", LURKER_WAIT = "40" }}')
              + black_box("victim", "victim.py", '{ INSIDER_LINGER = "5", INSIDER_LINGER_ON = "t01" }'))
    return run_rollout(stack, "lurk", agents=agents, run_agents=["lurker", "victim"], tasks=TASKS[:1], concurrency=1)


def white_box_rollout(stack: Stack) -> Rollout:
    dataset = f"white-{stack.marker}"
    victim, group = f"{dataset}-t01-victim-0", f"{dataset}-t01-victim"
    env = insider_env(stack, dataset, "white", victim, group, PYTHONPATH=str(TESTS.parent))
    agents = (black_box("victim", "victim.py", '{ INSIDER_LINGER_ON = "none" }')
              + f'[[agent]]\nname = "wb"\nentry = "tests.adversary.whitebox_attack:run"\nenv = {env}\n')
    return run_rollout(stack, "white", agents=agents, run_agents=["victim", "wb"], tasks=TASKS[:1], concurrency=2)


@pytest.fixture(scope="module")
def attacked(simulated_llm, tmp_path_factory):
    """``attacked(mode)``: the stack of that mode after every rollout ran on it (made once, lazily)."""
    stacks: dict[str, Stack] = {}

    def get(mode: str) -> Stack:
        problem = _mode_problem(mode)
        if problem:
            pytest.skip(problem)
        if mode not in stacks:
            stack = stacks[mode] = start_stack(mode, tmp_path_factory.mktemp(f"adversarial-{mode}"), simulated_llm.url)
            try:
                stack.rollouts["attack"] = attack_rollout(stack)
                stack.rollouts["lurk"] = lurker_rollout(stack)
                time.sleep(1.0)  # a leftover that stole credentials has sent its call by now
                if mode == "sandbox":
                    stack.rollouts["white"] = white_box_rollout(stack)
            finally:
                stop_stack(stack)  # the proxy's log is flushed when it stops
                # What a leftover wrote, it wrote to the lurker's log: read it again.
                for rollout in stack.rollouts.values():
                    for trajectory, row in rollout.trajectories.items():
                        log = Path(row["metadata"].get("workdir", "/nonexistent"), "agent.log")
                        if log.exists():
                            rollout.logs[trajectory] = log.read_text(errors="replace")
        return stacks[mode]

    yield get
    if os.environ.get("STEPMILL_ADVERSARIAL_KEEP"):  # debugging: keep the runs' folders and logs
        return
    for stack in stacks.values():
        kill_leftovers(stack.marker)
        roots = set()
        for rollout in stack.rollouts.values():
            for row in rollout.trajectories.values():
                workdir = row["metadata"].get("workdir")
                if workdir and "stepmill-rollout-" in workdir:
                    roots.add(Path(workdir).parent.parent)
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(stack.base, ignore_errors=True)


MODES = ["sandbox", "user"]


def _error(attempt: dict) -> str:
    assert not attempt["ok"], f"the attempt succeeded: {json.dumps(attempt)[:1500]}"
    return attempt["error"]


def _hidden_or_private(stat: dict, mode: str) -> None:
    """Sandbox: /dev/null is bound over the file (a device on a nodev mount: EACCES to open); user
    mode: the file itself, root's and owner-only."""
    assert stat["ok"], stat
    if mode == "sandbox":
        assert stat["value"]["char_device"] and stat["value"]["size"] == 0, stat
    else:
        assert stat["value"]["regular"] and stat["value"]["uid"] == 0 and stat["value"]["mode"] == "0o600", stat


def _store(stack: Stack) -> Store:
    return Store(str(stack.db))


def _all_steps(stack: Stack) -> list[dict]:
    store = _store(stack)
    try:
        return list(store.iter_steps())
    finally:
        store.close()


def _steps_with(stack: Stack, text: str) -> list[dict]:
    return [s for s in _all_steps(stack) if text in json.dumps(s)]


def _attacker(stack: Stack) -> tuple[Rollout, dict]:
    rollout = stack.rollouts["attack"]
    return rollout, rollout.report(rollout.tid("t01", "attacker"))["attempts"]


# -- the runs themselves -----------------------------------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_every_attacker_and_victim_runs_to_the_end_isolated(attacked, mode):
    stack = attacked(mode)
    rollout = stack.rollouts["attack"]
    assert rollout.done.returncode == 0, rollout.done.stderr
    assert "4 runs finished (0 failed, 0 timed out)" in rollout.done.stderr, rollout.done.stderr
    assert f"reward math-{stack.marker}: scored 4" in rollout.done.stderr
    assert len(rollout.trajectories) == 4
    uids = set()
    for trajectory, row in rollout.trajectories.items():
        assert row["status"] == "complete" and row["metadata"]["isolation"] == mode, row
        assert row["metadata"]["outcome"] == "ok", (row, rollout.logs.get(trajectory))
        report = rollout.report(trajectory)
        uids.add(report["uid"])
        if mode == "user":
            assert FIRST_UID <= report["uid"] < FIRST_UID + 2
    attacker = rollout.report(rollout.tid("t01", "attacker"))
    assert attacker["home"] == str(Path(attacker["cwd"]).parent / "home")  # a home of its own, in its run folder
    if mode == "sandbox":
        assert uids == {0}  # root in the sandbox, with no capabilities (see below)


# -- the write token ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_the_token_file_is_hidden_in_the_sandbox_and_owner_only_for_other_uids(attacked, mode):
    stack = attacked(mode)
    _, attempts = _attacker(stack)
    expected = "FileNotFoundError" if mode == "sandbox" else "PermissionError"
    assert _error(attempts["token_file_confdir"]) == expected
    assert _error(attempts["token_file_runner_home"]) == expected  # the confdir is the runner's ~/.mitmproxy
    assert _error(attempts["ca_key"]) == expected
    assert _error(attempts["token_file_own_home"]) == "FileNotFoundError"
    assert attempts["token_in_own_env"] is False
    if mode == "sandbox":
        assert attempts["confdir_listing"] == {"ok": True, "value": []}  # an empty tmpfs over it
    else:
        assert "stepmill-token" in attempts["confdir_listing"]["value"]  # seen, not read (0600)
        assert (stack.confdir / "stepmill-token").stat().st_mode & 0o077 == 0
    for rollout in stack.rollouts.values():
        assert stack.token not in json.dumps(rollout.logs)


@pytest.mark.parametrize("mode", MODES)
def test_no_other_process_environment_gives_the_token_or_a_run_secret(attacked, mode):
    """The runner, the proxy and Datasette have STEPMILL_TOKEN; the victim has its secret."""
    stack = attacked(mode)
    rollout, attempts = _attacker(stack)
    own = rollout.tid("t01", "attacker")
    for scan in ("environ_scan", "environ_scan_again"):
        seen = attempts[scan]["value"]
        for entry in seen:
            assert not entry.get("token"), entry
            assert entry.get("trajectory") in (None, own), entry  # a readable environment is only its own run's
        commands = " ".join(entry["cmdline"] for entry in seen)
        if mode == "sandbox":  # its own PID namespace: bwrap's init and its own processes only
            assert "victim.py" not in commands and "stepmill.cli" not in commands and "rollout" not in commands
            assert all("bwrap" in e["cmdline"] or "attack.py" in e["cmdline"] or "umount" in e["cmdline"]
                       for e in seen), seen
    if mode == "user":  # every process is visible; none but its own lets its environment be read
        seen = attempts["environ_scan"]["value"]
        victims = [e for e in seen if "victim.py" in e["cmdline"]]
        assert victims, "the victim was not running while the attacker looked"
        assert {e["environ"] for e in victims} == {"PermissionError"}
        runner = [e for e in seen if "rollout" in e["cmdline"] and "stepmill" in e["cmdline"]]
        assert runner and {e["environ"] for e in runner} == {"PermissionError"}
        proxy = [e for e in seen if " proxy " in e["cmdline"] and "stepmill" in e["cmdline"]]
        assert proxy and {e["environ"] for e in proxy} == {"PermissionError"}


# -- the database and its journal ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_the_database_can_be_neither_read_nor_written(attacked, mode):
    stack = attacked(mode)
    rollout, attempts = _attacker(stack)
    for name in ("db", "wal", "shm"):
        assert _error(attempts[f"{name}_read"]) == "PermissionError"
        _hidden_or_private(attempts[f"stat:{name}"], mode)
    assert _error(attempts["db_select"]) == "OperationalError"
    assert _error(attempts["db_write_human_reward"]) == "OperationalError"
    if mode == "sandbox":
        # The database's folder: a tmpfs of the run's own, with /dev/null over the names of its files
        assert set(attempts["db_folder_listing"]["value"]) <= {"steps.db", "steps.db-wal", "steps.db-shm"}
    else:
        assert {p.name for p in stack.db.parent.iterdir() if p.name.startswith("steps.db")} >= {"steps.db"}
        for path in stack.db.parent.iterdir():
            if path.name.startswith("steps.db") and path.is_file():
                assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by other users"
    store = _store(stack)
    try:
        assert store.query("SELECT count(*) AS n FROM rewards WHERE name = 'adversary' OR value = 5.0")[0]["n"] == 0
        assert store.trajectory(rollout.tid("t01", "attacker"))["reward"] != 5.0
    finally:
        store.close()


@pytest.mark.parametrize("mode", MODES)
def test_the_journal_folder_is_empty_in_the_sandbox_and_closed_to_other_uids(attacked, mode):
    stack = attacked(mode)
    _, attempts = _attacker(stack)
    if mode == "sandbox":  # gone with the database's folder (a tmpfs of the run's own over it), or empty
        listing = attempts["journal_listing"]
        assert listing == {"ok": True, "value": []} or listing["error"] == "FileNotFoundError", listing
        assert attempts["journal_read"] == {"ok": True, "value": {}} or _error(attempts["journal_read"]) == "FileNotFoundError"
    else:
        assert _error(attempts["journal_listing"]) == "PermissionError"
        assert _error(attempts["journal_read"]) == "PermissionError"
        assert _error(attempts["journal_write"]) == "PermissionError"
        assert stack.journal.stat().st_mode & 0o077 == 0
    assert not (stack.journal / f"evil-{stack.marker}").exists()  # whatever it wrote stayed in its sandbox


# -- Datasette and the control API --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_datasette_answers_an_anonymous_agent_nothing(attacked, mode):
    stack = attacked(mode)
    _, attempts = _attacker(stack)
    for name in ("ui:select_1", "ui:scoring_fields", "ui:table_json", "ui:db_json", "ui:through_proxy"):
        got = attempts[name]
        assert got["ok"], got
        answer = got["value"]
        assert answer["status"] in (302, 303, 401, 403), (name, answer)  # refused, or sent to sign in
        body = json.dumps(answer["body"])
        assert "ANSWER-KEY" not in body and '"rows"' not in body and "395" not in body, (name, answer)


@pytest.mark.parametrize("mode", MODES)
def test_health_tells_an_agent_only_that_the_proxy_is_alive(attacked, mode):
    stack = attacked(mode)
    _, attempts = _attacker(stack)
    for name in ("health_anonymous", "health_own_credentials"):
        assert attempts[name]["value"] == {"status": 200, "body": {"ok": True}, "location": None}, attempts[name]


@pytest.mark.parametrize("mode", MODES)
def test_every_other_control_endpoint_is_401_without_the_write_token(attacked, mode):
    stack = attacked(mode)
    rollout, attempts = _attacker(stack)
    for name in CONTROL_ENDPOINTS:
        for kind in ("control", "control_guessed_token"):
            got = attempts[f"{kind}:{name}"]["value"]
            assert got["status"] == 401 and "write token" in got["body"]["error"], (kind, name, got)
    store = _store(stack)
    try:
        assert store.policy_version() == f"pv-{stack.marker}"
        victim = store.trajectory(rollout.tid("t01", "victim"))
        assert store.curation(victim["id"])["review"]["label"] is None
        assert store.query("SELECT count(*) AS n FROM rewards WHERE source != 'rule'")[0]["n"] == 0
    finally:
        store.close()


# -- the answers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_the_dataset_and_the_configuration_are_unreadable(attacked, mode):
    stack = attacked(mode)
    rollout, attempts = _attacker(stack)
    for name in ("dataset", "config"):
        assert _error(attempts[f"{name}_read"]) == "PermissionError"
        _hidden_or_private(attempts[f"stat:{name}"], mode)
    own_files = attempts["own_run_folder"]["value"]
    assert not any("ANSWER-KEY" in text or "395" in text for text in own_files.values()), own_files
    folders = attempts["other_run_folders"]["value"]
    if mode == "sandbox":  # /tmp is empty but for its own run folder
        assert len(folders) == 1 and [len(listing["value"]) for listing in folders.values()] == [1], folders
    else:  # the runs' root can be entered, not listed
        assert folders and {listing.get("error") for listing in folders.values()} == {"PermissionError"}, folders
    for report in rollout.logs.values():
        assert f"ANSWER-KEY-{stack.marker}" not in report


@pytest.mark.parametrize("mode", MODES)
def test_answers_are_scoring_only_never_metadata(attacked, mode):
    stack = attacked(mode)
    rollout = stack.rollouts["attack"]
    store = _store(stack)
    try:
        for trajectory, row in rollout.trajectories.items():
            assert row["metadata"]["difficulty"] == "easy"  # public = ["difficulty"]
            assert "answer" not in row["metadata"] and "key_note" not in row["metadata"], row["metadata"]
            scoring = store.scoring_fields(trajectory)
            assert scoring["key_note"] == f"ANSWER-KEY-{stack.marker}" and scoring["answer"] in ("395", "264")
    finally:
        store.close()


# -- another run's trajectory and group ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_hijacking_another_run_by_header_credentials_or_path_is_403_and_writes_nothing(attacked, mode):
    stack = attacked(mode)
    rollout, attempts = _attacker(stack)
    for name in REFUSED_HIJACKS:
        got = attempts[f"hijack:{name}"]
        assert got["ok"], (name, got)
        assert got["value"]["status"] == 403, (name, got)
        assert got["value"]["body"]["error"]["type"] == "stepmill_refused", (name, got)
        assert not _steps_with(stack, f"HIJACK-{name}-{stack.marker}"), name
    victim, intruder = rollout.tid("t01", "victim"), f"intruder-{stack.marker}"
    refused = [line for line in stack.proxy_log.splitlines() if "stepmill: refused" in line]
    assert any(f"trajectory {victim!r} is a registered run" in line and "lacks" in line for line in refused)
    assert any(f"trajectory {victim!r} is a registered run" in line and "gets wrong" in line for line in refused)
    assert any("not tag headers" in line for line in refused)
    assert any(f"group '{rollout.dataset}-t01-victim' belongs to registered runs" in line and intruder in line
               for line in refused), refused


@pytest.mark.parametrize("mode", MODES)
def test_tag_headers_never_override_the_runs_own_credentials(attacked, mode):
    stack = attacked(mode)
    rollout, attempts = _attacker(stack)
    assert attempts["hijack:header_with_own_credentials"]["value"]["status"] == 200
    [step] = _steps_with(stack, f"HIJACK-header_with_own_credentials-{stack.marker}")
    assert step["trajectory_id"] == rollout.tid("t01", "attacker")
    assert step["group_id"] == f"{rollout.dataset}-t01-attacker" and step["channel"] == "train"


@pytest.mark.parametrize("mode", MODES)
def test_other_runs_keep_their_channel_group_and_steps(attacked, mode):
    stack = attacked(mode)
    rollout = stack.rollouts["attack"]
    victim = rollout.trajectories[rollout.tid("t01", "victim")]
    assert victim["channel"] == "train" and victim["group_id"] == f"{rollout.dataset}-t01-victim"
    steps = [s for s in _all_steps(stack) if s["trajectory_id"] == victim["id"]]
    assert len(steps) == 1 and "HIJACK" not in json.dumps(steps) and steps[0]["channel"] == "train"


@pytest.mark.parametrize("mode", MODES)
def test_no_intruder_trajectory_joins_a_registered_group(attacked, mode):
    stack = attacked(mode)
    rollout = stack.rollouts["attack"]
    store = _store(stack)
    try:
        for task, agent in (("t01", "victim"), ("t01", "attacker"), ("t02", "attacker")):  # t02-victim: see below
            group = f"{rollout.dataset}-{task}-{agent}"
            members = [r["id"] for r in store.query("SELECT id FROM trajectories WHERE group_id = ?", [group])]
            assert members == [f"{group}-0"], (group, members)
        assert store.trajectory(f"intruder-{stack.marker}") is None
        assert not store.query("SELECT id FROM steps WHERE trajectory_id = ?", [f"intruder-{stack.marker}"])
    finally:
        store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_later_runs_trajectory_id_cannot_be_taken_before_it_starts(attacked, mode):
    stack = attacked(mode)
    rollout, attempts = _attacker(stack)
    squatted = rollout.trajectories[rollout.tid("t02", "victim")]
    got = attempts["hijack:squat_future_trajectory"]["value"]
    assert squatted["channel"] == "train", (squatted["channel"], got["status"])
    assert squatted["group_id"] == f"{rollout.dataset}-t02-victim", (squatted["group_id"], got["status"])
    assert not _steps_with(stack, f"HIJACK-squat_future_trajectory-{stack.marker}"), got


# -- rewards ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_rewards_are_the_math_rules_alone(attacked, mode):
    stack = attacked(mode)
    store = _store(stack)
    try:
        for rollout in stack.rollouts.values():
            for trajectory in rollout.trajectories:
                rewards = store.query("SELECT * FROM rewards WHERE target_id = ? OR target_id IN "
                                      "(SELECT id FROM steps WHERE trajectory_id = ?)", [trajectory, trajectory])
                assert [(r["source"], r["name"]) for r in rewards] == [("rule", f"math-{stack.marker}")], rewards
                [row] = [r for r in store.completed_trajectories(id_prefix=trajectory) if r["id"] == trajectory]
                expected, _ = math_answer(trajectory_input(store, row))
                assert rewards[0]["value"] == expected == row["reward"], (trajectory, rewards, row["reward"])
        assert store.query("SELECT count(*) AS n FROM rewards WHERE value = 5.0 OR source = 'human'")[0]["n"] == 0
        assert store.query("SELECT count(*) AS n FROM steps WHERE policy_version = '999' OR model = 'evil-model' "
                           "OR reward = 5.0")[0]["n"] == 0
    finally:
        store.close()


# -- capabilities, mounts, the file system --------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_no_capability_no_unmount_no_write_outside_the_run(attacked, mode):
    stack = attacked(mode)
    _, attempts = _attacker(stack)
    caps = attempts["capabilities"]["value"]
    assert int(caps["CapEff"], 16) == 0 and int(caps["CapPrm"], 16) == 0, caps
    assert attempts["umount_confdir"]["value"]["result"] != 0
    assert attempts["umount_binary"]["value"]["rc"] != 0, attempts["umount_binary"]
    unshared = attempts["unshare_and_unmount"]["value"]
    assert unshared["umount2"]["result"] != 0 and not unshared["read"]["ok"], unshared
    assert _error(attempts["token_after_unmount"]) == ("FileNotFoundError" if mode == "sandbox" else "PermissionError")
    write = attempts["write_beside_db"]
    _error(write)
    assert write["errno"] == (30 if mode == "sandbox" else 13), write  # EROFS / EACCES
    assert not (stack.base / f"evil-{stack.marker}").exists()


# -- a process left behind ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_process_left_behind_by_one_run_cannot_reach_the_next(attacked, mode):
    stack = attacked(mode)
    rollout = stack.rollouts["lurk"]
    assert "2 runs finished (0 failed, 0 timed out)" in rollout.done.stderr, rollout.done.stderr
    lurker, victim = rollout.tid("t01", "lurker"), rollout.tid("t01", "victim")
    assert rollout.report(lurker)["leftover_pid"]
    left = rollout.reports(lurker, LURKER_REPORT)
    steps = [s for s in _all_steps(stack) if s["trajectory_id"] == victim]
    assert not _steps_with(stack, f"LURKER-{stack.marker}"), left
    assert len(steps) == 1, left
    # Sandbox: the run's PID namespace ended with it; user mode: the runner killed every process of the
    # run's uid when it ended. Either way the leftover was killed before the next run, never reported.
    assert left == [], left


# -- white-box agents (sandbox: the interpreter the host runs them with must be reachable by the run) -----------
def _white(stack: Stack) -> tuple[Rollout, str, list[dict]]:
    rollout = stack.rollouts["white"]
    attacker = rollout.tid("t01", "wb")
    steps = sorted((s for s in _all_steps(stack) if s["trajectory_id"] == attacker), key=lambda s: s["step_index"])
    return rollout, attacker, steps


def test_a_white_box_line_gives_only_ids_and_engine_output_never_reward_version_model_or_trajectory(attacked):
    stack = attacked("sandbox")
    rollout, attacker, steps = _white(stack)
    assert "2 runs finished (0 failed, 0 timed out)" in rollout.done.stderr, rollout.done.stderr
    row = rollout.trajectories[attacker]
    assert row["metadata"]["submitted_steps"] == 3 and "submit_errors" not in row["metadata"], row["metadata"]
    assert len(steps) == 3, steps  # first turn, the forged line, the last turn
    forged = steps[1]
    assert forged["completion"]["content"] == f"PIPE-FORGED-{stack.marker}"  # ids and engine output: taken
    assert forged["model"] == MODEL and forged["policy_version"] == f"pv-{stack.marker}"
    assert forged["channel"] == "train" and forged["group_id"] == f"{rollout.dataset}-t01-wb"
    assert forged["metadata"] in (None, {}) or "evil" not in json.dumps(forged["metadata"])
    assert {s["model"] for s in steps} == {MODEL} and {s["policy_version"] for s in steps} == {f"pv-{stack.marker}"}
    victim = rollout.tid("t01", "victim")
    victim_steps = [s for s in _all_steps(stack) if s["trajectory_id"] == victim]
    assert len(victim_steps) == 1 and victim_steps[0]["channel"] == "train"
    store = _store(stack)
    try:
        ids = [s["step_id"] for s in steps] + [attacker]
        rewards = store.query(f"SELECT source, value FROM rewards WHERE target_id IN ({','.join('?' * len(ids))})", ids)
        assert [r["source"] for r in rewards] == ["rule"] and rewards[0]["value"] != 5.0, rewards
    finally:
        store.close()


def test_white_box_step_lines_on_stdout_are_never_submitted(attacked):
    stack = attacked("sandbox")
    rollout, attacker, _ = _white(stack)
    log = rollout.logs[attacker]
    assert log.count(f"STDOUT-FORGED-{stack.marker}") >= 3 and f"TOOL-STDOUT-popen-{stack.marker}" in log
    for text in ("STDOUT-FORGED", "TOOL-STDOUT", "TOOL-FORGED"):
        assert not _steps_with(stack, f"{text}"), text


def test_a_white_box_tool_cannot_reach_the_steps_pipe(attacked):
    stack = attacked("sandbox")
    rollout, attacker, _ = _white(stack)
    tools = rollout.reports(attacker, TOOL_REPORT)
    assert {t["how"] for t in tools} == {"popen", "system"}, rollout.logs[attacker][-3000:]
    for tool in tools:
        attempts = tool["attempts"]
        assert attempts["steps_fd_in_env"]["value"] is None
        assert _error(attempts["write_named_fd"]) == "OSError" and attempts["write_named_fd"]["errno"] == 9  # EBADF
        assert not any(target.startswith("pipe:") for target in attempts["own_fds"]["value"].values()), attempts
        assert _error(attempts["parent_fd_open"]) == "PermissionError"  # the host is not dumpable
        assert _error(attempts["parent_mem"]) == "PermissionError"
        assert attempts["ptrace_parent"]["value"]["result"] != 0
        # Pipes it can open through /proc are processes' standard input (the task the runner fed),
        # never the steps pipe: what it wrote there never became a step (below).
        written = {where for where, got in attempts["proc_pipes"]["value"].items() if isinstance(got, dict) and got["ok"]}
        assert all(where.endswith("/0") for where in written), written
    assert not _steps_with(stack, "TOOL-FORGED")


# -- user mode refuses what it cannot protect ------------------------------------------------------------------
def test_user_mode_refuses_a_dataset_other_users_can_read(proxy, tmp_path):
    problem = _mode_problem("user")
    if problem:
        pytest.skip(problem)
    (tmp_path / "tasks.jsonl").write_text(json.dumps(TASKS[0]) + "\n")
    (tmp_path / "tasks.jsonl").chmod(0o644)
    config = tmp_path / "rollout.toml"
    config.write_text(f'[proxy]\nurl = "{proxy.url}"\ndb = "{proxy.db}"\nconfdir = "{proxy.confdir}"\n\n'
                      f'[[agent]]\nname = "a"\ncommand = ["{SYSTEM_PYTHON}", "-c", "print(1)"]\n\n'
                      '[[dataset]]\nname = "readable"\npath = "tasks.jsonl"\n\n'
                      f'[isolation]\nmode = "user"\nfirst_uid = {FIRST_UID}\n\n[run]\nagent = "a"\ndataset = "readable"\n')
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode != 0 and "is readable by other users" in done.stderr, done.stderr
    store = proxy.store()
    try:
        assert not store.query("SELECT id FROM trajectories WHERE id LIKE 'readable-%'")
    finally:
        store.close()
