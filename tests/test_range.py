"""The range tier: live runs at the top of the product's range, 1 to 32 ranks, where every other live test
runs 1 or 2. Each stack runs once at 8 ranks (torch-fsdp at 32), tiny and a few steps, oversubscribed on
purpose on a 2-core machine, and is held to: status ok with every rank in the record; model state per rank
equal to the analytic value for the stack's sharding at that N (what `harness select` and `harness predict`
size by); and, where the run traces, the traced bytes equal to the analytic ones and each traced step
issuing the stack's declared schedule, whose sizes depend on N (FSDP's shards).

At 32: torch-fsdp, the cheapest stack that shards parameters, whose share of the model state (1/32) and
shard sizes are new there; it runs at 32 in place of 8, every claim of an 8-rank run holding at 32. ZeRO-3
or DDP at 32 took 2 to 3 minutes here and would claim nothing their 8-rank runs do not. DeepSpeed runs
ZeRO-3 in native bf16 on tests/test_torch_family.py's WIDE shape, which that module ran at 2 ranks for the
same claims (an Nth of DDP's model state, traced bytes as analytic).

Traced: torch-ddp, torch-fsdp and deepspeed (torch profiler, inline), paddle-fleet (its reducer log).
Untraced: horovod, whose timeline needs a launch of its own and whose fusion has no fixed schedule to hold
to, and tf-mwms, whose profiler can kill a worker as it stops (tests/test_tf_paddle_backends.py runs it
again): their traces are held to the analytic volume at 2 ranks there and in tests/test_torch_family.py.

Cost: docs/development.md (Tests).
"""

import math

import pytest
from conftest import assert_model_state_as_predicted, assert_traced_steps_follow_the_schedule, launched_once
from conftest import run_record as launch
from test_torch_family import DDP_STATE, FAMILY, NATIVE, WIDE

from backends.deepspeed_zero.comm import PERSISTENCE_THRESHOLD
from core.records import run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# A run's own limit, generous for 32 ranks on two busy cores (85 s alone), and the CLI's beyond it
RUN_TIMEOUT_S = 600
# One measured step after one warm-up step, traced once: every claim here is about a steady step's state and
# collectives (DDP broadcasts its rebuilt bucket order in its second step, so the traced step comes after
# two). More measured or traced steps would add work at 32 ranks and no claim.
FEW_STEPS = ["--steps", "1", "--warmup", "1", "--trace-steps", "1"]
CPU = ["--device", "cpu", "--threads-per-worker", "1", "--timeout", RUN_TIMEOUT_S]
TINY = ["--workload", "tiny", "--micro-batch", "1", "--compute-method", "none", *CPU, *FEW_STEPS]

# stack -> (ranks, the rest of its `harness run` arguments). DeepSpeed: WIDE's weight matrices are over
# ZeRO-3's persistence threshold, so most of the model is partitioned (on tiny, nearly every tensor
# persists whole on every rank).
RANGE = {
    "torch-ddp": (8, ["--backend", "torch-ddp", *TINY]),
    "torch-fsdp": (32, ["--backend", "torch-fsdp", *TINY]),
    "deepspeed": (8, [*FAMILY["deepspeed-zero3"], *WIDE, *NATIVE, *CPU]),
    "horovod": (8, ["--backend", "horovod", *TINY, "--no-trace-comm"]),
    "tf-mwms": (8, ["--backend", "tf-mwms", *TINY, "--no-trace-comm"]),
    "paddle-fleet": (8, ["--backend", "paddle-fleet", *TINY]),
}


def range_run(stack: str, tmp_path_factory) -> dict:
    """The stack's run of the tier, launched once per test run (torch-fsdp's test reads torch-ddp's)."""
    ranks, args = RANGE[stack]
    return launched_once(
        f"range-{stack}-{ranks}",
        lambda: launch(tmp_path_factory.mktemp(stack), *args, "--gpus", ranks, timeout=RUN_TIMEOUT_S + 120),
    )


def assert_ran_at_full_width(rec: dict, ranks: int) -> None:
    assert rec["status"] == "ok" and rec["error"] is None, (rec["status"], rec["error"])
    assert run_config(rec).topology.world_size == ranks
    assert sorted(r["rank"] for r in rec["ranks"]) == list(range(ranks))
    assert all(r["status"] == "ok" for r in rec["ranks"])
    assert_model_state_as_predicted(rec)


def assert_traced_as_analytic(rec: dict) -> None:
    """Every rank traced, and traced the same bytes of each op; those bytes per rank and step are the
    analytic ones (within 2%: ZeRO-3 also broadcasts a few small objects in its first steps, traced here
    as its run measures one step)."""
    m = rec["summary"]["comm_measured"]
    assert m["ranks_traced"] == run_config(rec).topology.world_size, m
    assert all(op["ranks_agree"] for op in m["ops"].values()), m
    assert m["vs_analytic"] == pytest.approx(1, abs=0.02), m


@pytest.mark.parametrize("stack", RANGE)
def test_every_stack_runs_at_the_top_of_the_range(stack, tmp_path_factory):
    ranks = RANGE[stack][0]
    rec = range_run(stack, tmp_path_factory)
    assert_ran_at_full_width(rec, ranks)
    s = rec["summary"]
    assert len(s["losses"]) == run_config(rec).measurement.steps and s["throughput_tokens_per_s"] > 0
    if stack in ("horovod", "tf-mwms"):
        assert s["comm_measured"]["method"] is None
        return
    assert_traced_as_analytic(rec)
    if stack != "deepspeed":  # ZeRO-3's first steps' broadcasts are not in its schedule
        assert_traced_steps_follow_the_schedule(rec, in_order=stack != "torch-fsdp")
    if stack == "paddle-fleet":  # DataParallel's fused all-reduces hold every fp32 gradient once a step
        m = s["comm_measured"]
        assert m["method"].startswith("paddle reducer log"), m
        assert m["ops"]["all_reduce"]["size_bytes_per_step"] == 4 * run_config(rec).model.spec.n_params, m


def test_fsdp_at_32_ranks_holds_a_32nd_of_ddps_model_state(tmp_path_factory):
    """FSDP2 cuts each parameter, its gradient and its AdamW moments on dim 0 (the tiny shapes' are
    multiples of 32, so no padding), and keeps AdamW's step counters whole: 1/32 of what a DDP rank holds,
    measured against the 8-rank DDP run of the tier (DDP's state does not depend on N)."""
    fsdp, ddp = range_run("torch-fsdp", tmp_path_factory), range_run("torch-ddp", tmp_path_factory)
    held, whole = fsdp["summary"]["model_state_bytes_per_rank"], ddp["summary"]["model_state_bytes_per_rank"]
    assert held / whole == pytest.approx(1 / 32, rel=0.002), (held, whole)


def test_zero3_at_8_ranks_holds_an_8th_of_ddps_model_state_and_its_persistent_tensors_whole(
    tmp_path_factory,
):
    """On WIDE in DeepSpeed's native bf16: an eighth of DDP's 16 bytes a parameter (bf16 parameters and
    gradients, fp32 master and moments: the same 16 bytes, partitioned), plus the tensors under ZeRO-3's
    persistence threshold (biases, LayerNorms, pos_emb), whose bf16 parameters every rank keeps whole
    beside its partition."""
    rec = range_run("deepspeed", tmp_path_factory)
    numels = [math.prod(shape) for shape in run_config(rec).model.spec.parameter_shapes().values()]
    persistent = sum(n for n in numels if n <= PERSISTENCE_THRESHOLD)
    expected = DDP_STATE / 8 + 2 * persistent
    held = rec["summary"]["model_state_bytes_per_rank"]
    assert held == pytest.approx(expected, rel=0.002), (held, expected, DDP_STATE / 8)
