"""From a verb's parsed arguments to RunConfigs: the one path, for `harness run` (and sweep, plan, slurm,
k8s, the gate) and `harness predict`. A RunRequest reads the command line once, however many configs are
built from it (a sweep builds one per stack, N and variant; a prediction one per N): each stack named is
looked up once and the flags of the others refused, the workload's spec resolved once, the hosts and the
rendezvous read once, every flag checked against its valid values. `config` then builds a run's config
at one N, `assemble` what a prediction prices (its batch and layout come from the hardware profile).

Everything is checked before anything launches: bad input is a UsageError (one line, exit 2).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backends import all_backends, backend_names, get_backend, interpreter
from backends.base import Backend, Options
from core.config import VARIANTS, BatchConfig, InvalidConfig, RunConfig
from core.hooks import TestHooks
from core.process import available_cpus
from harness.arguments.flags import declared_flags
from harness.arguments.layout import Layout
from harness.arguments.parsers import FILL
from harness.usage import UsageError, choice
from workloads.spec import OVERRIDES, PRESETS, ModelSpec, resolve

# The flagged settings the harness works out rather than takes as given: the stack and its variant, the
# workload's shape, the batch, how t_compute is measured, the ranks and their placement, the interpreter.
# Every other flagged setting (precision, steps, ...) goes into the config as its flag gives it.
RESOLVED = frozenset(
    {
        "backend",
        "variant",
        "workload",
        "spec",
        "micro_batch",
        "grad_accum",
        "scaling",
        "data_path",
        "compute_method",
        "world_size",
        "device",
        "nodes",
        "gpus_per_node",
        "node_rank",
        "master_addr",
        "hosts",
        "launcher_only",
        "threads_per_worker",
        "python",
    }
)


def foreign_flags(args, backends: list[str]) -> None:
    """Refuse a backend option given for a run of another backend: it would be silently ignored. A flag
    several stacks share (--compile) is refused only where none of `backends` takes it."""
    taken = {flag for b in all_backends() if b.name in backends for flag in b.Options.flags()}
    for other in all_backends():
        if other.name in backends:
            continue
        for flag in set(other.Options.given(args)) - taken:
            owners = [b.name for b in all_backends() if flag in b.Options.flags()]
            whose = f"backend{'s' if len(owners) > 1 else ''} {', '.join(owners)}"
            raise UsageError(f"{flag} is an option of {whose}, not of {', '.join(backends)}")


def spec_from_args(args) -> ModelSpec:
    """The preset with the overrides given (--layers, --d-model, ...)."""
    choice(args.workload, list(PRESETS), "workload")
    try:
        return resolve(args.workload, **{k: getattr(args, k) for k in OVERRIDES})
    except ValueError as exc:
        raise UsageError(f"invalid workload: {exc}") from None


# --micro-batch max's micro-batch in a config until harness.run.fill has chosen one, before anything launches
FILL_PLACEHOLDER = 1
FILL_ON_CPU = (
    "--micro-batch max fills a GPU's memory; on a CPU memory does not bound the micro-batch: give a number"
)


def micro_batch_for(args, n: int) -> int:
    """--micro-batch, or --global-batch split over n ranks x --grad-accum micro-steps (strong scaling)."""
    if args.micro_batch and args.global_batch:
        raise UsageError("give --micro-batch or --global-batch, not both")
    if args.micro_batch == FILL:
        return FILL_PLACEHOLDER
    if not args.global_batch:
        return args.micro_batch or BatchConfig.micro_batch
    accum = args.grad_accum or BatchConfig.grad_accum
    if args.global_batch % (n * accum):
        raise UsageError(
            f"--global-batch {args.global_batch} is not divisible by gpus x grad-accum = "
            f"{n} x {accum} = {n * accum}"
        )
    return args.global_batch // (n * accum)


def given_settings(args) -> dict:
    """The settings whose flags were given as they go into the config (not RESOLVED), each checked against
    its valid values; a flag this verb does not take, or one left unset (None), gives none."""
    out = {}
    for flag in declared_flags().values():
        value = getattr(args, flag.dest, None)
        if not flag.setting or value is None:
            continue
        if flag.valid is not None:
            choice(value, flag.valid, flag.setting.replace("_", " "))
        if flag.setting not in RESOLVED:
            out[flag.setting] = value
    if out.get("tf32") and out.get("precision", "fp32") != "fp32":
        raise UsageError(
            f"--tf32 applies to --precision fp32 only: a {out['precision']} run computes its matmuls in "
            f"{out['precision']} and keeps what it computes in fp32 IEEE; drop --tf32 or use --precision fp32"
        )
    return out


def named_pythons(args, in_use: list[str]) -> dict[str, str]:
    """--python as given: backend -> path ("" for a bare PATH, every backend's)."""
    named: dict[str, str] = {}
    for item in getattr(args, "python", None) or []:
        name, sep, path = item.partition("=")
        key = name if sep and "/" not in name else ""
        if key and key not in in_use:
            raise UsageError(f"--python {item}: backend '{key}' is not run here; valid: {', '.join(in_use)}")
        if key in named:
            what = f"for backend {key}" if key else "without a backend (name it: --python BACKEND=PATH)"
            raise UsageError(f"--python {item}: a second interpreter {what}")
        named[key] = path if key else item
    return named


def worker_python(args, backend: str, in_use: list[str], check: bool = True) -> str:
    """The interpreter `backend`'s workers run under: --python (BACKEND=PATH before a bare PATH), else what
    backends.interpreter.configured finds. `check` False (a plan or job file for another machine): a path
    given is taken as it is, unchecked here."""
    return python_of(named_pythons(args, in_use), get_backend(backend), check)


def python_of(named: dict[str, str], backend: Backend, check: bool = True) -> str:
    """worker_python, from --python as named_pythons read it."""
    given = named.get(backend.name) or named.get("")
    try:
        if given:
            return interpreter.usable(given, "--python") if check else given
        return interpreter.configured(backend.name, backend.framework)[0]
    except interpreter.InterpreterError as exc:
        raise UsageError(str(exc)) from None


def hooks_from_args(args) -> TestHooks:
    """The test hooks the testing flags set (--inject-fault, and --step-delay where the command has it):
    kept out of the RunConfig, the runner hands them to the workers (core.hooks)."""
    return TestHooks(
        fault=getattr(args, "inject_fault", None),
        step_delay_s=getattr(args, "step_delay", None) or 0.0,
        warmup_transient_bytes=getattr(args, "warmup_transient", None) or 0,
        part_delays=dict(getattr(args, "part_delay", None) or ()),
    )


def validated(backend: Backend, cfg: RunConfig) -> RunConfig:
    """`cfg` if its adapter can run it (Backend.validate), else the adapter's reason as a UsageError."""
    try:
        backend.validate(cfg)
    except InvalidConfig as exc:
        raise UsageError(str(exc)) from None
    return cfg


class RunRequest:
    """One command line's run settings, read once. `backends`: the stacks it runs (default: --backend);
    `resolve_device(requested, ranks_per_node)`: the device a run gets here (auto resolved, cuda checked
    against the GPUs visible), which the running side supplies (harness.run.devices.resolve_device);
    `check_memory(backend, cfg)`: raises a UsageError where a run's ranks on this node would not fit its
    memory (harness.run.footprint), for every config of a run made here (check_devices). `fills`: the verb
    chooses `--micro-batch max`'s micro-batch itself (harness.run.fill); every other verb refuses it."""

    def __init__(
        self,
        args,
        backends: list[str] | None = None,
        resolve_device: Callable[[str, int], str] | None = None,
        check_memory: Callable[[Backend, RunConfig], None] | None = None,
        fills: bool = False,
    ):
        self.args = args
        if getattr(args, "micro_batch", None) == FILL and not fills:
            raise UsageError(
                "--micro-batch max is for harness run and sweep, which probe the device: give a number"
            )
        names = list(backends) if backends else [args.backend]
        self.backends = {name: get_backend(choice(name, backend_names(), "backend")) for name in names}
        foreign_flags(args, names)
        self.options: dict[str, Options] = {n: b.Options.from_args(args) for n, b in self.backends.items()}
        self.spec = spec_from_args(args)
        self.settings = given_settings(args)
        data = getattr(args, "data", None)
        if data and not Path(data).is_file():
            raise UsageError(f"--data {data}: no such file")
        self.data_path = str(Path(data).resolve()) if data else None
        self.layout = Layout.read(args)
        self.pythons = named_pythons(args, names)
        self.resolve_device = resolve_device
        self.check_memory = check_memory

    @property
    def backend(self) -> Backend:
        """The stack of a request for one."""
        (backend,) = self.backends.values()
        return backend

    @property
    def world(self) -> int:
        """Ranks in all: --gpus, else nodes x ranks per node."""
        return self.layout.world(getattr(self.args, "gpus", None))

    def python(self, backend: str, check: bool = True) -> str:
        """The interpreter `backend`'s workers run under (worker_python)."""
        return python_of(self.pythons, self.backends[backend], check)

    def assemble(self, backend: Backend, variant: str = "default", **settings) -> RunConfig:
        """The config of `settings` (named as RunConfig.build takes them) over the flags given, with the
        stack's options; a tuned variant's options are its tuned set on the config's device, under the
        flags given. Not validated: the caller checks it where it is complete (validated)."""
        choice(variant, VARIANTS, "variant")
        options = self.options[backend.name]
        cfg = RunConfig.build(
            backend=backend.name, backend_options=options.to_dict(), **{**self.settings, **settings}
        )
        if variant == "tuned":
            tuned = {name: setting.value for name, setting in backend.tuned(cfg).items()}
            options = backend.Options.from_args(self.args, tuned)
            cfg = cfg.evolve(backend_options=options.to_dict(), variant=variant)
        return cfg

    def config(
        self,
        backend_name: str,
        n: int,
        threads: int | None = None,
        check_devices: bool = True,
        node_rank: int | None = None,
        variant: str | None = None,
    ) -> RunConfig:
        """The config of a run of `backend_name` on n ranks. `threads`: per worker (default: --threads-per-
        worker, else this machine's cores over the ranks of a node). `check_devices` False: for a plan made
        elsewhere, do not require the GPUs to be visible here nor check this node's memory. `variant`: one
        of VARIANTS (default: "tuned" under --tuned)."""
        args, backend = self.args, self.backends[backend_name]
        micro = micro_batch_for(args, n)
        method, methods = args.compute_method, backend.compute_methods_for(self.options[backend.name])
        if method == "auto":
            method = methods[0]
        elif method not in (*methods, "none"):
            raise UsageError(
                f"backend {backend.name} cannot use compute method '{method}'; "
                f"valid: {', '.join(methods)}, none"
            )
        layout = self.layout.settings(n, node_rank)
        if layout["nodes"] > 1 and not backend.multi_node:
            raise UsageError(f"backend {backend.name} runs on one node only; drop --nodes/--hosts")
        per_node = n // layout["nodes"]
        launcher_only = bool(getattr(args, "launcher_only", False))
        if launcher_only:
            check_launcher_only(backend, args.device, layout, method)
            check_devices = False
        device = args.device
        if self.resolve_device and (check_devices or device == "auto"):
            device = self.resolve_device(device, per_node)
        if args.micro_batch == FILL and device != "cuda":
            raise UsageError(FILL_ON_CPU)
        cfg = self.assemble(
            backend,
            variant or ("tuned" if getattr(args, "tuned", False) else "default"),
            workload=args.workload,
            spec=self.spec,
            world_size=n,
            device=device,
            micro_batch=micro,
            grad_accum=args.grad_accum or BatchConfig.grad_accum,
            compute_method=method,
            threads_per_worker=threads or args.threads_per_worker or max(1, available_cpus() // per_node),
            data_path=self.data_path,
            scaling="strong" if args.global_batch else "weak",
            **layout,
            launcher_only=launcher_only,
            python=self.python(backend.name, check_devices),
        )
        cfg = validated(backend, cfg)
        if self.check_memory and check_devices:  # its ranks run here: not a plan, a job file, a launcher
            self.check_memory(backend, cfg)
        return cfg


def check_launcher_only(backend: Backend, device: str, layout: dict, method: str) -> None:
    """--launcher-only: a harness that starts the ranks of other hosts and runs none itself."""
    if not backend.starts_remote_ranks:
        raise UsageError(
            f"--launcher-only: {backend.name}'s launcher does not start the other hosts' ranks; "
            f"valid: {', '.join(b.name for b in all_backends() if b.starts_remote_ranks)}"
        )
    if device == "auto":
        raise UsageError("--launcher-only needs --device cuda or cpu: the ranks' hosts decide, not this one")
    if not layout["hosts"]:
        raise UsageError("--launcher-only needs the ranks' hosts: --hosts or --hostfile")
    if method != "none":
        raise UsageError(
            "--launcher-only runs no rank here, so no isolated counterfactual either: "
            "add --compute-method none"
        )
