"""``isolation = container``: ``prefix`` (a container command, e.g. ``docker run --rm -i --network host
…``) runs before the agent's command; ``{workdir}``, ``{env_file}`` and ``{uid}`` are filled in. What the
run sees is the container's affair; its environment goes in a file only the runner reads (0600),
removed when the run ends."""

from __future__ import annotations

import os
from pathlib import Path

from stepmill.children import die_with_parent
from stepmill.runner.isolation.policy import Policy, RunPlace, Start


def container_command(command: list[str], prefix: list[str], *, workdir: Path, env_file: Path, uid: int) -> list[str]:
    values = {"{workdir}": str(workdir), "{env_file}": str(env_file), "{uid}": str(uid)}
    filled = []
    for part in prefix:
        for key, value in values.items():
            part = part.replace(key, value)
        filled.append(part)
    return filled + command


def write_env_file(path: Path, env: dict) -> None:
    """KEY=VALUE lines, as ``docker run --env-file`` and ``podman run --env-file`` read them."""
    lines = [f"{key}={value}" for key, value in env.items() if "\n" not in value and "=" not in key]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")


class Container(Policy):
    name = "container"

    @staticmethod
    def env_file(place: RunPlace) -> Path:
        return place.run_dir / "env"

    def start(self, place: RunPlace, command: list[str], env: dict, nproc: int) -> Start:
        write_env_file(self.env_file(place), env)
        return Start(container_command(command, self.isolation.prefix, workdir=place.workdir,
                                       env_file=self.env_file(place), uid=place.uid), die_with_parent)

    def end(self, place: RunPlace) -> None:
        self.env_file(place).unlink(missing_ok=True)  # its variables (keys the recipe gave) stay nowhere


POLICY = Container
