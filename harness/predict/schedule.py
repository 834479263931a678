"""One training step as a stack schedules it: compute segments in order, and the collectives it issues with
when each can start and which compute must wait for it.

The segments of a micro-batch are the embedding, each block and the head, forward then backward in reverse;
the optimizer step ends the step. A Message is ready at the end of segment `after` (-1: at the start of the
step), plus `delay_s`; segment `before` cannot start until it has finished (None: only the step's end
waits). The collective volume these schedules add up to is the adapter's analytic one
(backends.*.comm_pattern) — tests/test_predict.py checks that for every stack — spread over messages as
the stack's bucketing, fusion or per-block sharding issues them.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends import get_backend
from backends.base import parameter_numels
from core.config import RunConfig
from workloads.spec import OPTIMIZER

MiB = 1024 * 1024
# Library defaults the schedules follow (sources in the README's prediction section).
DDP_BUCKET_BYTES = 25 * MiB  # torch DistributedDataParallel bucket_cap_mb
DDP_FIRST_BUCKET_BYTES = 1 * MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
PADDLE_BUCKET_BYTES = 32 * MiB  # fleet DistributedStrategy fuse_grad_size_in_MB (fleet.distributed_model)
PADDLE_LAST_BUCKET_BYTES = 1 * MiB  # fleet DistributedStrategy last_comm_group_size_MB
HOROVOD_FUSION_BYTES = 128 * MiB  # HOROVOD_FUSION_THRESHOLD
HOROVOD_CYCLE_S = 0.001  # HOROVOD_CYCLE_TIME (1 ms): a ready tensor waits half a cycle on average
ZERO_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed reduce_bucket_size and allgather_bucket_size


@dataclass(frozen=True)
class Segment:
    name: str
    phase: str  # "forward" | "backward" | "optimizer"
    unit: str  # "embed" | "block.<i>" | "head" | "optimizer"
    micro: int


@dataclass(frozen=True)
class Message:
    op: str
    size_bytes: float  # nccl-tests size S
    after: int
    before: int | None
    what: str
    delay_s: float = 0.0
    burst: bool = False  # queued back to back with the messages beside it, waited for together


def segments(cfg: RunConfig) -> list[Segment]:
    units = ["embed", *(f"block.{i}" for i in range(cfg.spec.n_layers)), "head"]
    out = []
    for m in range(cfg.grad_accum):
        out += [Segment(f"fwd {u} mb{m}", "forward", u, m) for u in units]
        out += [Segment(f"bwd {u} mb{m}", "backward", u, m) for u in reversed(units)]
    out.append(Segment("optimizer", "optimizer", "optimizer", cfg.grad_accum - 1))
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
        self.last = cfg.grad_accum - 1
        self.optimizer = len(self.list) - 1

    def at(self, phase: str, unit: str, micro: int | None = None) -> int:
        return self.index[(phase, unit, self.last if micro is None else micro)]

    def first_backward(self, micro: int) -> int:
        return self.at("backward", "head", micro)

    def last_backward(self, micro: int) -> int:
        return self.at("backward", "embed", micro)


def buckets(tensors: list[tuple[str, int]], cap_bytes: float, first_cap_bytes: float, element_bytes: int):
    """Whole tensors in the order given, a bucket closed once it holds at least its cap (the first bucket's
    cap may be smaller), as torch DDP and paddle.DataParallel fill theirs."""
    out: list[tuple[list[str], int]] = []
    current, size = [], 0
    for name, n in tensors:
        current.append(name)
        size += n * element_bytes
        if size >= (first_cap_bytes if not out else cap_bytes):
            out.append((current, size))
            current, size = [], 0
    if current:
        out.append((current, size))
    return out


def bucketed_allreduce(steps, numels, cap, first_cap, element_bytes, micro=None, what="gradients"):
    """Buckets in reverse parameter order, each all-reduced once its last gradient is ready in backward,
    all finished before the optimizer step."""
    order = list(reversed(numels.items()))
    messages = []
    for names, size in buckets(order, cap, first_cap, element_bytes):
        ready = max(steps.at("backward", unit_of(n), micro) for n in names)
        messages.append(Message("all_reduce", size, ready, steps.optimizer, what))
    return messages


def ddp(cfg, steps, numels):
    return bucketed_allreduce(steps, numels, DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, 4)


def paddle_dp(cfg, steps, numels, element_bytes):
    """paddle.DataParallel groups parameters in model order, the first group closed at
    last_comm_group_size_MB and the others at fuse_grad_size_in_MB, and hands the reducer the groups
    reversed (assign_group_by_size, then reversed(group_indices)): the small group, the embeddings, is the
    last all-reduced, and a group goes once all its gradients are ready."""
    order = list(numels.items())
    groups = buckets(order, PADDLE_BUCKET_BYTES, PADDLE_LAST_BUCKET_BYTES, element_bytes)
    messages = []
    for names, size in reversed(groups):
        ready = max(steps.at("backward", unit_of(n)) for n in names)
        messages.append(Message("all_reduce", size, ready, steps.optimizer, "gradients"))
    return messages


def horovod(cfg, steps, numels, element_bytes):
    """Each gradient is submitted when its backward ends; the background thread fuses what is ready in one
    cycle, up to the fusion threshold: tensors ready in the same segment go together."""
    by_segment: dict[int, list] = {}
    for name, n in reversed(numels.items()):
        by_segment.setdefault(steps.at("backward", unit_of(name)), []).append((name, n))
    messages = []
    for ready, tensors in sorted(by_segment.items()):
        for _names, size in buckets(tensors, HOROVOD_FUSION_BYTES, HOROVOD_FUSION_BYTES, element_bytes):
            messages.append(
                Message("all_reduce", size, ready, steps.optimizer, "gradients (fused)", HOROVOD_CYCLE_S / 2)
            )
    return messages


def tf_mwms(cfg, steps, numels):
    """apply_gradients all-reduces every gradient after the whole backward, packed into one collective."""
    size = sum(numels.values()) * 4
    return [
        Message("all_reduce", size, steps.last_backward(steps.last), steps.optimizer, "gradients (packed)")
    ]


def zero_chunks(total_elements: int, element_bytes: int) -> list[int]:
    full, rest = divmod(total_elements, ZERO_BUCKET_ELEMENTS)
    return [ZERO_BUCKET_ELEMENTS * element_bytes] * full + ([rest * element_bytes] if rest else [])


def deepspeed(cfg, steps, numels, stage, element_bytes):
    """Stages 0-2 run with overlap_comm off (DeepSpeed's default below stage 3), so a bucket's reduction
    holds up the compute that follows it; stages 1 and 2 all-gather the updated parameters after the step
    (all_gather_dp_groups: one all_gather_into_tensor per parameter group, allgather_bucket_size unused).
    Stage 3 (overlap_comm on) gathers each block's partitioned parameters ahead of its forward, one block
    ahead, and reduce-scatters gradients in reduce_bucket_size buckets as backward fills them."""
    from backends.deepspeed_zero import module_precision
    from backends.deepspeed_zero.comm import partitioned, regathered_blocks, step_scalars

    n = sum(numels.values())
    reduced = steps.last_backward(steps.last)
    scalars = [  # after the gradients' reduction, before the update: nothing beside them
        Message("all_reduce", t.elements * t.dtype_bytes, reduced, steps.optimizer, t.what)
        for t in step_scalars(stage, module_precision(cfg))
        for _ in range(t.per_step)
    ]
    messages = []
    if stage in (0, 1, 2):
        micros = range(cfg.grad_accum) if stage == 2 else [steps.last]
        for m in micros:
            end = steps.last_backward(m)
            for size in zero_chunks(n, element_bytes):
                messages.append(Message("all_reduce", size, end, end + 1, "gradients"))
        messages += scalars
        if stage:  # one all_gather_into_tensor per parameter group (decay, no decay), not bucketed
            shapes = cfg.spec.parameter_shapes()
            decay = sum(numels[name] for name, shape in shapes.items() if OPTIMIZER.decays(shape))
            for size in (decay, n - decay):
                messages.append(
                    Message("all_gather", size * element_bytes, steps.optimizer, None, "updated parameters")
                )
        return messages
    part = partitioned(numels)
    for m in range(cfg.grad_accum):
        units = ["embed", *(f"block.{i}" for i in range(cfg.spec.n_layers)), "head"]
        for k, unit in enumerate(units):
            size = sum(x for name, x in part.items() if unit_of(name) == unit and unit != "head")
            if unit == "head":  # the tied embedding is still gathered
                continue
            issued = steps.at("forward", units[k - 1], m) - 1 if k else steps.at("forward", "embed", m) - 1
            if size:
                messages.append(
                    Message(
                        "all_gather", size * element_bytes, issued, steps.at("forward", unit, m), "params"
                    )
                )
        for i, size in sorted(regathered_blocks(numels).items()):
            before = steps.at("backward", f"block.{i}", m)
            messages.append(Message("all_gather", size * element_bytes, before - 2, before, "re-gather"))
        end = steps.last_backward(m)
        for size in zero_chunks(n, element_bytes):
            messages.append(Message("reduce_scatter", size, end, end + 1, "gradients"))
    messages += scalars
    # _post_step gathers the persistent parameters with all_gather(persistent_parameters), whose
    # _allgather_params_coalesced launches one async all_gather_into_tensor per parameter (51 calls a step
    # on tiny, as its comm trace shows) before waiting: a burst, each call priced as one of commbench's
    for name, size in numels.items():
        if name not in part:
            messages.append(
                Message(
                    "all_gather",
                    size * element_bytes,
                    steps.optimizer,
                    None,
                    "persistent parameter",
                    burst=True,
                )
            )
    return messages


def fsdp(cfg, steps, numels, gather_bytes, reduce_bytes, reshard_after_forward):
    """FSDP2: the root's parameters (embeddings, ln_f) are gathered before the first forward and never
    resharded; each block's all-gather is issued while the block before it runs (implicit prefetch), in
    forward and, when resharded after forward, again in backward; each block's gradients are
    reduce-scattered when its backward ends on the last micro-batch (sync off on the others), the root's
    last."""
    blocks = [f"block.{i}" for i in range(cfg.spec.n_layers)]
    block_elems = {u: sum(n for name, n in numels.items() if unit_of(name) == u) for u in blocks}
    root = sum(numels.values()) - sum(block_elems.values())
    messages = []
    for m in range(cfg.grad_accum):
        first = steps.at("forward", "embed", m)
        messages.append(Message("all_gather", root * gather_bytes, first - 1, first, "root parameters"))
        for u in blocks:
            before = steps.at("forward", u, m)
            messages.append(Message("all_gather", block_elems[u] * gather_bytes, before - 2, before, "block"))
        if reshard_after_forward:
            for u in blocks:
                before = steps.at("backward", u, m)
                messages.append(
                    Message(
                        "all_gather", block_elems[u] * gather_bytes, before - 2, before, "block (backward)"
                    )
                )
    for u in blocks:
        messages.append(
            Message(
                "reduce_scatter", block_elems[u] * reduce_bytes, steps.at("backward", u), steps.optimizer, u
            )
        )
    end = steps.last_backward(steps.last)
    messages.append(Message("reduce_scatter", root * reduce_bytes, end, steps.optimizer, "root gradients"))
    return messages


def from_terms(cfg, steps):
    """A stack without a schedule of its own here: each analytic term as whole-tensor collectives, the
    gradients' after the last backward and everything else after the optimizer step, none overlapped."""
    messages = []
    for term in get_backend(cfg.backend).comm_pattern(cfg).terms:
        count = max(1, round(term.per_step))
        after = steps.optimizer if term.op == "all_gather" else steps.last_backward(steps.last)
        before = None if after == steps.optimizer else steps.optimizer
        for _ in range(count):
            messages.append(Message(term.op, term.elements * term.dtype_bytes, after, before, term.what))
    return messages


def term_bytes(pattern, *ops) -> int:
    """The element bytes of the adapter's first term of one of `ops` (the dtype the stack sends)."""
    return next(t.dtype_bytes for t in pattern.terms if t.op in ops)


def schedule(cfg: RunConfig) -> tuple[list[Message], str]:
    """The messages of one step and how they were modelled."""
    steps = Steps(cfg)
    numels = parameter_numels(cfg)
    backend = get_backend(cfg.backend)
    opts, pattern = backend.options(cfg).to_dict(), backend.comm_pattern(cfg)
    if cfg.backend == "torch-ddp":
        return ddp(
            cfg, steps, numels
        ), "DDP buckets (25 MiB, first 1 MiB) in reverse order, overlapped with backward"
    if cfg.backend == "torch-fsdp":
        from backends.torch_fsdp import gathered_numels

        return fsdp(
            cfg,
            steps,
            gathered_numels(cfg),
            term_bytes(pattern, "all_gather"),
            term_bytes(pattern, "reduce_scatter"),
            opts["reshard_after_forward"],
        ), "FSDP2 per-block all-gather one block ahead, per-block reduce-scatter in backward, root exposed"
    if cfg.backend == "horovod":
        return horovod(
            cfg, steps, numels, term_bytes(pattern, "all_reduce")
        ), "Horovod fusion (128 MiB, 1 ms cycle) during backward"
    if cfg.backend == "tf-mwms":
        return tf_mwms(cfg, steps, numels), "one packed all-reduce after backward (not overlapped)"
    if cfg.backend == "deepspeed":
        stage = opts["zero_stage"]
        element = term_bytes(pattern, "all_reduce", "reduce_scatter")
        return deepspeed(cfg, steps, numels, stage, element), (
            f"ZeRO-{stage}: "
            + (
                "reductions hold up compute (overlap_comm off)"
                if stage < 3
                else "prefetched per-block gathers"
            )
        )
    if cfg.backend == "paddle-fleet" and not opts.get("sharding_stage"):
        return paddle_dp(
            cfg, steps, numels, term_bytes(pattern, "all_reduce")
        ), "fleet DataParallel buckets (32 MB, last 1 MB) during backward"
    return from_terms(cfg, steps), "the adapter's analytic terms, whole tensors, not overlapped"
