"""TensorFlow's collectives for `harness commbench`: the replica context's all_reduce (SUM) and all_gather
under MultiWorkerMirroredStrategy, one replica per worker, with the communication implementation training
uses (backends.tf_mwms.communication: --collective, where `auto` on a GPU is NCCL) and the run's timeout.
TensorFlow's distribute API offers no reduce-scatter, broadcast or all-to-all to a training loop, so
commbench measures only these two for tf-mwms."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from backends.commbench import Collectives, message_elements
from backends.process_stats import cpu_name
from backends.tf_mwms.worker import communication_options, set_health_check_timeouts, sync_worker_devices

DTYPES = {"fp32": tf.float32, "bf16": tf.bfloat16}


class TFCollectives(Collectives):
    framework = "tensorflow"

    def __init__(self, cfg):
        super().__init__(cfg)
        tf.config.threading.set_intra_op_parallelism_threads(cfg.topology.threads_per_worker)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        set_health_check_timeouts(cfg)
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=communication_options(cfg)
        )
        gpus = tf.config.list_physical_devices("GPU")
        details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
        self.device_name = details.get("device_name", "GPU") if gpus else cpu_name()
        self.dtype = DTYPES[self.spec.dtype]
        sum_ = tf.distribute.ReduceOp.SUM

        def replica(fn):
            """fn on this worker's replica. The input is copied onto the replica's device first: a value
            from outside has no device the strategy knows ("destinations can not be empty")."""
            return tf.function(lambda x: self.strategy.run(lambda t: fn(tf.identity(t)), args=(x,)))

        self.functions = {
            "all_reduce": replica(lambda t: tf.distribute.get_replica_context().all_reduce(sum_, t)),
            "all_gather": replica(lambda t: tf.distribute.get_replica_context().all_gather(t, axis=0)),
        }
        self.output = None
        self.token = tf.ones([1], tf.float32)

    def prepare(self, op, elements, value):
        sent, _ = message_elements(op, elements, self.world_size)  # TF allocates the output
        return tf.fill([sent], tf.constant(value, self.dtype))

    def call(self, op, buffers):
        self.output = self.functions[op](buffers)

    def result(self, op, buffers):
        local = self.strategy.experimental_local_results(self.output)[0]
        return np.asarray(tf.cast(local, tf.float64)).reshape(-1)

    def barrier(self):
        """MWMS has no barrier: a one-element all-reduce that every worker must join, waited for."""
        self.functions["all_reduce"](self.token)
        self.synchronize()

    def synchronize(self):
        sync_worker_devices(self.strategy)

    def versions(self):
        return {"tensorflow": tf.__version__}


def make_collectives(cfg):
    return TFCollectives(cfg)
