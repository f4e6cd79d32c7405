"""The first thing inside a sandbox: make the run an unprivileged user of its own, then run it.

bubblewrap builds the sandbox (mounts, PID, IPC, UTS, network namespaces) as the runner's user;
when that is root, its first process is root too. This step, before anything of the run starts:

- makes ``/proc/sys`` (and ``/proc/sysrq-trigger``) read-only: nothing of the kernel's settings
  changes from inside, whoever asks;
- lets an unprivileged process listen on any port of the run's own network (its door's ports;
  ``--own-network`` only: the host's is never touched);
- becomes ``--uid``/``--gid`` (an unprivileged host uid, never 0) when started as root;
- enters a user namespace of its own, mapping only that uid: the run's ``root`` is nobody on the
  host, its user keyring and its count of processes (``RLIMIT_NPROC``) are its own, not its uid's;
- joins a new session keyring: no key of the runner's (nor of another run's) is in reach;
- holds the run to ``--nproc`` processes, enters its work folder (``--chdir``: the run's own, which
  root without its capabilities may not enter), then executes the command with no capability left.

Standard library only, run with ``python -I`` by path, single-threaded (``unshare`` of a user
namespace refuses a process with threads).

    sandbox_inside.py [--uid UID --gid GID] [--nproc N] [--chdir DIR] [--own-network] -- COMMAND…
"""

import ctypes
import os
import resource
import sys

CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
KEYCTL_JOIN_SESSION_KEYRING = 1
PR_SET_DUMPABLE = 4
SYS_KEYCTL = 250 if os.uname().machine == "x86_64" else 219  # aarch64's; user.py uses these too
READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger")

libc = ctypes.CDLL(None, use_errno=True)


def fail(what: str) -> None:
    error = ctypes.get_errno()
    raise SystemExit(f"stepmill sandbox: {what}: {os.strerror(error)}")


def read_only_proc() -> None:
    """Needs CAP_SYS_ADMIN over the sandbox's mount namespace, which bubblewrap gave this step alone."""
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
    for path in READ_ONLY:
        if not os.path.exists(path):
            continue
        if libc.mount(path.encode(), path.encode(), None, MS_BIND, None) != 0:
            fail(f"bind {path}")
        if libc.mount(None, path.encode(), None, flags, None) != 0:
            fail(f"remount {path} read-only")


def any_port() -> None:
    """The run's own network holds only its door: its ports below 1024 (an engine on :80) need no root."""
    try:
        with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", "w") as setting:
            setting.write("0")
    except OSError:
        pass  # a runner that is not root: its run's door listens on ports from 1024


def become(uid: int, gid: int) -> None:
    """From root to ``uid``: every capability goes with the change (no keep-caps). User mode's runs
    become their uid with this too (user.py)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def own_user_namespace() -> None:
    """A user namespace mapping only this process's own uid and gid (which the kernel lets any
    process map for itself): ``root`` inside is no one outside, setgroups is refused."""
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER) != 0:
        fail("a user namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)


def new_session_keyring() -> None:
    if libc.syscall(SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        fail("a session keyring")


def main(argv: list[str]) -> int:
    split = argv.index("--")
    own_network = "--own-network" in argv[:split]
    flags = [part for part in argv[:split] if part != "--own-network"]
    options = dict(zip(flags[::2], flags[1::2]))
    command = argv[split + 1:]
    if own_network:
        any_port()  # before /proc/sys is read-only
    if os.geteuid() == 0:  # else /proc/sys's files refuse the run by their modes (it is not root on the host)
        read_only_proc()
    if "--uid" in options:
        become(int(options["--uid"]), int(options["--gid"]))
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc/self files are its own again (uid_map)
    if os.geteuid() == 0:
        raise SystemExit("stepmill sandbox: a run never starts as root")
    own_user_namespace()
    if int(options.get("--nproc", 0)):
        limit = int(options["--nproc"])
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    new_session_keyring()
    if "--chdir" in options:
        os.chdir(options["--chdir"])
    os.execvp(command[0], command)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
