"""Usage errors and exit codes, in one place: bad input is one line on stderr naming the valid choices and
exit 2, before anything launches (docs/measurement.md's conventions)."""

from __future__ import annotations

import argparse

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input: reported as one line, exit 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are UsageErrors (one line, exit 2) instead of argparse's exit."""

    def error(self, message):
        raise UsageError(message)


def choice(value: str, valid, what: str) -> str:
    if value not in valid:
        raise UsageError(f"unknown {what} '{value}'; valid: {', '.join(map(str, valid))}")
    return value


def int_at_least(lowest: int, what: str):
    """An argparse type: an integer >= `lowest`, its error saying `what` was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive = int_at_least(1, "a positive integer")
non_negative = int_at_least(0, "an integer >= 0")


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got '{text}'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """0.05 or 5%: a relative threshold or a significance level, strictly between 0 and 1."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.05 or 5%, got '{text}'") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a value between 0 and 1 (exclusive), got {text}")
    return value
