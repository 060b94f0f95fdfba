"""A measurement in a process of its own: `python -m <module>` reads one JSON request on
stdin and prints its JSON answer as the last line of stdout. Its own process so that a peak
resident set is that measurement's alone, and so that a crash (llama.cpp built for another
CPU dies of SIGILL) fails one measurement, not the benchmark."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Callable


def run_child(module: str, request: dict, what: str, timeout_s: float,
              died: Callable[[str], Exception] = RuntimeError) -> dict:
    """The child's answer to `request`; `what` names the work in errors, `died(signal name)`
    is raised when the child is killed by a signal."""
    try:
        proc = subprocess.run([sys.executable, "-m", module], input=json.dumps(request), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} took over {timeout_s} s; stopped") from None
    if proc.returncode < 0:
        raise died(signal.Signals(-proc.returncode).name)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
