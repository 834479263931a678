"""torch-ddp's options (framework-free): what the adapter, its schedule and its worker read."""

from dataclasses import dataclass

from backends.base import on_off, option
from backends.torch_tuning import TorchTuning

DDP_DOCSTRING = "torch/nn/parallel/distributed.py DistributedDataParallel docstring"


@dataclass(frozen=True)
class DDPOptions(TorchTuning):
    bucket_cap_mb: int = option(
        25, "--bucket-cap-mb", type=int, help="DDP's gradient bucket size in MiB (its bucket_cap_mb)"
    )
    gradient_as_bucket_view: bool = option(
        False,
        "--grad-as-bucket-view",
        choices=("on", "off"),
        parse=on_off,
        help="DDP's gradient_as_bucket_view: .grad tensors are views into the buckets, one copy fewer",
    )
