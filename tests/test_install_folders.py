"""What of a program's install a sandboxed run is shown (stepmill/runner/isolation/files.py
``install_folders``): the folder of each program the command names, by path or by a bare word found on the
run's PATH (a shell line's ``exec "$0"`` starts one: Gemini CLI's, Qwen Code's and Aider's recipes)."""

import os
from pathlib import Path

from stepmill.runner.isolation.files import install_folders


def _npm_install(root: Path, program: str) -> Path:
    """An npm-style install: node_modules/.bin/<program> linking to the package's script."""
    package = root / "node_modules" / program
    package.mkdir(parents=True)
    script = package / "cli.js"
    script.write_text("#!/bin/sh\necho hello\n")
    script.chmod(0o755)
    (root / "node_modules" / ".bin").mkdir(exist_ok=True)
    (root / "node_modules" / ".bin" / program).symlink_to(f"../{program}/cli.js")
    return root / "node_modules" / ".bin"


def test_a_program_a_shell_line_starts_by_its_name_is_shown(tmp_path):
    bin_folder = _npm_install(tmp_path / "agents", "toolcli")
    search_path = os.pathsep.join([str(bin_folder), "/usr/bin", "/bin"])
    shown = install_folders(["sh", "-c", 'exec "$0" --yolo "$1"', "toolcli", "What is 2 + 2?"], search_path)
    assert tmp_path / "agents" in shown, shown  # the folder above node_modules: the whole install
    # without the PATH that holds it, the word names nothing: nothing of it is shown
    assert tmp_path / "agents" not in install_folders(["sh", "-c", 'exec "$0"', "toolcli"], "/usr/bin:/bin")


def test_a_task_text_is_never_looked_up_as_a_program(tmp_path):
    bin_folder = _npm_install(tmp_path / "agents", "toolcli")
    (bin_folder / "toolcli x").symlink_to("toolcli")  # a name with a space, as a task's text would be
    shown = install_folders(["sh", "-c", "echo", "toolcli x"], os.pathsep.join([str(bin_folder), "/usr/bin"]))
    assert tmp_path / "agents" not in shown, shown


def test_a_program_reached_through_a_chain_of_links_starts_in_the_sandbox(tmp_path):
    """CI links a checkout's .agents and .venv into its cache (and a cache may be a link again): every link
    on the way is made inside as on the host, so the run finds the program by the path it was given."""
    import subprocess

    from stepmill.runner.isolation.files import Private
    from stepmill.runner.isolation.sandbox import sandbox_command

    from .sandboxing import need_sandbox

    need_sandbox()
    bin_folder = _npm_install(tmp_path / "cache" / "agents-1", "toolcli")
    (tmp_path / "cache-link").symlink_to(tmp_path / "cache")  # the cache itself reached by a link
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".agents").symlink_to(tmp_path / "cache-link" / "agents-1")
    run_dir = tmp_path / "run"
    (run_dir / "work").mkdir(parents=True)
    program = checkout / ".agents" / bin_folder.relative_to(tmp_path / "cache" / "agents-1") / "toolcli"
    uid = {"uid": 65534} if os.geteuid() == 0 else {}
    command = sandbox_command([str(program)], run_dir=run_dir, private=Private([], []), **uid)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "hello\n"), done.stderr
