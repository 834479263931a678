"""FSDP2 issues its all-gathers and reduce-scatters through torch.distributed's process group, so its
collectives are torch.distributed's (backends.torch_ddp.collectives), launched the same way (torchrun)."""

from backends.torch_ddp.collectives import make_collectives

__all__ = ["make_collectives"]
