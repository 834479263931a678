"""Horovod's options (framework-free): what the adapter, its schedule and its worker read."""

from dataclasses import dataclass

from backends.base import option
from backends.torch_tuning import TorchTuning

COMPRESSIONS = ("none", "fp16")


@dataclass(frozen=True)
class HorovodOptions(TorchTuning):
    compression: str = option(
        "none",
        "--hvd-compression",
        choices=COMPRESSIONS,
        help="compress gradients to fp16 for the all-reduce",
    )
    # Horovod 0.28's defaults (horovod/common/operations.cc; its docs still say 64 MiB and 5 ms)
    fusion_threshold_mb: int = option(
        128, "--hvd-fusion-mb", type=int, help="tensor fusion buffer in MiB (HOROVOD_FUSION_THRESHOLD)"
    )
    cycle_time_ms: float = option(
        1.0, "--hvd-cycle-ms", type=float, help="background thread's cycle in ms (HOROVOD_CYCLE_TIME)"
    )
    autotune: bool = option(
        False,
        "--hvd-autotune",
        help="Horovod's autotuner (HOROVOD_AUTOTUNE=1): explores fusion and cycle during the run, so its "
        "early steps are slow",
    )
