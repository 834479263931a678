"""`--tuned`: each stack's tuned set (the settings its experts use, with their sources) applied to its
options, recorded, and kept apart from default runs wherever runs are matched or ranked. The tuned runs
themselves (the same losses as the default within a stated tolerance) are tests/test_tuned_runs.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
from record_factory import BACKENDS, make_record

from backends import all_backends, backend_names, get_backend
from core.config import RunConfig
from core.records import config_key, write_json_atomic
from harness.cli import main, make_parser
from harness.run.options import build_config
from harness.run.sweep import plan as sweep_plan
from harness.usage import UsageError
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit


def cfg_for(argv: list[str]) -> RunConfig:
    args = make_parser().parse_args(["run", *argv])
    return build_config(args, args.backend, args.gpus, check_devices=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", backend_names())
def test_every_stack_has_a_tuned_set_of_its_own_options_each_with_a_source(name, device):
    backend = get_backend(name)
    cfg = RunConfig.build(backend=name, workload="tiny", spec=PRESETS["tiny"], world_size=2, device=device)
    tuned = backend.tuned(cfg)
    fields = {f.name: f for f in dataclasses.fields(backend.Options)}
    assert tuned, f"{name} has no tuned set"
    for option_name, setting in tuned.items():
        assert option_name in fields, f"{name}: {option_name} is not one of its options"
        assert setting.value != fields[option_name].default, f"{name}: {option_name} tuned to its default"
        assert len(setting.source) > 20, f"{name}: {option_name} needs its source"


def test_tuned_applies_the_set_and_a_flag_given_wins(monkeypatch):
    base = ["--backend", "torch-ddp", "--gpus", "2", "--device", "cpu"]
    default, tuned = cfg_for(base), cfg_for([*base, "--tuned"])
    assert default.variant == "default" and tuned.variant == "tuned"
    assert default.backend_options == {
        "compile": False,
        "adamw": "default",
        "bucket_cap_mb": None,
        "gradient_as_bucket_view": False,
    }
    assert tuned.backend_options == {
        "compile": True,
        "adamw": "fused",
        "bucket_cap_mb": None,  # DDP's own buckets for tiny's gradients (TorchDDP.tuned)
        "gradient_as_bucket_view": True,
    }
    mixed = cfg_for([*base, "--tuned", "--compile", "off", "--bucket-cap-mb", "50"])
    assert mixed.variant == "tuned" and mixed.backend_options["compile"] is False
    assert mixed.backend_options["bucket_cap_mb"] == 50 and mixed.backend_options["adamw"] == "fused"
    # one by one, without --tuned: still the default variant, with that one setting
    one = cfg_for([*base, "--adamw", "fused"])
    assert one.variant == "default" and one.backend_options["adamw"] == "fused"


def test_the_variant_is_in_the_label_the_config_and_the_match_key():
    tuned, default = make_record("horovod", 2, variant="tuned"), make_record("horovod", 2)
    assert tuned["backend_info"]["label"] == "horovod+tuned" and default["backend_info"]["label"] == "horovod"
    assert tuned["config"]["variant"] == "tuned" and tuned["backend_info"]["variant"] == "tuned"
    assert set(tuned["backend_info"]["tuned"]) == {"compile", "adamw"}
    assert tuned["backend_info"]["tuned"]["adamw"]["value"] == "fused"
    assert default["backend_info"]["tuned"] == {}
    assert config_key(tuned) != config_key(default)  # compare, history and sweeps never pair them
    assert RunConfig.from_dict(tuned["config"]).variant == "tuned"
    old = dict(default["config"])
    del old["variant"]  # a record from before variants
    assert RunConfig.from_dict(old).variant == "default"


def test_a_flag_several_stacks_share_is_taken_by_each_and_refused_by_the_others():
    for name in ("torch-ddp", "torch-fsdp", "horovod"):
        assert cfg_for(
            ["--backend", name, "--gpus", "2", "--device", "cpu", "--compile", "on"]
        ).backend_options["compile"]
    with pytest.raises(UsageError, match="--compile is an option of backends torch-ddp, torch-fsdp, horovod"):
        cfg_for(["--backend", "deepspeed", "--gpus", "2", "--device", "cpu", "--compile", "on"])


def test_the_schedules_follow_the_bucket_and_fusion_settings():
    """DDP's buckets and Horovod's fusion buffer are what the analytic schedule (and the prediction) read:
    a tuned run is priced with its own buffers, not the defaults."""

    def messages(argv, workload="small"):
        cfg = cfg_for(["--gpus", "2", "--device", "cpu", "--workload", workload, *argv])
        return get_backend(cfg.backend).schedule(cfg).messages

    def calls(argv, workload="small"):
        return len(messages(argv, workload))

    ddp, tuned = ["--backend", "torch-ddp"], ["--backend", "torch-ddp", "--tuned"]
    for workload in ("tiny", "small"):  # DDP's own buckets, its 1 MiB first one included
        assert messages(tuned, workload) == messages(ddp, workload)
    assert calls(ddp, "350m") > calls(tuned, "350m")  # 25 -> 100 MiB
    assert calls(["--backend", "horovod", "--hvd-fusion-mb", "8"]) > calls(["--backend", "horovod"])


@pytest.mark.parametrize(("workload", "cap"), [("tiny", None), ("small", None), ("350m", 100), ("1b", 100)])
def test_torch_ddp_s_tuned_buckets_follow_the_model_and_say_why(workload, cap):
    """DDP's own buckets until torchtitan's 100 MiB would still cut the fp32 gradients into ten buckets or
    more (350m: 1,354 MiB); the setting's source says which rule chose it, for how many MiB."""
    cfg = RunConfig.build(
        backend="torch-ddp", workload=workload, spec=PRESETS[workload], world_size=2, device="cpu"
    )
    tuned = get_backend("torch-ddp").tuned(cfg)
    grad_mib = f"{PRESETS[workload].n_params * 4 / 2**20:.0f} MiB"
    if cap is None:
        assert "bucket_cap_mb" not in tuned
        assert f"DDP's own buckets kept for {grad_mib}" in tuned["compile"].source
    else:
        assert tuned["bucket_cap_mb"].value == cap
        assert "torchtitan" in tuned["bucket_cap_mb"].source and grad_mib in tuned["bucket_cap_mb"].source


def test_horovod_states_its_fusion_settings_to_every_worker():
    cfg = cfg_for(["--backend", "horovod", "--gpus", "2", "--device", "cpu", "--hvd-cycle-ms", "3.5"])
    env = get_backend("horovod").worker_env(cfg)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(128 << 20) and env["HOROVOD_CYCLE_TIME"] == "3.5"
    assert "HOROVOD_AUTOTUNE" not in env


def test_a_sweep_of_both_variants_plans_each_backend_and_n_twice(monkeypatch):
    for backend in all_backends():
        monkeypatch.setattr(type(backend), "availability", lambda self, python=None: (True, ""))
    argv = "sweep --backends torch-ddp,tf-mwms --gpus 1,2 --repeats 1 --device cpu --variants default,tuned"
    runs, _ = sweep_plan(make_parser().parse_args(argv.split()))
    labels = [(r.backend.label(r.cfg), r.cfg.topology.world_size) for r in runs]
    assert labels == [
        ("torch-ddp", 1),
        ("torch-ddp", 2),
        ("torch-ddp+tuned", 1),
        ("torch-ddp+tuned", 2),
        ("tf-mwms", 1),
        ("tf-mwms", 2),
        ("tf-mwms-xla+tuned", 1),
        ("tf-mwms-xla+tuned", 2),
    ]
    for bad in ("--variants fast", "--variants tuned --tuned"):
        with pytest.raises(UsageError):
            sweep_plan(make_parser().parse_args([*argv.split()[:-2], *bad.split()]))


def test_the_selection_ranks_tuned_against_tuned_and_says_so(tmp_path, capsys):
    """Default runs of every stack, tuned runs of three: the ranking holds the three tuned and the others'
    defaults, never a stack twice, and says which were measured only by default."""
    tuned_labels = ("torch-ddp", "horovod", "tf-mwms")
    for label in BACKENDS:
        for repeat in range(2):
            for n, t in ((1, 0.1), (2, 0.125)):
                rec = make_record(label, n, t, repeat=repeat)
                write_json_atomic(tmp_path / f"{rec['run_id']}.json", rec)
                if label in tuned_labels:
                    rec = make_record(label, n, t * 0.8, repeat=repeat, variant="tuned")
                    write_json_atomic(tmp_path / f"{rec['run_id']}.json", rec)
    assert main(["report", str(tmp_path), "--at-gpus", "2"]) == 0
    md = capsys.readouterr().out
    assert "Framework selection at N=2 (tuned against tuned)" in md
    ranked = [label for _, label in re.findall(r"^\| (\d) \| ([\w+-]+) \|", md, re.M)]
    assert sorted(ranked) == sorted(
        [
            "torch-ddp+tuned",
            "horovod+tuned",
            "tf-mwms-xla+tuned",
            "torch-fsdp",
            "deepspeed-zero3",
            "paddle-fleet",
        ]
    )
    assert "measured only by default: deepspeed-zero3, paddle-fleet, torch-fsdp" in md
    assert "(0.50x torch-ddp+tuned)" in md  # FSDP's model state against plain DDP's, in its tuned variant
    # the scaling table keeps both variants
    assert re.search(r"^\| torch-ddp \| 2 \|", md, re.M) and re.search(
        r"^\| torch-ddp\+tuned \| 2 \|", md, re.M
    )


def test_the_first_step_is_the_slowest_ranks_first_warm_up_step():
    """What compiling costs, once per launch: the first warm-up step of the slowest rank, in no statistic
    over the measured steps (None without warm-up step times, never guessed from the measured ones)."""
    from harness.analyze.metrics import summarize

    rec = make_record("torch-ddp", 2, 0.1, variant="tuned")
    assert summarize(rec)["first_step_s"] is None
    rec["ranks"][0]["warmup_step_times"] = [4.5, 0.2]
    assert summarize(rec)["first_step_s"] is None  # one rank's is not the run's
    rec["ranks"][1]["warmup_step_times"] = [6.0, 0.1]
    s = summarize(rec)
    assert s["first_step_s"] == 6.0 and s["step_time_s"]["median"] == pytest.approx(0.1)


@pytest.mark.parametrize("workload", ["tiny", "1b"])
def test_deepspeed_s_tuned_zero3_follows_the_model_s_size_and_its_default_stays_deepspeed_s(workload):
    """ZeRO-3's tuned buckets and persistence are Hugging Face's "auto" values from the hidden size d
    (reduce d^2, prefetch 0.9 d^2, persistence 10 d); the live-parameter and reuse caps are raised only
    where the model outgrows DeepSpeed's 1e9 (1b: 1.32B parameters), to what binds nowhere. The default
    variant keeps DeepSpeed's own values, written into the config so that the record names them."""
    from backends.deepspeed_zero.ds_config import ds_config

    base = ["--backend", "deepspeed", "--gpus", "2", "--device", "cpu", "--workload", workload]
    default, tuned = cfg_for(base), cfg_for([*base, "--tuned"])
    d, n = PRESETS[workload].d_model, PRESETS[workload].n_params
    assert ds_config(default)["zero_optimization"] == {
        "stage": 3,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "reduce_bucket_size": 500_000_000,
    }
    zero = ds_config(tuned)["zero_optimization"]
    assert zero["reduce_bucket_size"] == d * d and zero["stage3_prefetch_bucket_size"] == int(0.9 * d * d)
    assert zero["stage3_param_persistence_threshold"] == 10 * d
    big = n > 1_000_000_000
    assert zero["stage3_max_live_parameters"] == (n if big else 1_000_000_000)
    assert zero["stage3_max_reuse_distance"] == (2 * n if big else 1_000_000_000)
    sources = get_backend("deepspeed").tuned(tuned)
    assert f"{d}^2" in sources["reduce_bucket"].source and "transformers" in sources["reduce_bucket"].source
    assert ("max_live_parameters" in sources) == big and ("max_reuse_distance" in sources) == big
    # the schedule prices the settings as run: at 1b the default gathers 14 blocks again for backward
    regathers = {
        cfg.variant: next(t for t in get_backend("deepspeed").schedule(cfg).terms if "re-gathered" in t.what)
        for cfg in (default, tuned)
    }
    assert (len(regathers["default"].calls) > 0) == big and regathers["tuned"].calls == ()
    # below stage 3 nothing of ZeRO-3's is tuned
    assert not {"reduce_bucket", "prefetch_bucket", "persistence_threshold"} & set(
        get_backend("deepspeed").tuned(cfg_for([*base, "--zero-stage", "2"]))
    )


def test_deepspeed_s_tuned_bf16_gathers_bf16_and_reduces_fp32_within_the_definition():
    """In bf16 the tuned set runs DeepSpeed's bf16 module with communication_data_type fp32: ZeRO-3 gathers
    half the default's bytes (bf16 parameters, as FSDP2's param_dtype) and still reduce-scatters fp32
    gradients, so the run meets the suite's definition; the default (torch_autocast over fp32 parameters)
    gathers fp32, and the native module without the fp32 reduction is a named deviation."""
    from backends.deepspeed_zero.ds_config import ds_config

    base = ["--backend", "deepspeed", "--gpus", "2", "--device", "cuda", "--precision", "bf16"]
    adapter = get_backend("deepspeed")
    default, tuned = cfg_for(base), cfg_for([*base, "--tuned"])
    config = ds_config(tuned)
    assert config["bf16"] == {"enabled": True} and config["communication_data_type"] == "fp32"
    assert "torch_autocast" not in config and adapter.numerics(tuned).deviations(tuned) == []
    assert adapter.numerics(tuned).forward_params == "bf16"
    assert adapter.stack_label(tuned) == "deepspeed-zero3-native-fp32reduce"

    def bytes_per_element(cfg):
        return {(t.op, t.dtype_bytes) for t in adapter.schedule(cfg).terms if t.calls and t.elements > 64}

    assert bytes_per_element(default) == {("all_gather", 4), ("reduce_scatter", 4)}
    assert bytes_per_element(tuned) == {("all_gather", 2), ("reduce_scatter", 4)}
    native = cfg_for([*base, "--ds-mixed-precision", "native"])
    assert adapter.numerics(native).deviations(native)  # reduced in bf16: named
    assert "communication_data_type" not in ds_config(native) and "fp32_reduce" not in adapter.tuned(
        cfg_for(base[:-2])
    )  # fp32 runs: no precision setting in the set
