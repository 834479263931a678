"""One training step's collectives as a stack issues them: the single declaration that the analytic
communication volume (Backend.comm_pattern, which harness.analyze.metrics turns into bytes per rank) and the
prediction's replay (harness.predict.replay) both read, so the two cannot disagree. Framework-free: each
adapter builds its Schedule from the RunConfig alone (backends/<stack>/schedule.py).

A step is compute segments in order (Steps): for each micro-batch the embedding, each block and the head
forward, then backward in reverse; the optimizer step ends the step. A Schedule is a list of Terms, each one
kind of collective (op, element size, what it carries) issued as Calls. A call is ready at the end of
segment `after` (-1: the step's start) plus `delay_s`, and segment `before` cannot start until it has
finished (None: only the step's end waits). A term's analytic entry (CommTerm) is its calls summed, so the
volume a record states is exactly the messages the prediction prices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from core.config import RunConfig

MiB = 1024 * 1024


# ------------------------------------------------------------------------------------ the analytic volume
@dataclass(frozen=True)
class CommTerm:
    """One kind of collective a stack issues in every step: `op` over a tensor of `elements` elements of
    `dtype_bytes` bytes each (the whole tensor: under all_gather / reduce_scatter each rank holds 1/N of
    it), `per_step` times per optimizer step. harness.analyze.metrics turns terms into bytes per rank."""

    op: str
    elements: int
    dtype_bytes: int
    per_step: int
    what: str


@dataclass(frozen=True)
class CommPattern:
    """The analytic communication of one configuration, as the stack really behaves: its terms, and what
    the model of it assumes (settings it depends on)."""

    terms: tuple[CommTerm, ...]
    assumptions: str = ""


# ---------------------------------------------------------------------------------------- the step's segments
@dataclass(frozen=True)
class Segment:
    name: str
    phase: str  # "forward" | "backward" | "optimizer"
    unit: str  # "embed" | "block.<i>" | "head" | "optimizer"
    micro: int


def segments(cfg: RunConfig) -> list[Segment]:
    units = ["embed", *(f"block.{i}" for i in range(cfg.model.spec.n_layers)), "head"]
    out = []
    for m in range(cfg.batch.grad_accum):
        out += [Segment(f"fwd {u} mb{m}", "forward", u, m) for u in units]
        out += [Segment(f"bwd {u} mb{m}", "backward", u, m) for u in reversed(units)]
    out.append(Segment("optimizer", "optimizer", "optimizer", cfg.batch.grad_accum - 1))
    return out


def unit_of(name: str) -> str:
    """The segment whose backward produces a parameter's gradient: tok_emb is tied to the head, whose
    gradient is complete only after the embedding's backward."""
    if name.startswith("blocks."):
        return "block." + name.split(".")[1]
    return "head" if name.startswith("ln_f") else "embed"


class Steps:
    """Index of segments by (phase, unit, micro-batch)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.list = segments(cfg)
        self.index = {(s.phase, s.unit, s.micro): i for i, s in enumerate(self.list)}
        self.last = cfg.batch.grad_accum - 1
        self.optimizer = len(self.list) - 1

    def at(self, phase: str, unit: str, micro: int | None = None) -> int:
        return self.index[(phase, unit, self.last if micro is None else micro)]

    def first_backward(self, micro: int) -> int:
        return self.at("backward", "head", micro)

    def last_backward(self, micro: int) -> int:
        return self.at("backward", "embed", micro)


# ------------------------------------------------------------------------------------------ the declaration
@dataclass(frozen=True)
class Message:
    """One call as the replay prices it: `op` of nccl-tests size `size_bytes`."""

    op: str
    size_bytes: float
    after: int
    before: int | None
    what: str
    delay_s: float = 0.0


@dataclass(frozen=True)
class Call:
    """One call of a Term: `elements` of the term's dtype, ready after segment `after` (+ `delay_s`),
    needed by segment `before`; `what` labels it (default: the term's)."""

    elements: int
    after: int
    before: int | None
    what: str = ""
    delay_s: float = 0.0


@dataclass(frozen=True)
class Term:
    """One analytic term and the calls that carry it: `per_step` whole tensors of `op` a step, whose size
    is the calls' elements summed over `per_step` (a term whose calls do not make whole tensors is refused,
    as its volume would not be the one the calls send)."""

    op: str
    what: str
    dtype_bytes: int
    per_step: int
    calls: Sequence[Call]  # kept as a tuple

    def __post_init__(self):
        object.__setattr__(self, "calls", tuple(self.calls))
        total = sum(c.elements for c in self.calls)
        if self.per_step < 1 or total % self.per_step:
            raise ValueError(
                f"{self.op} of {self.what}: {total} elements in {len(self.calls)} call(s) are not "
                f"{self.per_step} whole tensor(s) a step"
            )

    @property
    def elements(self) -> int:
        return sum(c.elements for c in self.calls) // self.per_step

    def comm_term(self) -> CommTerm:
        return CommTerm(self.op, self.elements, self.dtype_bytes, self.per_step, self.what)

    def messages(self) -> list[Message]:
        return [
            Message(self.op, c.elements * self.dtype_bytes, c.after, c.before, c.what or self.what, c.delay_s)
            for c in self.calls
        ]


@dataclass(frozen=True)
class Schedule:
    """The collectives of one step: its terms (declared in the order the stack issues calls that are ready
    together), how they were modelled (`description`, shown with predictions), and the settings the model
    assumes (`assumptions`, recorded with the analytic volume). `kept_blocks`: the blocks a sharded stack
    keeps gathered from their forward to their backward (what the memory prediction counts whole)."""

    terms: tuple[Term, ...]
    description: str
    assumptions: str = ""
    kept_blocks: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self):
        object.__setattr__(self, "terms", tuple(self.terms))
        object.__setattr__(self, "kept_blocks", frozenset(self.kept_blocks))

    @property
    def messages(self) -> list[Message]:
        """Every call, in the order the stack issues them: by the segment each waits for, in the terms'
        order among calls ready at the same segment."""
        return sorted((m for t in self.terms for m in t.messages()), key=lambda m: m.after)

    def comm_pattern(self) -> CommPattern:
        """The analytic volume: one CommTerm per term (terms without calls leave none)."""
        return CommPattern(tuple(t.comm_term() for t in self.terms if t.calls), self.assumptions)


# ------------------------------------------------------------------------------- shared by several stacks
def buckets(tensors: list[tuple[str, int]], cap_bytes: float, first_cap_bytes: float, element_bytes: int):
    """Whole tensors in the order given, a bucket closed once it holds at least its cap (the first bucket's
    cap may be smaller), as torch DDP and paddle.DataParallel fill theirs: [(names, elements)]."""
    out: list[tuple[list[str], int]] = []
    current: list[str] = []
    count = 0
    for name, n in tensors:
        current.append(name)
        count += n
        if count * element_bytes >= (first_cap_bytes if not out else cap_bytes):
            out.append((current, count))
            current, count = [], 0
    if current:
        out.append((current, count))
    return out


def whole_tensors(
    cfg: RunConfig, terms: Iterable[CommTerm], description: str, assumptions: str = ""
) -> Schedule:
    """A schedule from analytic terms alone, for a stack whose issue order is not modelled: each term as
    `per_step` calls of its whole tensor, an all-gather's after the optimizer step and every other op's after
    the last backward (needed by the optimizer step), none overlapped with compute."""
    steps = Steps(cfg)
    out = []
    for t in terms:
        after = steps.optimizer if t.op == "all_gather" else steps.last_backward(steps.last)
        before = None if after == steps.optimizer else steps.optimizer
        out.append(
            Term(t.op, t.what, t.dtype_bytes, t.per_step, [Call(t.elements, after, before)] * t.per_step)
        )
    return Schedule(tuple(out), description, assumptions)


def gradients_after_backward(cfg: RunConfig, dtype_bytes: int) -> Schedule:
    """Data parallelism at its plainest: every gradient all-reduced once a step in one call after the last
    backward (no sync on the micro-batches before it), not overlapped: Backend.schedule's default."""
    return whole_tensors(
        cfg,
        [CommTerm("all_reduce", cfg.model.spec.n_params, dtype_bytes, 1, "gradients")],
        "one all-reduce of every gradient after backward (not overlapped)",
    )
