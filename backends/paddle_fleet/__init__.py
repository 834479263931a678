"""paddle-fleet adapter: Paddle Fleet collective training started by `python -m paddle.distributed.launch`.

Data parallel (paddle.DataParallel) by default; `--sharding-stage` selects Paddle's ZeRO: stage 1 through
Fleet's hybrid topology (sharding_degree = world size: DygraphShardingOptimizer), stages 2 and 3 through
paddle.distributed.sharding.group_sharded_parallel, which Paddle 3.3.1 supports on GPU/XPU only.
"""

import math
import socket
from dataclasses import dataclass
from typing import Literal

from backends.attention import materialised_attention
from backends.base import (
    WORKER_SCRIPT,
    Backend,
    LaunchPlan,
    Options,
    Tuned,
    device_mask,
    option,
    switch,
    worker_python,
)
from backends.paddle_fleet.schedule import fleet_schedule
from core.config import InvalidConfig
from core.precision import LOW_PRECISIONS, autocast_numerics, low_precision_module_numerics
from core.process import Process

SHARDING = {0: "none", 1: "optimizer", 2: "gradients", 3: "parameters"}
# Paddle's own waits that can be set (PaddleFleet.timeouts)
PADDLE_NCCL_TIMEOUT = "PADDLE_PG_TIMEOUT"
PADDLE_GLOO_GROUP_STORE = "TCPStore(timeout) of each gloo topology group (backends.paddle_fleet.groups)"
AMP_LEVELS = ("O1", "O2")


@dataclass(frozen=True)
class PaddleOptions(Options):
    sharding_stage: int = option(
        0,
        "--sharding-stage",
        type=int,
        choices=(0, 1, 2, 3),
        help="shard optimizer state (1), + gradients (2), + parameters (3); 2 and 3 need "
        "a GPU; 0: plain data parallel",
    )
    amp_level: Literal["O1", "O2"] = option(
        "O1",
        "--amp-level",
        choices=AMP_LEVELS,
        help="with bf16/fp16: O1 autocast over fp32 parameters or O2 low-precision parameters "
        "with fp32 master weights",
    )
    to_static: bool = switch(
        False,
        "--to-static",
        help="paddle.jit.to_static the model's forward (a static graph Paddle optimises) before "
        "DataParallel wraps it",
    )


def master_ip(addr: str) -> str:
    """Paddle's launcher wants the master as an IP address; a name that does not resolve here (a plan
    written on a login node) is shown as given."""
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return addr


class PaddleFleet(Backend[PaddleOptions]):
    name = "paddle-fleet"
    framework = "paddle"
    launcher = "paddle.distributed.launch"
    extra = "paddle"
    collective_api = "paddle.distributed"
    compute_methods = ("no_sync", "isolated")
    kubeflow_job = "PaddleJob"
    Options = PaddleOptions

    def compute_methods_for(self, options):
        # Sharded optimizers reduce gradients inside their step: no sync-off switch, only the counterfactual.
        return ("isolated",) if options.sharding_stage else self.compute_methods

    def tuned(self, cfg):
        """The model's forward as a static graph (paddle.jit.to_static), then DataParallel, the pattern of
        PaddleNLP's trainers (model_zoo/bert/run_pretrain.py: to_static, then paddle.DataParallel); the
        whole train step under to_static is experimental with DataParallel (PaddlePaddle/Paddle#54402).
        Not in the set: CINN, which needs a CUDA build compiled with it; the fused attention, feed-forward
        and norm kernels of paddle.incubate, GPU-only and other layers than the spec's (their parameters
        are laid out differently); DataParallel's fuse size, whose default (25 MB) nothing recommends
        changing."""
        return {
            "to_static": Tuned(
                True,
                "PaddlePaddle/PaddleNLP model_zoo/bert/run_pretrain.py (to_static, then DataParallel); "
                "PaddlePaddle/Paddle python/paddle/jit/api.py",
                numerics=True,
            )
        }

    def stack_label(self, cfg):
        stage = self.options(cfg).sharding_stage
        return self.name + (f"-s{stage}" if stage else "") + ("-O2" if self.master_weights(cfg) else "")

    def master_weights(self, cfg) -> bool:
        return cfg.model.precision != "fp32" and self.options(cfg).amp_level == "O2"

    def precision_scheme(self, cfg):
        return "master" if self.master_weights(cfg) else "autocast"

    def numerics(self, cfg):
        """O1: paddle.amp.auto_cast over fp32 parameters, matmuls in the low precision, gray-list ops
        (the residual sums) in fp32 when an input is fp32, LayerNorm in fp32: autocast's numerics. O2
        (paddle.amp.decorate): the Linear and embedding parameters themselves in the low precision, so the
        forward, the residual stream and the gradients DataParallel reduces are too; the fp32 master
        weights live in the optimizer. Paddle has no setting that reduces those gradients in fp32."""
        if not self.master_weights(cfg):
            return autocast_numerics(cfg, "paddle.amp.auto_cast O1 over fp32 parameters")
        low = cfg.model.precision
        return low_precision_module_numerics(
            cfg,
            f"paddle.amp.decorate O2: {low} parameters, fp32 master weights in the optimizer",
            "--amp-level O2: Paddle reduces the gradients of its low-precision weights",
        )

    def sharding(self, cfg):
        return SHARDING[self.options(cfg).sharding_stage]

    def settings(self, cfg):
        """Off a GPU, Paddle's scaled_dot_product_attention takes its math path (paddle.nn.functional.
        flash_attention._select_sdp: "math" wherever the place is not a GPU), which materialises every
        layer's softmax: measured by tests/probes/saved_activations.py as H·T more fp32 elements a token and
        layer (4 x d_model on `tiny` at T = 128) than the torch model, whose CPU kernel is fused."""
        if cfg.topology.device == "cuda":
            return {}
        return {"attention": materialised_attention(cfg, "Paddle's attention takes its math path off a GPU")}

    def validate(self, cfg):
        """What Paddle's CPU build cannot train, refused before launch rather than by every worker after
        it: paddle.amp casts only on GPU/XPU (on CPU its autocast 'makes no effect', so a bf16 run would
        train in fp32), and group_sharded_parallel (stages 2 and 3) supports only GPU/XPU devices. A
        commbench run's bf16 is a message dtype, not autocast, and stays allowed."""
        if cfg.topology.device == "cuda":
            return
        if cfg.model.precision in LOW_PRECISIONS and cfg.role.commbench is None:
            raise InvalidConfig(
                f"paddle-fleet --precision {cfg.model.precision} needs --device cuda: Paddle's amp does not "
                "cast on CPU; on CPU use --precision fp32"
            )
        stage = self.options(cfg).sharding_stage
        if stage >= 2:
            raise InvalidConfig(
                f"paddle-fleet --sharding-stage {stage} needs --device cuda: Paddle's group_sharded_parallel "
                "runs on GPU/XPU only; on CPU use --sharding-stage 0 or 1"
            )

    def features(self):
        return {**super().features(), "sharding": list(SHARDING.values())}

    def schedule(self, cfg):
        """Gradients travel in the parameters' dtype: fp32 under O1, bf16/fp16 under O2; the collectives
        per stage: schedule.py."""
        return fleet_schedule(cfg, self.options(cfg).sharding_stage, 2 if self.master_weights(cfg) else 4)

    def collective_ops(self, cfg):
        """Paddle's gloo process group (CPU) implements no reduce_scatter or all_to_all."""
        if cfg.topology.device == "cuda":
            return super().collective_ops(cfg)
        return ("all_reduce", "all_gather", "broadcast")

    def timeouts(self, cfg):
        """Paddle's NCCL process groups (GPU) give up on a collective after PADDLE_PG_TIMEOUT ms (30 min by
        default), and each gloo group Fleet's topology makes (CPU) meets over a store of its own
        (backends.paddle_fleet.groups says why) that waits as long as the run's collective timeout. Paddle
        3.3.1 lets nothing set its other waits: a gloo context's 30 s (gloo's default; Paddle never calls its
        setTimeout), which bounds one collective's wait for a peer and each connection of a group's full
        mesh once the peer's address is in the store, and the job's own store (init_parallel_env's
        create_or_get_global_tcp_store: TCPStore's 900 s)."""
        return {PADDLE_NCCL_TIMEOUT: cfg.collective_timeout, PADDLE_GLOO_GROUP_STORE: cfg.collective_timeout}

    def launch(self, cfg, run_dir, port, devices):
        """One launcher per node. Alone (one node, or an isolated worker): --ips 127.0.0.1 --start_port
        makes `port` the rendezvous store's port, so concurrent runs never share one. Several nodes: the
        launchers meet at the master's store (--master ip:port), each with its node rank. Devices: the
        launcher reads --devices as labels of CUDA_VISIBLE_DEVICES, so both are the physical ids."""
        argv = [
            worker_python(cfg),
            "-m",
            "paddle.distributed.launch",
            f"--nproc_per_node={cfg.local_procs}",
            f"--log_dir={run_dir / 'paddle_launch'}",
            "--max_restart=0",
        ]
        if cfg.role.isolated_index is None and cfg.topology.nodes > 1:
            argv += [
                f"--nnodes={cfg.topology.nodes}",
                f"--rank={cfg.topology.node_rank}",
                f"--master={master_ip(cfg.topology.master_addr)}:{port}",
            ]
        else:
            argv += ["--ips=127.0.0.1", f"--start_port={port}"]
        if devices:
            argv.append(f"--devices={','.join(devices)}")
        env = {
            **self.worker_env(cfg),
            **device_mask(devices),
            PADDLE_NCCL_TIMEOUT: str(math.ceil(self.timeouts(cfg)[PADDLE_NCCL_TIMEOUT] * 1000)),  # in ms
        }
        return LaunchPlan([Process(argv + [str(WORKER_SCRIPT), str(run_dir)], env)])
