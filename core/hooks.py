"""Test hooks: what a test injects into a run to exercise what a real run rarely shows (a rank that fails
in a chosen way at a chosen step; a sleep added to every step, a slowdown the regression gate must catch).

They are no part of RunConfig, the configuration a user chooses: the harness writes them to the run
directory (HOOKS_FILE, beside config.json) only when one is set, every worker of that directory reads them
there, and the run record names them at its top level (`test_hooks`), so a faulted or slowed run can never
pass for a real one. A file rather than an environment variable, because not every launcher hands its
workers the harness's environment (horovodrun and mpirun over ssh pass only what they are told).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from core.records import write_json_atomic

HOOKS_FILE = "test_hooks.json"
FAULT_KINDS = ("raise", "exit", "sigkill", "sigstop", "hang", "oom")
# The parts of a step a test can delay (TestHooks.part_delays): the three a trainer times itself
# (backends.loop.Trainer.timed_part) and the gradient synchronisation of a synced step.
DELAYABLE_PARTS = ("forward", "backward", "optimizer", "comm")


@dataclass(frozen=True)
class TestHooks:
    """`fault`: {"rank", "step", "kind"} (kind one of FAULT_KINDS; a commbench run counts its (op, size)
    points as steps); `step_delay_s`: seconds of sleep inside every timed step; `warmup_transient_bytes`:
    memory each rank takes and frees before its first warm-up step (Trainer.hold_transient), so a test can
    tell a peak reset after warm-up from one that was not; `part_delays`: {part: seconds} slept inside one
    part of every step (DELAYABLE_PARTS), so a test can check that the step's anatomy moves that part by
    the delay and leaves the others."""

    __test__ = False  # a name pytest would otherwise take for a test class

    fault: dict | None = None
    step_delay_s: float = 0.0
    warmup_transient_bytes: int = 0
    part_delays: dict[str, float] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.fault or self.step_delay_s or self.warmup_transient_bytes or self.part_delays)

    def part_delay(self, part: str) -> float:
        """Seconds to sleep in `part` of every step (0 where no test asked)."""
        return self.part_delays.get(part, 0.0)

    def scaled(self, part: str, factor: float) -> TestHooks:
        """These hooks with `part`'s delay `factor` times as long (the same hooks where none is set)."""
        if not self.part_delay(part):
            return self
        return replace(self, part_delays={**self.part_delays, part: self.part_delays[part] * factor})

    def to_dict(self) -> dict | None:
        """What the record and the run directory hold: the hooks set, None when none is."""
        if not self.active:
            return None
        return {
            **({"fault": self.fault} if self.fault else {}),
            **({"step_delay_s": self.step_delay_s} if self.step_delay_s else {}),
            **({"warmup_transient_bytes": n} if (n := self.warmup_transient_bytes) else {}),
            **({"part_delays": dict(self.part_delays)} if self.part_delays else {}),
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> TestHooks:
        d = d or {}
        return cls(
            fault=d.get("fault"),
            step_delay_s=float(d.get("step_delay_s") or 0.0),
            warmup_transient_bytes=int(d.get("warmup_transient_bytes") or 0),
            part_delays={k: float(v) for k, v in (d.get("part_delays") or {}).items()},
        )

    def write(self, run_dir: Path) -> None:
        """Into `run_dir` when any is set; a directory without the file runs without hooks."""
        if self.active:
            write_json_atomic(Path(run_dir) / HOOKS_FILE, self.to_dict())

    @classmethod
    def read(cls, run_dir: Path) -> TestHooks:
        path = Path(run_dir) / HOOKS_FILE
        return cls.from_dict(json.loads(path.read_text())) if path.is_file() else NO_HOOKS


NO_HOOKS = TestHooks()
