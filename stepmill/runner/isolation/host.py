"""``isolation = none``: the agent runs as the runner does, on the host, and can read and change its
own data (the database, the dataset's answers, the proxy's files). Only its environment is chosen
(``environment.py``); every run says on stderr that it is not isolated."""

from __future__ import annotations

import sys

from stepmill.children import die_with_parent
from stepmill.runner.isolation.policy import Policy, RunPlace, Start

WARNING = ("stepmill: run {trajectory} is NOT isolated (isolation = none): the agent can read the "
           "database, the dataset's answers and the proxy's token, and change its own data")


class Host(Policy):
    name = "none"

    def start(self, place: RunPlace, command: list[str], env: dict, nproc: int) -> Start:
        print(WARNING.format(trajectory=place.trajectory), file=sys.stderr, flush=True)
        return Start(command, die_with_parent)


POLICY = Host
