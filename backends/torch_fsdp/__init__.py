"""torch-fsdp adapter: FSDP2 (`fully_shard`) on every transformer block and on the root, launched by torchrun.

Parameters, gradients and AdamW state are all sharded (ZeRO-3 in FSDP's terms). bf16/fp16 go through FSDP's
MixedPrecisionPolicy: the sharded parameters, gradients and moments stay fp32, and FSDP casts parameters to
the low precision when it all-gathers them, so the collectives move low-precision elements.
"""
from backends.base import Backend, CommPattern, torchrun

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class TorchFSDP(Backend):
    name = "torch-fsdp"
    framework = "torch"
    launcher = "torchrun"
    requires = ("torch",)
    worker_module = "backends.torch_fsdp.worker"
    # With gradient sync off FSDP would still all-gather every parameter, so only the isolated
    # counterfactual measures compute without communication.
    compute_methods = ("isolated",)
    mixed_precision = "autocast"  # fp32 state, low-precision compute: the same bytes as autocast

    def add_arguments(self, parser):
        group = parser.add_argument_group("torch-fsdp")
        group.add_argument("--reshard-after-forward", choices=("on", "off"),
                           help="torch-fsdp: free each block's gathered parameters after forward and gather "
                                "them again for backward (on, default: less memory), or keep them (off)")
        group.add_argument("--fp32-reduce", action="store_true", default=None,
                           help="torch-fsdp with bf16/fp16: reduce-scatter gradients in fp32 (reduce_dtype)")

    def options(self, args):
        return {"reshard_after_forward": args.reshard_after_forward != "off", "fp32_reduce": bool(args.fp32_reduce)}

    def label(self, cfg):
        opts = cfg.backend_options
        return (self.name + ("" if opts.get("reshard_after_forward", True) else "-noreshard")
                + ("-fp32reduce" if opts.get("fp32_reduce") and cfg.precision != "fp32" else ""))

    def sharding(self, cfg):
        return "parameters"

    def comm_pattern(self, cfg):
        """Blocks' parameters are all-gathered in the compute dtype for forward and, when resharded, again
        for backward; gradients are reduce-scattered in reduce_dtype. (FSDP keeps the root's parameters
        gathered from forward to backward in either case; the analytic volume counts them like the blocks'.)"""
        opts = cfg.backend_options
        gather = ELEMENT_BYTES[cfg.precision]
        reduce = 4 if opts.get("fp32_reduce") else gather
        return CommPattern("sharded", gather, reduce if reduce != gather else 0,
                           2 if opts.get("reshard_after_forward", True) else 1)

    def launch(self, cfg, run_dir, port):
        return [torchrun(self, cfg, run_dir, port)]
