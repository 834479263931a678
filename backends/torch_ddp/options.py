"""torch-ddp's options (framework-free): what the adapter, its schedule and its worker read."""

from dataclasses import dataclass

from backends.base import option, switch
from backends.torch_tuning import TorchTuning

DDP_DOCSTRING = "torch/nn/parallel/distributed.py DistributedDataParallel docstring"


@dataclass(frozen=True)
class DDPOptions(TorchTuning):
    # None is DDP's own default, which is not the same as 25 given: torch 2.13's DDP closes its first bucket
    # at 1 MiB only when bucket_cap_mb is not given (_BucketCapacityConfig.create); a size given applies to
    # every bucket, the first included.
    bucket_cap_mb: int | None = option(
        None,
        "--bucket-cap-mb",
        type=int,
        help="DDP's gradient bucket size in MiB (bucket_cap_mb), the first bucket included (default: DDP's "
        "own, 25 MiB with a 1 MiB first bucket)",
    )
    gradient_as_bucket_view: bool = switch(
        False,
        "--grad-as-bucket-view",
        help="DDP's gradient_as_bucket_view: .grad tensors are views into the buckets, one copy fewer",
    )
