"""Range-checked argparse types and the prompt as the user gave it.

Every numeric flag is parsed by one of these, so a value outside its range (or NaN) is
argparse's usual one-line error naming the flag, never a traceback further in. The prompt
is read as bytes (the command line's, or a file's) and decoded as UTF-8 strictly, so bytes
that are not UTF-8 are reported with their position rather than passed on as surrogates.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Callable

_DIGEST = re.compile(r"[0-9a-f]{64}\Z")


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An int in low..high (no upper bound when high is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high)}, got {value}")
        return value
    return parse


def number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False
           ) -> Callable[[str], float]:
    """A finite float in [low, high] (either end open when asked)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        above = value > low if low_open else value >= low
        below = high is None or (value < high if high_open else value <= high)
        if not (math.isfinite(value) and above and below):
            ends = f"{'(' if low_open else '['}{low:g}, " + (f"{high:g}{')' if high_open else ']'}" if high is not None
                                                             else "inf)")
            raise argparse.ArgumentTypeError(f"must be a finite number in {ends}, got {text}")
        return value
    return parse


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="print no progress or statistics on stderr, only errors")


def progress_printer(prog: str, quiet: bool) -> Callable[[str], None]:
    """Where progress goes: a `prog: message` line on stderr per stage (compiling and
    loading a large model take a while; the user sees what it is doing), none when quiet."""
    if quiet:
        return lambda msg: None
    return lambda msg: print(f"{prog}: {msg}", file=sys.stderr, flush=True)


def digest(text: str) -> str:
    if not _DIGEST.match(text):
        raise argparse.ArgumentTypeError(f"must be a 64-digit lowercase sha256 hex digest, got {text!r}")
    return text


def _range(low: int, high: int | None) -> str:
    return f"at least {low}" if high is None else f"in {low}..{high}"


class PromptError(ValueError):
    """A prompt that is not UTF-8 text."""


def argument_text(arg: str, flag: str) -> str:
    """A text argument as UTF-8: the bytes the command line carried, decoded strictly."""
    return _utf8(os.fsencode(arg), f"the argument of {flag}")


def file_text(path: str, flag: str) -> str:
    """A file's bytes (a pipe or /dev/stdin is fine: a user's own input), decoded strictly."""
    with open(path, "rb") as f:
        return _utf8(f.read(), f"the file {path} ({flag})")


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{where} is not valid UTF-8: byte {data[e.start]:#04x} at offset {e.start} "
                          f"({e.reason})") from None
