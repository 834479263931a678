"""Hand-made run records with known answers, built through the real schema: raw rank records in the shape
backends.base.run_training writes, assembled as harness.run.runner.execute does, summarized by
harness.analyze.metrics.summarize. Lets analysis/report tests cover every backend without launching one."""
from __future__ import annotations

from core.config import RunConfig
from harness.analyze.metrics import summarize
from core.records import SCHEMA_VERSION
from workloads.spec import PRESETS

DEVICE = "cpu: Test CPU"
STEPS = 4

# label -> (backend, framework, launcher, sharding, comm kind) for the six stacks
BACKENDS = {
    "torch-ddp": ("torch-ddp", "torch", "torchrun", "none", "allreduce"),
    "torch-fsdp": ("torch-fsdp", "torch", "torchrun", "parameters", "sharded"),
    "deepspeed-zero3": ("deepspeed", "torch", "deepspeed", "parameters", "sharded"),
    "horovod": ("horovod", "torch", "horovodrun --gloo", "none", "allreduce"),
    "tf-mwms": ("tf-mwms", "tensorflow", "TF_CONFIG per worker", "none", "allreduce"),
    "paddle-fleet": ("paddle-fleet", "paddle", "paddle.distributed.launch", "none", "allreduce"),
}


def make_rank(rank: int, step_time: float, compute_time: float | None, peak_rss: int, state_total: float,
              allocated: int | None = None) -> dict:
    memory = {"peak_rss": peak_rss}
    if allocated is not None:
        memory.update(allocated_peak=allocated, reserved_peak=allocated)
    third = state_total / 4
    return {
        "rank": rank, "host": "testhost", "device": DEVICE, "pid": 1000 + rank, "status": "ok",
        "step_times": [step_time] * STEPS, "data_wait": [0.0] * STEPS,
        "losses": [7.0 - 0.1 * i for i in range(STEPS)], "warmup_losses": [7.1],
        "compute_only_step_times": [compute_time] * STEPS if compute_time else [],
        "memory": memory, "model_state_bytes": {"params": third, "grads": third, "optimizer": 2 * third,
                                                "total": state_total},
        "versions": {"python": "3.11", "torch": "test"}, "threads": 1,
    }


def make_record(label: str = "torch-ddp", gpus: int = 1, step_time: float = 0.1, compute_time: float | None = None,
                peak_rss: int = 400 << 20, state_total: float | None = None, allocated: int | None = None,
                status: str = "ok", repeat: int = 0, sweep_id: str = "sweep-test", precision: str = "fp32",
                workload: str = "tiny", micro_batch: int = 8, scaling: str = "weak", run_id: str | None = None,
                start_time: str = "2026-01-01T00:00:00+00:00") -> dict:
    """A valid run record whose every rank took `step_time` per step (and `compute_time` per step with sync
    off); state_total defaults to the spec's analytic model state for the backend's sharding."""
    backend, framework, launcher, sharding, kind = BACKENDS[label]
    spec = PRESETS[workload]
    cfg = RunConfig(backend=backend, workload=workload, spec=spec, world_size=gpus, device="cpu", precision=precision,
                    micro_batch=micro_batch, steps=STEPS, warmup=1, compute_method="no_sync", threads_per_worker=1,
                    scaling=scaling)
    if state_total is None:
        state_total = spec.model_state_bytes(precision, "autocast", sharding, gpus)["total"]
    ranks = [make_rank(r, step_time, compute_time, peak_rss, state_total, allocated) for r in range(gpus)]
    error = None
    if status != "ok":
        ranks = [{"rank": 1, "host": "testhost", "status": status, "error": "RuntimeError: injected fault at step 1",
                  "memory": {"peak_rss": peak_rss}}]
        error = {"rank": 1, "message": "RuntimeError: injected fault at step 1", "log_tail": []}
    run_id = run_id or f"test-{label}-n{gpus}-r{repeat}-{status}"
    record = {
        "schema_version": SCHEMA_VERSION, "run_id": run_id, "status": status, "error": error,
        "config": cfg.to_dict(),
        "backend_info": {"label": label, "framework": framework, "launcher": launcher, "sharding": sharding,
                         "precision_scheme": "autocast",
                         "comm_pattern": {"kind": kind, "dtype_bytes": 4}},
        "launch": {"returncodes": [0], "elapsed_s": 1.0, "log_dir": f"logs/{run_id}"},
        "comm": {"t_compute_method": "no_sync" if gpus > 1 else "none"},
        "ranks": ranks, "isolated_ranks": [],
        "environment": {"device_type": "cpu", "device_kind": DEVICE if status == "ok" else None,
                        "device_names": [DEVICE] * gpus, "hostnames": ["testhost"], "world_size": gpus,
                        "threads_per_worker": 1, "harness_host": "testhost", "cpu_count": 2,
                        "platform": "Linux-test", "python": "3.11", "versions": {"python": "3.11", "torch": "test"},
                        "git": {"commit": "abc123", "dirty": False}, "command_line": ["harness"],
                        "start_time": start_time, "end_time": start_time},
        "sweep": {"id": sweep_id, "repeat": repeat},
    }
    record["summary"] = summarize(record)
    return record


def tokens_per_step(gpus: int, micro_batch: int = 8, workload: str = "tiny") -> int:
    return micro_batch * gpus * PRESETS[workload].seq_len

