"""argparse `type=` helpers for the `eyas` commands: a bad value is refused while parsing, naming the option
and what it accepts (argparse prints `eyas CMD: error: argument --X: ...` and exits 2); and the options that
commands of several packages share. No torch here."""

from __future__ import annotations

import argparse
import json
from typing import Callable


def _number(kind: type, value: str) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {value!r}") \
            from None


def ranged(kind: type = int, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], int | float]:
    """A number in [low, high] (a bound is excluded when `*_open`; None: unbounded)."""
    if kind is int and low is not None and not low_open and high is None:
        wanted = f"at least {low:g}" if low >= 1 else f">= {low:g}"
    elif high is None:
        wanted = f"{'>' if low_open else '>='} {low:g}"
    else:
        wanted = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(value: str) -> int | float:
        x = _number(kind, value)
        if x != x or (low is not None and (x < low or (low_open and x == low))) or (
                high is not None and (x > high or (high_open and x == high))):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return x

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value" messages
    return parse


positive = ranged(int, 1)  # counts: tokens, rows, threads, steps
non_negative = ranged(int, 0)  # limits where 0 means none, seeds
non_negative_float = ranged(float, 0)  # temperatures, held-out fractions
probability = ranged(float, 0, 1)  # min-p
nucleus = ranged(float, 0, 1, low_open=True)  # top-p: 0 would keep nothing
positive_float = ranged(float, 0, low_open=True)  # penalties, timeouts


def int_or_auto(value: str) -> int | str:
    """A positive integer or `auto` (--total-tokens)."""
    if value == "auto":
        return value
    try:
        return positive(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1 or `auto`, got {value!r}") from None


def layer_ids(value: str) -> tuple[int, ...]:
    """Comma-separated layer indices, e.g. 2,15,27 (checked against the target when it is loaded)."""
    try:
        ids = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 2,15,27, got {value!r}") \
            from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"layer indices are >= 0, got {value!r}")
    return ids


def tree_paths(value: str) -> list[list[int]]:
    """A static draft tree as JSON: a list of paths, each a list of child ranks, e.g. [[0],[1],[0,0]]."""
    example = 'e.g. "[[0],[1],[0,0]]"'
    try:
        paths = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}); {example}") from None
    if not isinstance(paths, list) or not paths or not all(isinstance(p, list) and p for p in paths):
        raise argparse.ArgumentTypeError(f"expected a list of paths (non-empty lists of child ranks), {example}")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for p in paths for i in p):
        raise argparse.ArgumentTypeError(f"child ranks must be non-negative integers, {example}")
    return paths


def http_url(value: str) -> str:
    """A server address, e.g. http://localhost:8000/v1."""
    if not value.startswith(("http://", "https://")) or " " in value:
        raise argparse.ArgumentTypeError(f"expected a URL like http://localhost:8000/v1, got {value!r}")
    return value


def add_compile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="the target's decode steps through torch.compile: faster steps after a warm-up of a few "
                   "minutes (SmolLM2-135M on 2 CPU cores), so worth it for long runs (bench, regeneration); greedy "
                   "fp32 output stays token-identical to generate; on a GPU the steps have fixed shapes and run as "
                   "CUDA graphs (default: eager)")
