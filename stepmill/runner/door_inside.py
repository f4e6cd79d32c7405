"""Inside a sandboxed run's network namespace, where nothing but loopback exists: listen on the
loopback ports the run was told (the proxy's, its reverse listener's, a white-box run's engine) and
carry each connection to the unix socket the runner keeps for it outside, then run the agent.

Standard library only, run with ``python -I`` by path: it starts before anything of the run, fast.

    door_inside.py --listen PORT=SOCKET [--listen …] -- COMMAND…
"""

import os
import signal
import socket
import subprocess
import sys
import threading


def pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def bridge(conn: socket.socket, path: str) -> None:
    with conn:
        try:
            outside = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            outside.connect(path)
        except OSError:
            return  # the door is closed: the run is ending
        with outside:
            back = threading.Thread(target=pump, args=(outside, conn), daemon=True)
            back.start()
            pump(conn, outside)
            back.join()


def serve(listener: socket.socket, path: str) -> None:
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=bridge, args=(conn, path), daemon=True).start()


def not_dumpable() -> None:
    """Like the white-box host: the run's own processes cannot open this one's descriptors through /proc."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def main(argv: list[str]) -> int:
    not_dumpable()
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    listeners = []
    for flag, spec in zip(options[::2], options[1::2]):
        if flag != "--listen":
            raise SystemExit(f"unknown option {flag}")
        port, _, path = spec.partition("=")
        listeners.append((socket.create_server(("127.0.0.1", int(port))), path))
    child = subprocess.Popen(command, close_fds=False, pass_fds=())  # the steps pipe of a white-box run goes on
    # What the child inherited (a white-box run's steps pipe) this process holds no longer.
    keep = {listener.fileno() for listener, _ in listeners}
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2 and int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass
    for listener, path in listeners:
        threading.Thread(target=serve, args=(listener, path), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda number, frame: child.send_signal(number))
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
