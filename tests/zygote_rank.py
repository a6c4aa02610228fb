"""A rank of a test's mpirun, as ``python ARGV`` would be, forked from the test process's
rank zygote (tests/zygote.py, ``serve_ranks``) rather than started afresh: mpirun starts
this stub (standard library only, no torch: some 40 ms of CPU against 2 s), which hands
the rank's environment, working directory, arguments and descriptors 0-2 to the server,
passes on every signal it can catch to the forked rank, and ends as the rank ends (its
exit status, or death by the same signal). Killed outright, it takes the rank with it.
Without the server (``FEDMPI_TEST_RANK_ZYGOTE`` unset or gone), with arguments other than
``-m MODULE ...`` or ``SCRIPT ...``, or where the server says the rank's environment
changes what an interpreter reads at start-up, it execs ``python ARGV`` itself: the same
pid, a fresh interpreter."""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGALRM)


def fresh(argv):
    os.execv(sys.executable, [sys.executable, *argv])


def main(argv) -> int:
    path = os.environ.get("FEDMPI_TEST_RANK_ZYGOTE")
    if not path or not argv or (argv[0].startswith("-") and (argv[0] != "-m" or len(argv) < 2)):
        fresh(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        answer = json.loads(sock.recv(4096) or b'{"fresh": true}')
    except OSError:   # the server has ended (its test process with it)
        answer = {"fresh": True}
    if answer.get("fresh"):
        sock.close()
        fresh(argv)
    child = answer["pid"]

    def forward(signum, frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    message = sock.recv(4096)   # the status, once the rank has ended (retried after signals)
    status = json.loads(message)["status"] if message else 1
    if status < 0:   # died by a signal: so does the stub, for mpirun to see
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
