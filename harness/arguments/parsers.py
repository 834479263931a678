"""Every argparse type of the harness's verbs: the text of a flag -> its value, or an
argparse.ArgumentTypeError that says what was expected (harness.usage.Parser turns it into one usage line,
exit 2). A verb imports its types from here; the integer, seconds and fraction types are harness.usage's,
importable from here with the others."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from core.hooks import DELAYABLE_PARTS, FAULT_KINDS
from harness.usage import fraction, int_at_least, non_negative, positive, seconds

__all__ = [
    "exit_code",
    "fault_spec",
    "fraction",
    "gpu_counts",
    "gpu_list",
    "gpu_range",
    "hours",
    "int_at_least",
    "non_negative",
    "positive",
    "positive_or_max",
    "seconds",
    "tokens_count",
    "usd",
]


def named(parse: Callable, name: str) -> Callable:
    """`parse` under `name`, as argparse and a reader of a parser's actions show it."""
    parse.__name__ = parse.__qualname__ = name
    return parse


def quantity(
    name: str,
    such_as: str,
    bounded: str,
    valid: Callable[[float], bool],
    read: Callable[[str], float] = float,
) -> Callable[[str], float]:
    """An argparse type of one number: `read` turns the text into it (a ValueError: "expected SUCH_AS"),
    `valid` bounds it ("expected BOUNDED")."""

    def parse(text: str) -> float:
        try:
            value = read(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {such_as}, got '{text}'") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"expected {bounded}, got '{text}'")
        return value

    return named(parse, name)


SCALES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def scaled(text: str) -> float:
    """2e9, 2B, 300M: a float with an optional K/M/B/G/T suffix."""
    return float(text[:-1]) * SCALES[text[-1].upper()] if text[-1:].upper() in SCALES else float(text)


tokens_count = quantity(
    "tokens_count",
    "a token count such as 2e9 or 300B",
    "a positive token count",
    lambda v: v > 0,
    read=scaled,
)
usd = quantity("usd", "a price in USD such as 2.49", "a price >= 0", lambda v: v >= 0)
hours = quantity("hours", "hours such as 48", "positive hours", lambda v: v > 0)


def doublings(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... up to high."""
    if low < 1 or high < low:
        raise ValueError
    values = [low]
    while values[-1] * 2 <= high:
        values.append(values[-1] * 2)
    return values


def rank_counts(name: str, such_as: str, ranges: bool = False) -> Callable[[str], list[int]]:
    """An argparse type of rank counts, sorted, each once: comma-separated, and with `ranges` also LOW-HIGH
    (the powers of two times LOW up to HIGH)."""

    def parse(text: str) -> list[int]:
        try:
            if ranges and "-" in text:
                values = doublings(*(int(v) for v in text.split("-", 1)))
            else:
                values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected rank counts such as {such_as}, got '{text}'"
            ) from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"expected positive rank counts, got '{text}'")
        return sorted(set(values))

    return named(parse, name)


gpu_counts = rank_counts("gpu_counts", "8,32,128")
gpu_range = rank_counts("gpu_range", "8,16,32 or 8-256", ranges=True)


def gpu_list(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8], in the given order, duplicates dropped (a sweep runs them in that order)."""
    try:
        values = [positive(v.strip()) for v in text.split(",") if v.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got '{text}'"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one N")
    return list(dict.fromkeys(values))


def fault_spec(text: str) -> dict:
    """--inject-fault RANK:STEP:KIND, a test hook (core.hooks)."""
    try:
        rank, step, kind = text.split(":")
        fault = {"rank": int(rank), "step": int(step), "kind": kind}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP:KIND, got '{text}'") from None
    if kind not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(f"unknown fault kind '{kind}'; valid: {', '.join(FAULT_KINDS)}")
    return fault


def part_delay(text: str) -> tuple[str, float]:
    """--part-delay PART=SECONDS, a test hook (core.hooks): sleep in one part of every step."""
    part, _, delay = text.partition("=")
    if part not in DELAYABLE_PARTS:
        raise argparse.ArgumentTypeError(f"unknown part '{part}'; valid: {', '.join(DELAYABLE_PARTS)}")
    return part, seconds(delay)


FILL = "max"  # --micro-batch max: the largest micro-batch that fits the device (harness.run.fill)


def positive_or_max(text: str) -> int | str:
    """--micro-batch: a count of sequences, or "max" for the largest that fits the device."""
    if text == FILL:
        return FILL
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or '{FILL}', got '{text}'") from None


def exit_code(text: str) -> int:
    """An exit code a verb may be told to end with (`harness gate --inconclusive-exit`): 0 to 125, the codes
    a shell leaves to a program."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an exit code 0-125, got '{text}'") from None
    if not 0 <= value <= 125:
        raise argparse.ArgumentTypeError(f"expected an exit code 0-125, got {value}")
    return value
