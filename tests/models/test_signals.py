"""Graceful stop: the first signal asks the work to stop; a second one ends the process at once, cleanly."""

import subprocess
import sys

CODE = """
import os, signal, time
from eyas.models.signals import GracefulStop
with GracefulStop(print, "stopping after this step") as stop:
    os.kill(os.getpid(), signal.SIG{name})
    assert stop, "the first signal only sets the flag"
    print("first handled", flush=True)
    os.kill(os.getpid(), signal.SIG{name})
    time.sleep(5)
    print("never reached")
"""


def test_a_second_signal_exits_with_its_status_and_no_traceback():
    for name, status in (("INT", 130), ("TERM", 143)):
        proc = subprocess.run([sys.executable, "-c", CODE.format(name=name)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == status, (name, proc.returncode, proc.stderr)
        assert "first handled" in proc.stdout and "never reached" not in proc.stdout
        assert "Traceback" not in proc.stderr and "aborting now" in proc.stdout
