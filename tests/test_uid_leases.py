"""The host uids runs become are leased machine-wide: two rollouts (or two Ray nodes) on one machine never
give one uid to two runs at once, so user mode's end of a run (every process of its uid killed) never
reaches another rollout's run; a runner killed lets go of its leases."""

import signal
import subprocess
import sys

from stepmill.runner.isolation import UidLeases

# A runner of its own: leases two uids, says which, and holds them until told to give one back.
RUNNER = """
import sys
from stepmill.runner.isolation import UidLeases
leases = UidLeases(int(sys.argv[1]))
first, second = leases.take(), leases.take()
print(first, second, flush=True)
sys.stdin.readline()
leases.give(first)
print("gave", first, flush=True)
sys.stdin.readline()
"""


def _runner(first_uid: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(first_uid)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_two_runners_never_hold_one_uid_and_a_killed_one_lets_go(tmp_path):
    first_uid = 3_000_000 + (hash(str(tmp_path)) % 1000) * 100  # far from any uid a rollout of this machine uses
    one = _runner(first_uid)
    try:
        held = [int(uid) for uid in one.stdout.readline().split()]
        assert held == [first_uid, first_uid + 1]
        here = UidLeases(first_uid)  # a second rollout, in this process
        assert here.take() == first_uid + 2, "a uid another runner holds was leased again"
        one.stdin.write("\n")
        one.stdin.flush()
        assert one.stdout.readline().split() == ["gave", str(first_uid)]
        assert here.take() == first_uid, "a uid given back was not leased again"
        one.send_signal(signal.SIGKILL)  # its lease of first_uid + 1 goes with it
        one.wait(10)
        assert here.take() == first_uid + 1, "a killed runner's lease outlived it"
        here.give(first_uid)
        assert here.take() == first_uid
    finally:
        one.kill()
        one.wait(10)
