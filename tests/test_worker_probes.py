"""The worker probes every framework family records on CPU: the fp32 math mode (TF32 is a GPU matter, so
None here), the peak-RSS scope after the loop's reset at the end of warm-up, and tf-mwms's synchronize().

One 2-rank tiny run per family (torch-ddp, tf-mwms, paddle-fleet), all on torch-ddp's global batch, so
their losses must agree.

What a CPU run cannot show: that tf-mwms's synchronize() waits for the step's all-reduce and optimizer
tail. On CPU a tf.function call returns only after all of its ops ran (and even under async eager the loss
read-back waits for the whole function), so there is nothing left to wait for, with or without it. What it
does show: that the sync runs in a multi-worker MWMS job at all (tf.test.experimental.sync_devices(), which
syncs every logical device, fails there: the other workers' devices are in the device list and this eager
context cannot run ops on them) and leaves the losses alone. The GPU side is scripts/gpu_check.sh's, which
times what synchronize() still waits for after the loss read-back and reads the optimizer's step counter.
"""

import numpy as np
import pytest
from conftest import run_record

FAMILIES = ("torch-ddp", "tf-mwms", "paddle-fleet")
COMMON = ["--gpus", "2", "--workload", "tiny", "--micro-batch", "8", "--steps", "3", "--warmup", "1"]
COMMON += ["--compute-method", "none", "--timeout", "180"]  # no counterfactual: the ranks' own records only
LOSS_ATOL = 3e-5  # the cross-framework bound of tests/test_crossframework.py


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """`record(backend)`: that family's run record, run once on first use (one run at a time); a family
    whose run fails fails its own tests only."""
    done = {}

    def get(backend: str) -> dict:
        if backend not in done:
            done[backend] = run_record(tmp_path_factory.mktemp(backend), "--backend", backend, *COMMON)
        return done[backend]

    return get


@pytest.mark.parametrize("backend", FAMILIES)
def test_cpu_ranks_record_no_tf32_and_peaks_after_warmup(record, backend):
    rec = record(backend)
    assert rec["status"] == "ok", rec["error"]
    assert [r["rank"] for r in rec["ranks"]] == [0, 1]
    for r in rec["ranks"]:
        assert r["device"].startswith("cpu")
        mode = r["math_mode"]
        assert mode["tf32"] is None  # not applicable on CPU: neither True nor False
        # but the fp32 rule (core.precision) ran: every TF32 switch of the framework set to IEEE, read back
        switches = mode["tf32_setting"].split(", ")
        assert switches and all(s.endswith(("=ieee", "=False")) for s in switches), switches
        assert mode["numerics"]["compute"] == "fp32" and mode["numerics"]["observed"]["tf32"] is False
        memory = r["memory"]
        assert memory["peak_rss_scope"] == "after warm-up" and memory["peak_rss"] > 50e6
        assert set(memory) == {"peak_rss", "peak_rss_scope"}  # no allocator peaks, no NVML sample on CPU
        assert len(r["step_times"]) == len(r["data_prep"]) == len(r["losses"]) == 3
        assert len(r["warmup_losses"]) == 1


def test_tf_synchronize_runs_across_workers_and_keeps_the_losses(record):
    tf = record("tf-mwms")  # run_record fails here on a sync that reaches the other worker's devices
    np.testing.assert_allclose(
        tf["summary"]["losses"], record("torch-ddp")["summary"]["losses"], rtol=0, atol=LOSS_ATOL
    )
