"""The registry of backend adapters. Adapters import no framework, so listing them is cheap and safe."""

from __future__ import annotations

import importlib

from backends.base import Backend

# backend name -> "module:Class" of its adapter
ADAPTERS = {
    "torch-ddp": "backends.torch_ddp:TorchDDP",
    "tf-mwms": "backends.tf_mwms:TFMultiWorkerMirrored",
    "paddle-fleet": "backends.paddle_fleet:PaddleFleet",
    "torch-fsdp": "backends.torch_fsdp:TorchFSDP",
    "deepspeed": "backends.deepspeed_zero:DeepSpeed",
    "horovod": "backends.horovod_torch:Horovod",
}


def backend_names() -> list[str]:
    return list(ADAPTERS)


def get_backend(name: str) -> Backend:
    if name not in ADAPTERS:
        raise KeyError(name)
    module, cls = ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def all_backends() -> list[Backend]:
    return [get_backend(n) for n in ADAPTERS]
