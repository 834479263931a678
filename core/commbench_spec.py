"""CommbenchSpec: what `harness commbench` measures (which collectives, at which sizes, in which dtype, how
many times), with the collectives' names and the element types it knows.

Apart from RunConfig (core.config), which carries one as a dict in role.commbench, because only the
commbench side (its command, its workers, its record's schema) reads what is in it; framework-free like the
rest of core.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The collectives `harness commbench` measures, by the names nccl-tests and torch.distributed share.
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
COMMBENCH_DTYPES = {"fp32": 4, "bf16": 2}  # element bytes


@dataclass(frozen=True)
class CommbenchSpec:
    """What `harness commbench` measures: every op at every size, each timed `iters` times after `warmup`
    untimed calls, on every rank."""

    ops: tuple[str, ...]
    """Collectives, by COLLECTIVE_OPS' names, in the order they run."""
    sizes: tuple[int, ...]
    """Message sizes in bytes, as nccl-tests counts them: the whole buffer of all_reduce and broadcast, the
    gathered output of all_gather, the input that reduce_scatter splits, each rank's send buffer of
    all_to_all. Multiples of world size x element bytes, so every rank's share is whole."""
    dtype: str = "fp32"
    """Element type, a key of COMMBENCH_DTYPES."""
    iters: int = 20
    """Timed calls per op and size; the figures are medians over them."""
    warmup: int = 5
    """Untimed calls first (connection set-up, buffer registration, algorithm selection)."""

    @property
    def element_bytes(self) -> int:
        return COMMBENCH_DTYPES[self.dtype]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ops": list(self.ops), "sizes": list(self.sizes)}

    @classmethod
    def from_dict(cls, d: dict) -> CommbenchSpec:
        """From a record's config; settings this version no longer has (`under_load`, from records that
        also timed calls beside a compute thread) are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **{k: v for k, v in d.items() if k in known}
            | {"ops": tuple(d["ops"]), "sizes": tuple(d["sizes"])}
        )
