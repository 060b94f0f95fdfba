"""A measurement in a process of its own: `python -m <module>` reads one JSON request on
stdin and prints its JSON answer as the last line of stdout. Its own process so that a peak
resident set is that measurement's alone, and so that a crash (llama.cpp built for another
CPU dies of SIGILL) fails one measurement, not the benchmark. A Resident child stays loaded
and answers request after request: engines that take turns (the scale suite's decode bursts)."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
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


RESIDENT = "--resident"  # the flag a module's __main__ answers with serve_resident
ANSWER = "@answer "      # the prefix of the child's protocol lines (a library may print to stdout too)


class Resident:
    """A measurement process that stays loaded: its first request loads a model, each later
    one is answered in turn, until close. Two of them let two engines take turns seconds
    apart on one machine, where runs of their own sit minutes apart (this VM's memory
    bandwidth moves between such runs more than two engines differ)."""

    def __init__(self, module: str, request: dict, what: str, timeout_s: float):
        self.what, self.timeout_s = what, timeout_s
        self._stderr = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([sys.executable, "-m", module, RESIDENT], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ask(request)  # the load
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.startswith(ANSWER):
                self._lines.put(line[len(ANSWER):])
        self._lines.put(None)  # the child is gone

    def ask(self, request: dict) -> dict:
        """The child's answer to `request`."""
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.close()
            raise RuntimeError(f"{self.what} took over {self.timeout_s} s; stopped") from None
        if line is None:
            code = self._proc.wait()
            self._stderr.seek(0)
            raise RuntimeError(f"{self.what} failed (exit {code}): {self._stderr.read().strip()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()

    def __enter__(self) -> "Resident":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_resident(load: Callable[..., tuple[dict, Callable[..., dict]]]) -> None:
    """The child's side of Resident: load(**first request) gives its answer and the handler
    of every later request, answered one per line until stdin closes."""
    answer, handle = load(**json.loads(sys.stdin.readline()))
    print(ANSWER + json.dumps(answer), flush=True)
    for line in sys.stdin:
        print(ANSWER + json.dumps(handle(**json.loads(line))), flush=True)
