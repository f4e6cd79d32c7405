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

from .sandboxing import need_sandbox
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
        need_sandbox()  # skips where bubblewrap cannot run, fails where only stepmill's sandbox cannot
        return None
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
    planted: list = field(default_factory=list)  # folders the test made outside its base, removed after
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


def start_stack(mode: str, logs: Path, sim_url: str, data_mb: int | None = None) -> Stack:
    """``data_mb``: the database (and the runs' folders, beside it) on a tmpfs of that size."""
    marker = f"{mode[:3]}{os.urandom(4).hex()}"
    base = Path(tempfile.mkdtemp(prefix="stepmill-adversarial-", dir="/var/tmp"))
    for folder in (base, base / "home", base / "data", base / "cfg"):
        folder.mkdir(exist_ok=True)
        folder.chmod(0o755)
    if data_mb is not None:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={data_mb}m,mode=1777", "tmpfs",
                                  str(base / "data")], capture_output=True, text=True, check=False)
        if mounted.returncode != 0:
            shutil.rmtree(base, ignore_errors=True)
            pytest.skip(f"a small tmpfs cannot be mounted here: {mounted.stderr.strip()}")
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
                concurrency: int, timeout: int = 120, route: str = "", isolation_extra: str = "",
                run_extra: str = "") -> Rollout:
    dataset = f"{name}-{stack.marker}"
    cfg = stack.base / "cfg"
    marker = stack.marker
    stack.private(cfg / f"{name}.jsonl", "".join(
        json.dumps({**task, "difficulty": "easy", "key_note": f"ANSWER-KEY-{marker}"}) + "\n" for task in tasks))
    isolation = f'mode = "{stack.mode}"' + (f"\nfirst_uid = {FIRST_UID}" if stack.mode == "user" else "")
    isolation += f"\n{isolation_extra}" if isolation_extra else ""
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
{run_extra}

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
    """Sandbox: not there at all (the runner's folders are no part of the run's file system); user
    mode: the file itself, root's and owner-only."""
    if mode == "sandbox":
        assert _error(stat) == "FileNotFoundError", stat
    else:
        assert stat["ok"], stat
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
    if mode == "sandbox":  # never root on the host: a root runner's runs are their slots' uids
        assert uids and 0 not in uids, uids


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
        assert _error(attempts["confdir_listing"]) == "FileNotFoundError"  # the runner's home is not there
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
            assert "victim.py" not in commands and "stepmill.cli" not in commands and " rollout " not in commands
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
        assert _error(attempts[f"{name}_read"]) == ("FileNotFoundError" if mode == "sandbox" else "PermissionError")
        _hidden_or_private(attempts[f"stat:{name}"], mode)
    assert _error(attempts["db_select"]) == "OperationalError"
    assert _error(attempts["db_write_human_reward"]) == "OperationalError"
    if mode == "sandbox":  # not there, or only as the way to the runs' folders beside it (nothing else in it)
        listing = attempts["db_folder_listing"]
        assert (not listing["ok"] and listing["error"] == "FileNotFoundError") or listing["value"] == [
            f"{stack.db.name}.runs"], listing
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
        if mode == "sandbox" and name != "ui:through_proxy":  # a network of its own: nothing there
            assert _error(got) == "ConnectionRefusedError", got
            continue
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
        assert _error(attempts[f"{name}_read"]) == ("FileNotFoundError" if mode == "sandbox" else "PermissionError")
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
        if mode == "sandbox" and name.startswith("reverse_"):  # its route has no reverse listener: no door to it
            assert _error(got) == "ConnectionRefusedError", (name, got)
            continue
        assert got["ok"], (name, got)
        assert got["value"]["status"] == 403, (name, got)
        assert got["value"]["body"]["error"]["type"] == "stepmill_refused", (name, got)
        assert not _steps_with(stack, f"HIJACK-{name}-{stack.marker}"), name
    victim, intruder = rollout.tid("t01", "victim"), f"intruder-{stack.marker}"
    refused = [line for line in stack.proxy_log.splitlines() if "stepmill: refused" in line]
    if mode == "sandbox":  # the proxy knows the run from its door: whatever it names but itself is refused
        attacker = rollout.tid("t01", "attacker")
        assert any(f"came through the door of run {attacker!r}" in line and repr(victim) in line for line in refused)
        assert any(f"came through the door of run {attacker!r}" in line and repr(intruder) in line for line in refused)
        return
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
    # sandbox: ENOENT (not there at all), or EACCES (the bare way to its own folder, not its to write)
    assert write["errno"] in ((2, 13) if mode == "sandbox" else (13,)), write
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


def test_a_white_box_line_no_engine_answer_backs_is_refused_and_none_sets_reward_version_or_trajectory(attacked):
    stack = attacked("sandbox")
    rollout, attacker, steps = _white(stack)
    assert "2 runs finished (1 failed, 0 timed out)" in rollout.done.stderr, rollout.done.stderr  # the forger's
    row = rollout.trajectories[attacker]
    assert row["metadata"]["submitted_steps"] == 2, row["metadata"]
    assert row["metadata"]["submit_errors"] == ["step 1: no engine answer carried these ids"], row["metadata"]
    assert len(steps) == 2, steps  # the first turn and the last: the forged line's ids came from no engine answer
    assert not _steps_with(stack, f"PIPE-FORGED-{stack.marker}")
    assert {s["model"] for s in steps} == {MODEL} and {s["policy_version"] for s in steps} == {f"pv-{stack.marker}"}
    assert {s["channel"] for s in steps} == {"train"} and {s["group_id"] for s in steps} == {f"{rollout.dataset}-t01-wb"}
    assert all(s["metadata"] in (None, {}) or "evil" not in json.dumps(s["metadata"]) for s in steps)
    victim = rollout.tid("t01", "victim")
    victim_steps = [s for s in _all_steps(stack) if s["trajectory_id"] == victim]
    assert len(victim_steps) == 1 and victim_steps[0]["channel"] == "train"
    store = _store(stack)
    try:
        ids = [s["step_id"] for s in steps] + [attacker]
        rewards = store.query(f"SELECT source, value FROM rewards WHERE target_id IN ({','.join('?' * len(ids))})", ids)
        assert all(r["source"] == "rule" and r["value"] != 5.0 for r in rewards), rewards
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
        # Pipes it can open through /proc are processes' standard streams (the task the runner fed, the
        # output the runner logs), never the steps pipe: what it wrote there never became a step (below).
        written = {where for where, got in attempts["proc_pipes"]["value"].items() if isinstance(got, dict) and got["ok"]}
        assert all(where.endswith(("/0", "/1", "/2")) for where in written), written
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


# -- credentials that die with the run -------------------------------------------------------------------------
def handoff_rollout(stack: Stack) -> Rollout:
    """Two runs at once: the t01 run serves its proxy credentials on loopback and ends; the t02 run takes
    them and, once t01 is over, calls as t01."""
    env = (f'{{ INSIDER_MARKER = "{stack.marker}", INSIDER_GIVE_ON = "t01", INSIDER_LATE_AFTER = "4", '
           f'INSIDER_GIVE_WAIT = "10", INSIDER_HANDOFF_PORT = "{free_port()}" }}')
    return run_rollout(stack, "handoff", agents=black_box("handoff", "handoff.py", env), run_agents=["handoff"],
                       tasks=TASKS, concurrency=2)


@pytest.fixture(scope="module")
def handed_over(simulated_llm, tmp_path_factory):
    """``handed_over(mode)``: the stack of that mode after the handoff rollout ran on it."""
    stacks: dict[str, Stack] = {}

    def get(mode: str) -> Stack:
        if mode == "sandbox":
            need_sandbox()
        if mode not in stacks:
            stack = stacks[mode] = start_stack(mode, tmp_path_factory.mktemp(f"handoff-{mode}"), simulated_llm.url)
            try:
                stack.rollouts["handoff"] = handoff_rollout(stack)
                if mode == "sandbox":
                    stack.rollouts["snoop"] = snoop_rollout(stack)
                    stack.rollouts["net"] = netprobe_rollout(stack)
            finally:
                stop_stack(stack)
        return stacks[mode]

    yield get
    for stack in stacks.values():
        for planted in stack.planted:
            shutil.rmtree(planted, ignore_errors=True)
        for row in [row for rollout in stack.rollouts.values() for row in rollout.trajectories.values()]:
            workdir = row["metadata"].get("workdir")
            if workdir and "stepmill-rollout-" in workdir:
                shutil.rmtree(Path(workdir).parent.parent, ignore_errors=True)
        shutil.rmtree(stack.base, ignore_errors=True)


def _finished_and_scored(rollout: Rollout, runs: int) -> None:
    assert rollout.done.returncode == 0, rollout.done.stderr
    assert f"{runs} runs finished (0 failed, 0 timed out)" in rollout.done.stderr, rollout.done.stderr
    assert f"reward math-{rollout.stack.marker}: scored {runs}" in rollout.done.stderr, rollout.done.stderr


def test_a_late_write_with_a_revoked_secret_is_403_and_writes_nothing(handed_over):
    """isolation = none shares the network, so the credentials do change hands: what stops the late call
    is that the giver's secret was revoked when its run ended (before scoring)."""
    stack = handed_over("none")
    rollout = stack.rollouts["handoff"]
    _finished_and_scored(rollout, 2)
    giver, taker = f"{rollout.dataset}-t01-0", f"{rollout.dataset}-t02-0"
    assert rollout.report(giver)["attempts"]["give"]["ok"], rollout.logs[giver]
    attempts = rollout.report(taker)["attempts"]
    assert attempts["take"]["ok"] and giver in attempts["take"]["value"]["proxy"], attempts
    late = attempts["late_call"]["value"]
    assert late["status"] == 403 and "has ended: its credentials were revoked" in late["body"]["error"]["message"], late
    assert not _steps_with(stack, f"LATE-HANDOFF-{stack.marker}")
    store = _store(stack)
    try:
        for trajectory in (giver, taker):  # each scored on its own one honest call
            assert store.query("SELECT count(*) AS n FROM steps WHERE trajectory_id = ?", [trajectory])[0]["n"] == 1
            [row] = [r for r in store.completed_trajectories(id_prefix=trajectory)]
            scored = trajectory_input(store, row)
            assert len(scored["steps"]) == 1 and row["reward"] == math_answer(scored)[0], row
    finally:
        store.close()
    assert any(f"run {giver!r} has ended: its credentials were revoked" in line
               for line in stack.proxy_log.splitlines() if "stepmill: refused" in line)


# -- files by allow-list -----------------------------------------------------------------------------------------
def plant_secrets(stack: Stack) -> dict[str, str]:
    """What the runner's user can read and a run must not: credentials in the runner's home (a
    PostgreSQL password file, Ray's cluster token, an SSH key) and files of other users and services
    under /home and /var. Path -> the secret in it."""
    marker = stack.marker
    planted = {stack.home / ".pgpass": f"db:5432:*:fleet:PGPASS-{marker}",
               stack.home / ".ray" / "auth_token": f"RAY-TOKEN-{marker}",
               stack.home / ".ssh" / "id_ed25519": f"SSH-KEY-{marker}",
               Path(f"/home/stepmill-planted-{marker}") / "notes.txt": f"HOME-FILE-{marker}",
               Path(f"/var/lib/stepmill-planted-{marker}") / "state.txt": f"VAR-FILE-{marker}"}
    for path, text in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not _within_base(stack, path):
            stack.planted.append(path.parent)
        path.write_text(text + "\n")
        path.chmod(0o600 if path.name in (".pgpass", "id_ed25519") else 0o644)
    return {str(path): text for path, text in planted.items()}


def _within_base(stack: Stack, path: Path) -> bool:
    return stack.base in path.parents


def snoop_rollout(stack: Stack) -> Rollout:
    secrets = plant_secrets(stack)
    folders = ["/", "/root", "/home", "/var", "/srv", "/opt", "/mnt", "/media", str(stack.home), "/etc/ssh",
               str(TESTS.parent), str(TESTS)]
    env = "{ " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in {
        "INSIDER_READ": json.dumps([*secrets, "/etc/shadow"]), "INSIDER_LIST": json.dumps(folders)}.items()) + " }"
    return run_rollout(stack, "snoop", agents=black_box("snoop", "snoop.py", env), run_agents=["snoop"],
                       tasks=TASKS[:1], concurrency=1)


def test_a_sandboxed_run_sees_no_home_no_var_no_secrets_of_the_runners_user(handed_over):
    stack = handed_over("sandbox")
    rollout = stack.rollouts["snoop"]
    _finished_and_scored(rollout, 1)
    attempts = rollout.report(f"{rollout.dataset}-t01-0")["attempts"]
    for name, got in attempts.items():
        if not name.startswith("read:"):
            continue
        # Not there at all (the runner's home, /home and /var are no part of the run's file system),
        # or /etc's secrets, covered.
        assert not got["ok"] or not got["value"]["text"].strip(), (name, got)
        if name != "read:/etc/shadow":
            assert got["error"] == "FileNotFoundError", (name, got)
    listed = {name[len("list:"):]: got for name, got in attempts.items() if name.startswith("list:")}
    # The system's trees, and the way to stepmill's interpreter and package folders (wherever the checkout is).
    ways = {path.parts[1] for path in [*iso.code_paths(), stack.home] if len(path.parts) > 1}
    assert set(listed["/"]["value"]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp",
                                         "usr", *ways}, listed["/"]
    # Of the checkout, only the package's folders and what the run's command is: no README, history, tests.
    checkout = listed[str(TESTS.parent)]
    assert checkout["ok"] and not {"README.md", "pyproject.toml", ".git", "bench", "Makefile"} & set(checkout["value"]), checkout
    assert set(listed[str(TESTS)]["value"]) <= {"adversary"}, listed[str(TESTS)]
    # Not there, or (the runs' folders beside the database, under /var/tmp here) only the bare way to its
    # own run folder: nothing else in it.
    own = Path(rollout.trajectories[f"{rollout.dataset}-t01-0"]["metadata"]["workdir"])
    for folder in ("/var", "/srv", "/opt", "/mnt", "/media", str(stack.home)):
        got = listed[folder]
        way = [p for p in own.parents if p.parent == Path(folder)]
        assert (not got["ok"] and got["error"] == "FileNotFoundError") or got["value"] == [w.name for w in way], (
            folder, got)
    for folder in ("/home", "/root"):  # at most the way to the interpreter and code runs use (CI's venv in ~/.cache)
        way_in = {path.relative_to(folder).parts[0] for path in iso.code_paths() if Path(folder) in path.parents}
        assert not listed[folder]["ok"] or not any("stepmill-planted" in entry or entry.startswith(".")
                                                   and entry not in way_in for entry in listed[folder]["value"]), listed
    assert listed["/etc/ssh"]["value"] == [], listed["/etc/ssh"]
    assert stack.marker not in json.dumps(rollout.logs).replace(f"-{stack.marker}", "")


# -- a network of its own ----------------------------------------------------------------------------------------
def netprobe_rollout(stack: Stack) -> Rollout:
    env = insider_env(stack, f"net-{stack.marker}", "net", "none", "none")
    return run_rollout(stack, "net", agents=black_box("probe", "netprobe.py", env), run_agents=["probe"],
                       tasks=TASKS[:1], concurrency=1)


def test_runs_in_a_sandbox_cannot_hand_each_other_credentials_over_loopback(handed_over):
    """Each sandboxed run has a network of its own: the giver's listener is in its namespace, the
    taker's connection in another, where nothing listens."""
    stack = handed_over("sandbox")
    rollout = stack.rollouts["handoff"]
    _finished_and_scored(rollout, 2)
    giver, taker = f"{rollout.dataset}-t01-0", f"{rollout.dataset}-t02-0"
    assert _error(rollout.report(giver)["attempts"]["give"]) == "TimeoutError", rollout.logs[giver]
    took = rollout.report(taker)["attempts"]
    assert _error(took["take"]) == "ConnectionRefusedError" and "late_call" not in took, took
    assert not _steps_with(stack, f"LATE-HANDOFF-{stack.marker}")
    for trajectory in (giver, taker):
        assert rollout.trajectories[trajectory]["metadata"]["outcome"] == "ok"


def _probe(stack: Stack) -> tuple[Rollout, dict]:
    rollout = stack.rollouts["net"]
    _finished_and_scored(rollout, 1)
    return rollout, rollout.report(f"{rollout.dataset}-t01-0")["attempts"]


def _refused(got: dict, why: str) -> None:
    assert got["ok"] and got["value"]["status"] == 403, got
    assert got["value"]["body"]["error"]["type"] == "stepmill_refused" and why in got["value"]["body"]["error"]["message"], got


def test_a_sandboxed_run_reaches_no_engine_admin_route_and_no_localhost_service(handed_over):
    """Straight (not through the proxy) nothing answers on the run's loopback but its door; through
    the proxy an engine's admin routes are refused to everyone, and a run reaches only its LLM."""
    stack = handed_over("sandbox")
    rollout, attempts = _probe(stack)
    for name in ("engine_admin_straight", "engine_chat_straight", "ui_straight"):
        assert _error(attempts[name]) == "ConnectionRefusedError", (name, attempts[name])
    _refused(attempts["engine_admin_proxied"], "admin routes")
    _refused(attempts["engine_admin_proxied_dotted"], "admin routes")
    assert attempts["engine_models_proxied"]["value"]["status"] == 200  # the LLM's own host: reachable
    _refused(attempts["ui_proxied"], "reaches only its LLM")
    _refused(attempts["internet_proxied"], "reaches only its LLM")
    assert attempts["health_proxied"]["value"] == {"status": 200, "body": {"ok": True}, "location": None}
    assert not _steps_with(stack, f"STRAIGHT-{stack.marker}")


def test_a_sandboxed_run_cannot_name_a_trajectory_of_its_own_invention(handed_over):
    """The proxy knows from the connection which run sent a call: credentials or a tagged path naming a
    trajectory nobody registered are refused; a call naming none is the run's own."""
    stack = handed_over("sandbox")
    rollout, attempts = _probe(stack)
    own = f"{rollout.dataset}-t01-0"
    for name in ("intruder_credentials", "intruder_path"):
        _refused(attempts[name], f"came through the door of run {own!r}")
    assert not _steps_with(stack, f"INTRUDER-")
    assert attempts["no_credentials"]["value"]["status"] == 200, attempts["no_credentials"]
    [anonymous] = _steps_with(stack, f"ANONYMOUS-{stack.marker}")
    assert anonymous["trajectory_id"] == own and anonymous["channel"] == "train"
    store = _store(stack)
    try:
        assert store.trajectory(f"intruder-{stack.marker}") is None
    finally:
        store.close()


# -- limits per run, and a rollout that survives its worst run --------------------------------------------------
HOG_TASKS = [{"id": f"t0{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 5)]


@pytest.fixture(scope="module")
def hogged(simulated_llm, tmp_path_factory):
    """A sandboxed rollout whose runs' folders live on a small tmpfs (16 MiB): at once a run that starts
    5,000 processes, one that allocates 1 GiB, one that writes 64 MiB to stdout, and an honest one."""
    need_sandbox()
    stack = start_stack("sandbox", tmp_path_factory.mktemp("hogged"), simulated_llm.url)
    small = stack.base / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=1777", "tmpfs", str(small)],
                             capture_output=True, text=True, check=False)
    try:
        if mounted.returncode != 0:
            pytest.skip(f"a small tmpfs cannot be mounted here: {mounted.stderr.strip()}")
        env = ('{ INSIDER_HOG_t01 = "fork", INSIDER_HOG_t02 = "memory", INSIDER_HOG_t03 = "flood", '
               'INSIDER_FORKS = "5000", INSIDER_MEGABYTES = "1024", INSIDER_FLOOD_MB = "64" }')
        try:  # the runs' root on the small tmpfs
            rollout = run_rollout(stack, "hog", agents=black_box("hog", "hog.py", env), run_agents=["hog"],
                                  tasks=HOG_TASKS, concurrency=4, timeout=90, run_extra=f'runs_dir = "{small}"',
                                  route="", isolation_extra="limits = { pids = 200, memory_mb = 256, log_kb = 64 }")
            # The flood's megabytes went through a 16 MiB tmpfs: say so in the test's terms.
            rollout.logs = {t: Path(r["metadata"]["workdir"], "agent.log").read_text(errors="replace")
                            for t, r in rollout.trajectories.items() if Path(r["metadata"].get("workdir", "/-"),
                                                                            "agent.log").exists()}
            stack.rollouts["hog"] = rollout
        finally:
            stop_stack(stack)
        yield stack
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
        shutil.rmtree(stack.base, ignore_errors=True)


def _hog(stack: Stack, task: str) -> tuple[dict, dict]:
    rollout = stack.rollouts["hog"]
    trajectory = f"{rollout.dataset}-{task}-0"
    return rollout.trajectories[trajectory], rollout


def test_each_hog_ends_its_own_run_and_the_others_finish_and_score(hogged):
    rollout = hogged.rollouts["hog"]
    assert rollout.done.returncode == 0, rollout.done.stderr[-3000:]
    assert "4 runs finished" in rollout.done.stderr and "reward math-" in rollout.done.stderr, rollout.done.stderr
    honest, _ = _hog(hogged, "t04")
    assert honest["metadata"]["outcome"] == "ok" and honest["reward"] is not None, honest
    for task in ("t01", "t02", "t03", "t04"):
        row, _ = _hog(hogged, task)
        assert row["status"] == "complete", row
        assert row["metadata"]["limits"]["via"] in ("cgroup v2", "cgroup v1", "rlimits"), row["metadata"]
        assert row["metadata"]["limits"]["pids"] == 200 and row["metadata"]["limits"]["memory_mb"] == 256


def test_a_fork_bomb_is_held_at_its_runs_process_limit(hogged):
    row, rollout = _hog(hogged, "t01")
    [started] = [r for r in rollout.reports(row["id"]) if "got" in r][:1]
    assert started["got"]["started"] < 200 and started["got"]["error"], started  # of 5,000
    if row["metadata"]["limits"]["via"] != "rlimits":
        assert "pids" in row["metadata"]["limits_hit"], row["metadata"]


def test_memory_beyond_the_limit_ends_that_run(hogged):
    row, rollout = _hog(hogged, "t02")
    assert row["metadata"]["outcome"] == "failed", row["metadata"]
    grown = [r["megabytes"] for r in rollout.reports(row["id"]) if r.get("stage") == "memory"]
    assert grown and max(grown) < 256, grown
    assert not any("got" in r for r in rollout.reports(row["id"])), "the hog got its gigabyte"
    if row["metadata"]["limits"]["via"] != "rlimits":
        assert "memory" in row["metadata"]["limits_hit"], row["metadata"]


def test_a_flood_of_output_is_capped_in_its_log_and_fills_no_disk(hogged):
    row, rollout = _hog(hogged, "t03")
    log = rollout.logs[row["id"]]
    assert len(log.encode()) < 3 * 64 * 1024, len(log)
    assert "bytes of this run's output cut here" in log
    assert rollout.report(row["id"])["got"] == {"megabytes": 64}  # the tail keeps its last report
    assert row["metadata"]["output_cut_bytes"] > 60 * 2**20, row["metadata"]


# -- a full disk ---------------------------------------------------------------------------------------------------
def test_a_run_that_fills_the_disk_fails_alone_and_the_same_command_finishes_once_space_is_back(simulated_llm,
                                                                                                   tmp_path):
    """The database, its journal and the runs' folders on one 48 MiB tmpfs; the first run answers
    honestly, the second answers, then fills the disk from its work folder and leaves the file there.
    The rollout does not crash: it says which runs were left open, and scores what it can (or says
    that scoring waits); nothing committed is lost. Once the file is gone, the same command runs
    what was left open and scores every run."""
    need_sandbox()
    stack = start_stack("sandbox", tmp_path, simulated_llm.url, data_mb=48)
    data = stack.base / "data"
    tasks = HOG_TASKS[:2]
    agents = black_box("hog", "hog.py", '{ INSIDER_HOG_t02 = "fill" }')
    try:
        full = run_rollout(stack, "fill", agents=agents, run_agents=["hog"], tasks=tasks, concurrency=1, timeout=90)
        said = full.done.stderr
        assert full.done.returncode == 0, said[-3000:]
        assert "2 runs finished (0 failed, 0 timed out)" in said and "Traceback" not in said, said[-3000:]
        # Whether the full disk stops the runner's last writes depends on where SQLite's WAL stood: after a
        # checkpoint it rewrites its frames in place and needs no new block. Either way nothing is lost.
        left_open = "1 of them left open: not every call of theirs could be committed" in said
        if left_open:
            assert "its revocation could not be recorded" in said, said[-3000:]
            # The honest run's reward is written, or (SQLite found no room) scoring says it waits.
            assert f"reward math-{stack.marker}: scored 1, failed 0" in said or (
                "not scored: " in said and "full" in said), said[-3000:]
        else:
            assert f"reward math-{stack.marker}: scored 2, failed 0" in said, said[-3000:]
        filler = next(data.rglob("filler.bin"))
        assert filler.stat().st_size > 16 * 2**20
        filler.unlink()  # space is back
        again = run_rollout(stack, "fill", agents=black_box("hog", "hog.py", "{ }"), run_agents=["hog"],
                            tasks=tasks, concurrency=1, timeout=90)
        assert again.done.returncode == 0, again.done.stderr[-3000:]
        rerun = "1 runs finished (0 failed, 0 timed out), 1 done earlier, of 2" if left_open else "2 done earlier, of 2"
        assert rerun in again.done.stderr, again.done.stderr
        if left_open:
            assert f"reward math-{stack.marker}: scored " in again.done.stderr, again.done.stderr
        for task in ("t01", "t02"):
            row = again.trajectories[f"{again.dataset}-{task}-0"]
            assert row["status"] == "complete" and row["reward"] is not None, row
        store = Store(str(stack.db), readonly=True)
        try:  # the call the filler made before it filled the disk is kept (an earlier attempt, out of the gate)
            n = store.query("SELECT count(*) AS n FROM steps WHERE trajectory_id = ?", [f"{again.dataset}-t02-0"])
            assert n[0]["n"] == (2 if left_open else 1), n
        finally:
            store.close()
    finally:
        stop_stack(stack)
        subprocess.run(["umount", "-l", str(data)], check=False)
        shutil.rmtree(stack.base, ignore_errors=True)


def test_a_run_with_a_disk_quota_fills_its_own_folder_alone(simulated_llm, tmp_path):
    """limits.disk_mb: a sandboxed run's folder is a tmpfs of that size; the filler runs out of room at
    8 MiB, the disk is untouched, and both runs finish and score as usual."""
    need_sandbox()
    stack = start_stack("sandbox", tmp_path, simulated_llm.url)
    try:
        rollout = run_rollout(stack, "quota", agents=black_box("hog", "hog.py", '{ INSIDER_HOG_t02 = "fill" }'),
                              run_agents=["hog"], tasks=HOG_TASKS[:2], concurrency=2, timeout=90,
                              isolation_extra="limits = { disk_mb = 8 }")
        said = rollout.done.stderr
        assert "2 runs finished (0 failed, 0 timed out)" in said and "left open" not in said, said[-3000:]
        assert f"reward math-{stack.marker}: scored 2, failed 0" in said, said[-3000:]
        filler = f"{rollout.dataset}-t02-0"
        got = rollout.report(filler)["got"]
        assert got["megabytes"] <= 8 and "No space left" in got["error"], got
        row = rollout.trajectories[filler]
        assert row["metadata"]["limits"]["disk_mb"] == 8 and row["reward"] is not None, row
        assert not Path(row["metadata"]["workdir"], "filler.bin").exists()  # gone with the run's tmpfs
    finally:
        stop_stack(stack)
        shutil.rmtree(stack.base, ignore_errors=True)


# -- the engine probe --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_first_call_with_a_wrong_key_does_not_leave_the_engine_recorded_as_no_engine(tmp_path):
    """A real vLLM started with --api-key: a run's first call carries a wrong key, so the proxy's probe
    of /v1/models (sent with the caller's key) is refused. That says nothing about the engine: the
    next call, with the right key, is probed again and gets exact ids."""
    import urllib.error
    import urllib.request

    from stepmill.demo.main import VLLMServer, vllm_python, write_random_qwen2
    from stepmill.qwen_vocab import default_folder

    from .real_engine import missing

    python = vllm_python()
    if python is None:
        missing("vLLM is not installed: run .ci/install-engines")
    key = f"sk-{os.urandom(8).hex()}"
    model = write_random_qwen2(tmp_path / "model", default_folder(), python=python)
    server = VLLMServer(model, tmp_path / "vllm.log", python=python, extra=("--api-key", key))
    port, confdir, db = free_port(), tmp_path / "mitm", tmp_path / "steps.db"
    proxy = subprocess.Popen(STEPMILL + ["proxy", "--port", str(port), "--db", str(db), "--confdir", str(confdir)],
                             stdout=(tmp_path / "proxy.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: answers(f"{server.root}/health") and answers(f"http://127.0.0.1:{port}"), timeout=900,
                   interval=1.0, what="vLLM and the proxy")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{port}"}))

        def ask(trajectory: str, api_key: str) -> int:
            body = json.dumps({"model": server.name, "max_tokens": 8,
                               "messages": [{"role": "user", "content": f"hello {trajectory}"}]}).encode()
            request = urllib.request.Request(f"{server.url}/chat/completions", data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {api_key}",
                "X-Stepmill-Trajectory": trajectory})
            try:
                with opener.open(request, timeout=120) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert ask("probe-wrong-key", "sk-wrong") == 401
        assert ask("probe-right-key", key) == 200
        wait_until(lambda: Store(str(db)).query("SELECT count(*) AS n FROM steps WHERE trajectory_id = ?",
                                                ["probe-right-key"])[0]["n"] == 1, timeout=30, what="the step")
        store = Store(str(db))
        try:
            [step] = store.query("SELECT token_provenance FROM steps WHERE trajectory_id = ?", ["probe-right-key"])
            assert step["token_provenance"] == "exact", (step, (tmp_path / "proxy.log").read_text()[-3000:])
        finally:
            store.close()
        assert "was refused (401) with the caller's key" in (tmp_path / "proxy.log").read_text()
    finally:
        proxy.terminate()
        proxy.wait(30)
        server.stop()
