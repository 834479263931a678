"""Cross-run figures on hand-made records with known answers (harness.analyze.analysis)."""

import numpy as np
import pytest
from record_factory import make_record, tokens_per_step

from harness.analyze.analysis import aggregate, runs_table

pytestmark = pytest.mark.unit

MiB = 1 << 20


def row(agg, label, gpus, **context):
    sel = agg[(agg["label"] == label) & (agg["world_size"] == gpus)]
    for k, v in context.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, sel
    return sel.iloc[0]


def test_speedup_efficiency_memory_and_comm_from_known_step_times():
    records = [
        make_record("torch-ddp", 1, 0.1, repeat=0),
        make_record("torch-ddp", 1, 0.1, repeat=1),
        make_record("torch-ddp", 2, 0.125, compute_time=0.1, peak_rss=500 * MiB, repeat=0),
        make_record("torch-ddp", 2, 0.125, compute_time=0.1, peak_rss=500 * MiB, repeat=1),
    ]
    agg = aggregate(runs_table(records))
    one, two = row(agg, "torch-ddp", 1), row(agg, "torch-ddp", 2)
    assert one["throughput"] == pytest.approx(tokens_per_step(1) / 0.1)  # 10,240 tok/s
    assert two["throughput"] == pytest.approx(tokens_per_step(2) / 0.125)  # 16,384 tok/s
    assert two["speedup"] == pytest.approx(1.6)
    assert two["efficiency"] == pytest.approx(0.8)
    assert one["speedup"] == pytest.approx(1.0) and one["exposed_comm_ratio"] == 0.0
    assert two["memory_ratio"] == pytest.approx(500 / 400)
    assert two["exposed_comm_ratio"] == pytest.approx(0.2)
    volume = 2 * (2 - 1) / 2 * 1_071_872 * 4  # ring all-reduce of the tiny preset's fp32 gradients
    assert two["volume_per_exposed_s"] == pytest.approx(volume / 0.025)
    # The factory's measured state is the hand-counted 16 B x 1,071,872 tiny parameters, not the formula's.
    assert two["model_state_bytes"] == 17_149_952
    assert two["model_state_analytic"] == pytest.approx(17_149_952)
    assert two["model_state_vs_analytic"] == pytest.approx(1.0)
    assert two["runs"] == 2 and two["failed"] == 0
    assert two["throughput_cv"] == pytest.approx(0.0) and not two["noisy"]
    assert np.isnan(two["mfu"])  # a CPU has no known peak: unknown, not zero


def test_sharded_backend_holds_half_the_model_state_at_two_ranks():
    # Measured per-rank state, by hand: 16 B x 1,071,872 params unsharded; FSDP shards all of it over 2 ranks.
    measured = {
        ("torch-ddp", 1): 17_149_952,
        ("torch-ddp", 2): 17_149_952,
        ("torch-fsdp", 1): 17_149_952,
        ("torch-fsdp", 2): 8_574_976,
    }
    records = [make_record(label, n, state_total=state) for (label, n), state in measured.items()]
    agg = aggregate(runs_table(records))
    ddp, fsdp = row(agg, "torch-ddp", 2), row(agg, "torch-fsdp", 2)
    assert fsdp["model_state_bytes"] / ddp["model_state_bytes"] == pytest.approx(0.5)
    assert ddp["model_state_analytic"] == pytest.approx(17_149_952)
    assert fsdp["model_state_analytic"] == pytest.approx(8_574_976)
    # One rank: nothing to shard.
    assert row(agg, "torch-fsdp", 1)["model_state_analytic"] == pytest.approx(17_149_952)
    assert ddp["model_state_vs_analytic"] == pytest.approx(1.0)
    assert fsdp["model_state_vs_analytic"] == pytest.approx(1.0)


def test_measured_model_state_is_reported_against_the_analytic_value():
    # A stack that holds 25% more than the analytic model (17,149,952 B) is reported as such.
    agg = aggregate(
        runs_table(
            [
                make_record("torch-ddp", 1, state_total=21_437_440),
                make_record("deepspeed-zero3", 2, state_total=8_574_976),
            ]
        )
    )
    assert row(agg, "torch-ddp", 1)["model_state_vs_analytic"] == pytest.approx(1.25)
    # ZeRO-3 shards all of it, and its optimizer's fp32 copy besides: 1,071,872 x 20 B / 2; and keeps its
    # tensors under the persistence threshold whole beside their partitions: 809,728 x 4 B (what a 2-rank
    # tiny run measures, to 8 B: Backend.model_state_bytes)
    assert row(agg, "deepspeed-zero3", 2)["model_state_analytic"] == pytest.approx(10_718_720 + 3_238_912)


def test_spread_over_repeats_is_flagged_noisy_not_averaged_away():
    records = [
        make_record("horovod", 1, 0.1, repeat=0),
        make_record("horovod", 1, 0.1, repeat=1),
        make_record("horovod", 2, 0.1, repeat=0),
        make_record("horovod", 2, 0.125, repeat=1),
    ]
    runs = runs_table(records)
    two = row(aggregate(runs, noise_cv=0.10), "horovod", 2)
    tputs = np.array([tokens_per_step(2) / 0.1, tokens_per_step(2) / 0.125])
    assert two["throughput"] == pytest.approx(np.median(tputs))
    assert (two["throughput_min"], two["throughput_max"]) == pytest.approx((tputs.min(), tputs.max()))
    assert two["throughput_cv"] == pytest.approx(tputs.std(ddof=1) / tputs.mean())  # 15.7%
    assert two["noisy"] and two["speedup_noisy"]
    assert not row(aggregate(runs, noise_cv=0.20), "horovod", 2)["noisy"]


def test_noisy_baseline_makes_every_speedup_from_it_noisy():
    records = [
        make_record("tf-mwms", 1, 0.1, repeat=0),
        make_record("tf-mwms", 1, 0.13, repeat=1),
        make_record("tf-mwms", 2, 0.2, repeat=0),
        make_record("tf-mwms", 2, 0.2, repeat=1),
    ]
    two = row(aggregate(runs_table(records)), "tf-mwms", 2)
    assert not two["noisy"] and two["speedup_noisy"]


def test_single_repeat_has_unknown_spread():
    agg = aggregate(runs_table([make_record("paddle-fleet", 1)]))
    assert np.isnan(row(agg, "paddle-fleet", 1)["throughput_cv"]) and not row(agg, "paddle-fleet", 1)["noisy"]


def test_failed_repeat_is_counted_in_its_group_and_left_out_of_the_figures():
    records = [
        make_record("deepspeed-zero3", 1, 0.1),
        make_record("deepspeed-zero3", 2, 0.125, repeat=0),
        make_record("deepspeed-zero3", 2, status="failed", repeat=1),
    ]
    runs = runs_table(records)
    assert runs["device"].nunique() == 1  # the failed run reported no device; it joins its host's group
    two = row(aggregate(runs), "deepspeed-zero3", 2)
    assert (two["runs"], two["failed"]) == (1, 1)
    assert two["throughput"] == pytest.approx(tokens_per_step(2) / 0.125)


def test_only_comparable_runs_are_grouped_and_speedup_needs_n1():
    records = [
        make_record("torch-ddp", 1, 0.1),
        make_record("torch-ddp", 2, 0.125),
        make_record("torch-ddp", 1, 0.05, precision="bf16"),
        make_record("torch-ddp", 2, 0.1, precision="bf16"),
        make_record("torch-ddp", 2, 0.2, micro_batch=16),
        make_record("torch-ddp", 2, 0.1, scaling="strong"),
    ]
    agg = aggregate(runs_table(records))
    assert len(agg) == 6
    assert row(agg, "torch-ddp", 2, precision="bf16")["speedup"] == pytest.approx(1.0)
    assert np.isnan(
        row(agg, "torch-ddp", 2, batch="16 seq/rank x 1 accum")["speedup"]
    )  # no N=1 at that batch
    assert set(agg["scaling"]) == {"weak", "strong"}
    assert row(agg, "torch-ddp", 2, scaling="strong")["batch"] == "16 seq global, 1 accum"


def test_overridden_workload_is_its_own_group():
    base = make_record("torch-ddp", 1)
    deeper = make_record("torch-ddp", 1)
    deeper["config"]["model"]["spec"]["n_layers"] = 8
    runs = runs_table([base, deeper])
    assert sorted(runs["workload"]) == ["tiny", "tiny(n_layers=8)"]


def test_groups_whose_cpu_workers_exceed_the_cpus_are_oversubscribed():
    # The factory's machine: 2 CPUs, 1 thread per worker. 4 workers oversubscribe it, 2 do not.
    records = [make_record("torch-ddp", n) for n in (1, 2, 4)]
    failed = make_record("torch-ddp", 8, status="failed")
    agg = aggregate(runs_table([*records, failed]))
    assert [bool(row(agg, "torch-ddp", n)["oversubscribed"]) for n in (1, 2, 4, 8)] == [
        False,
        False,
        True,
        True,  # a failed run under contention is marked too
    ]
    assert row(agg, "torch-ddp", 4)["cpus"] == 2 and np.isnan(row(agg, "torch-ddp", 2)["cpus"])
    # The CPUs the workers may use (affinity, quota) decide, where the record has them.
    wide = make_record("torch-ddp", 4, run_id="wide")
    wide["environment"]["cpus_available"] = 4
    assert not row(aggregate(runs_table([wide])), "torch-ddp", 4)["oversubscribed"]
