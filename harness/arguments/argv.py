"""A RunConfig back into the `harness run` command line that builds it, from the same flag declarations the
parsers are made of (harness.arguments.flags): what `harness select --confirm` runs a candidate with, and
what a study or a job file needs to run a configuration again."""

from __future__ import annotations

from backends import get_backend
from core.config import RunConfig
from harness.arguments.flags import Flag, declared_flags
from harness.arguments.layout import default_master
from harness.arguments.request import RESOLVED
from workloads.spec import OVERRIDES, PRESETS


def flag_tokens(flag: Flag, value) -> list[str]:
    """The tokens that give `value` to a flag that takes its setting as given; none for its default."""
    if value == flag.default:
        return []
    if flag.action == "store_true":
        return [flag.name]
    if flag.action == "boolean":
        return [flag.name if value else "--no-" + flag.name[2:]]
    return [flag.name, str(value)]


def shape_argv(cfg: RunConfig) -> list[str]:
    """The workload: its preset, and every dimension where the shape is not the preset's (a custom one
    names every dimension over the default preset)."""
    workload, spec = cfg.model.workload, cfg.model.spec
    default = str(declared_flags()["--workload"].default)
    preset = workload if workload in PRESETS else default
    argv = [] if preset == default else ["--workload", preset]
    if spec != PRESETS[preset]:
        for name, attribute in OVERRIDES.items():
            argv += ["--" + name.replace("_", "-"), str(getattr(spec, attribute))]
    return argv


def batch_argv(cfg: RunConfig) -> list[str]:
    """A strong-scaling config by its global batch (the micro-batch derived from it again), a weak one by
    its micro-batch; the accumulation where it is not 1."""
    batch = cfg.batch
    argv = ["--global-batch", str(cfg.global_batch)] if batch.scaling == "strong" else []
    argv += [] if batch.scaling == "strong" else ["--micro-batch", str(batch.micro_batch)]
    return argv + (["--grad-accum", str(batch.grad_accum)] if batch.grad_accum != 1 else [])


def layout_argv(cfg: RunConfig) -> list[str]:
    """The nodes, this node's rank, the hosts and the rendezvous where they are not the one-node defaults
    (the rendezvous where it is not what the hosts give)."""
    topo = cfg.topology
    argv = []
    if topo.nodes > 1:
        argv += ["--nodes", str(topo.nodes), "--gpus-per-node", str(topo.gpus_per_node)]
        argv += ["--node-rank", str(topo.node_rank)]
    if topo.hosts:
        argv += ["--hosts", ",".join(topo.hosts)]
    if (topo.master_addr, topo.master_port) != default_master(topo.hosts, topo.nodes):
        argv += ["--master", topo.master_addr + (f":{topo.master_port}" if topo.master_port else "")]
    return argv + (["--launcher-only"] if topo.launcher_only else [])


def run_argv(cfg: RunConfig) -> list[str]:
    """The `harness run` arguments that build `cfg` again: every setting a flag sets where it is not the
    flag's default, the ranks and the threads per worker always (their defaults depend on the machine), the
    compute method where it is not the stack's preferred one, and the stack's options beyond what the
    variant sets. A config whose role the harness sets (an isolated worker, commbench) is no run's: a
    ValueError."""
    role = cfg.role
    if role.isolated_index is not None or role.commbench is not None or role.trace_launch != "inline":
        raise ValueError(
            "a config whose role the harness set (isolated, commbench, trace launch) has no argv"
        )
    backend = get_backend(cfg.backend)
    options = backend.Options.from_dict(cfg.backend_options)
    argv = ["--backend", cfg.backend, "--gpus", str(cfg.topology.world_size), "--device", cfg.topology.device]
    argv += shape_argv(cfg) + batch_argv(cfg)
    for flag in declared_flags().values():
        if flag.setting and flag.setting not in RESOLVED:
            argv += flag_tokens(flag, cfg.setting(flag.setting))
    if cfg.measurement.compute_method != backend.compute_methods_for(options)[0]:
        argv += ["--compute-method", cfg.measurement.compute_method]
    argv += ["--threads-per-worker", str(cfg.topology.threads_per_worker)]
    argv += ["--data", cfg.batch.data_path] if cfg.batch.data_path else []
    argv += ["--python", cfg.topology.python] if cfg.topology.python else []
    argv += layout_argv(cfg)
    against = None
    if cfg.variant == "tuned":
        argv.append("--tuned")
        against = backend.Options(**{k: s.value for k, s in backend.tuned(cfg).items()})
    return argv + options.to_argv(against)
