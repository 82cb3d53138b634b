"""The Ctrl-C benchmark (benchmarks.ctrl_c): its SIGINT probe on small programs that import no
torch (a real SIGINT to a process group; a program that ignores it is killed at the limit), the
verdict on a run's ending, and the user's program it times."""

import signal
import sys

from benchmarks import ctrl_c as bench

WAITS = """
import sys, threading
print("waiting", flush=True)
try:
    threading.Event().wait(600)
except KeyboardInterrupt:
    if sys.argv[1] == "uncaught":
        raise
    print("closed", flush=True)
"""

IGNORES = """
import signal, threading
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("waiting", flush=True)
threading.Event().wait(600)
"""


def test_sigint_ends_a_waiting_program_and_its_ending_is_checked():
    uncaught = bench.interrupt([sys.executable, "-c", WAITS, "uncaught"], group=False, settle=0.1)
    assert uncaught["returncode"] == -signal.SIGINT and uncaught["shown"], uncaught
    assert 0 < uncaught["seconds"] < bench.LIMIT_S
    assert bench.expected("uncaught", uncaught) is None
    caught = bench.interrupt([sys.executable, "-c", WAITS, "close"], settle=0.1)
    assert caught["returncode"] == 0 and caught["stdout"] == "closed\n", caught
    assert bench.expected("close", caught) is None
    assert bench.expected("uncaught", caught) == "exit status 0, stderr: ''"


def test_a_program_that_does_not_end_is_killed_at_the_limit():
    out = bench.interrupt([sys.executable, "-c", IGNORES], settle=0.1, limit=1.0)
    assert out["seconds"] == 1.0 and out["returncode"] == -signal.SIGKILL
    assert bench.expected("uncaught", out).startswith(f"exit status {-signal.SIGKILL}")


def test_the_users_program_compiles_and_guards_its_main():
    compile(bench.PROGRAM, "program.py", "exec")
    assert bench.PROGRAM.rstrip().endswith('if __name__ == "__main__":\n    main()')  # forkserver
    assert set(bench.CASES.values()) == {
        (0, "uncaught", True),
        (2, "uncaught", True),
        (2, "close", True),
        (2, "uncaught", False),
    }


def test_sigint_reaches_the_program_even_when_the_bench_ignores_it():
    """A bench started by ``cmd &`` in a script (no job control) ignores SIGINT, and so did
    every program it started (Python installs no KeyboardInterrupt handler then): each sample
    ran to the limit, the plain loop's too. The child starts with SIGINT's default."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as such a shell leaves it
    try:
        out = bench.interrupt([sys.executable, "-c", WAITS, "uncaught"], settle=0.1, limit=60.0)
    finally:
        signal.signal(signal.SIGINT, old)
    assert out["returncode"] == -signal.SIGINT and out["shown"], out
