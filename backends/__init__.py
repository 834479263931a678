"""The registry of backend adapters. Adapters import no framework, so listing them is cheap and safe.

Everything the harness knows of a stack comes from its adapter (backends.base.Backend): how to launch it,
its options, its communication, its Kubeflow job kind, its trace reader, its doctor checks, the words its
errors use for a lost peer. So a stack is added by registering its adapter, with no edit elsewhere.

The stacks shipped here are ADAPTERS. A stack kept in a package of its own registers with one line of that
package's metadata, an entry point in the group `distbench.backends` naming its adapter class:

    [project.entry-points."distbench.backends"]
    mystack = "mystack:MyStack"

and is installed (`pip install -e ./mystack`) in the harness's environment and in its workers' (where they
differ: backends.interpreter). Entry points rather than an environment variable, because the registry is read
in every process that needs a stack (the harness, each worker its launcher starts, each node's harness under
Slurm or in a Kubernetes pod) and an installed package's metadata is on every one of those paths by itself,
while a variable has to be passed along each of them (a Kubeflow pod gets only the environment its manifest
names). A registered name must not be a shipped one: such a clash is refused when the registry is read.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata

from backends.base import Backend

ENTRY_POINT_GROUP = "distbench.backends"
# backend name -> "module:Class" of its adapter
ADAPTERS = {
    "torch-ddp": "backends.torch_ddp:TorchDDP",
    "tf-mwms": "backends.tf_mwms:TFMultiWorkerMirrored",
    "paddle-fleet": "backends.paddle_fleet:PaddleFleet",
    "torch-fsdp": "backends.torch_fsdp:TorchFSDP",
    "deepspeed": "backends.deepspeed_zero:DeepSpeed",
    "horovod": "backends.horovod_torch:Horovod",
}
# The stack whose model state the report sets the others against: plain replicated data parallelism, in the
# framework four of the shipped stacks share. A choice of the suite, not a fact about one stack, so it is
# kept here rather than as a flag an adapter (a registered one too) could also set.
REFERENCE_BACKEND = "torch-ddp"


class RegistryError(ValueError):
    """A registered stack that cannot be used as registered (a name clash, an adapter that does not load)."""


@functools.cache
def registered() -> dict[str, str]:
    """The stacks installed packages register (ENTRY_POINT_GROUP): name -> "module:Class". Read once per
    process: the installed packages do not change while it runs."""
    found: dict[str, str] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = entry.dist.name if entry.dist else "an installed package"
        if entry.name in ADAPTERS:
            raise RegistryError(
                f"{where} registers backend '{entry.name}' ({entry.value}) in {ENTRY_POINT_GROUP}, "
                "a name this suite's own stacks use: give it another name"
            )
        found[entry.name] = entry.value
    return found


def adapters() -> dict[str, str]:
    """Every backend: the shipped ones, then the registered ones."""
    return {**ADAPTERS, **registered()}


def backend_names() -> list[str]:
    return list(adapters())


def get_backend(name: str) -> Backend:
    known = adapters()
    if name not in known:
        raise KeyError(name)
    module, _, cls = known[name].partition(":")
    try:
        adapter = getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError, TypeError) as exc:
        raise RegistryError(f"backend '{name}': its adapter {known[name]} does not load ({exc})") from exc
    if adapter.name != name:
        raise RegistryError(f"backend '{name}': its adapter {known[name]} calls itself '{adapter.name}'")
    return adapter


def all_backends() -> list[Backend]:
    return [get_backend(n) for n in adapters()]


def load(reference: str):
    """The object a "module:attribute" reference names (an adapter's trace_reader, say)."""
    module, _, attribute = reference.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found
