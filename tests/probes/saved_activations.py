"""Bytes of activations the spec's GPT keeps for backward, in PyTorch or Paddle on a CPU: every tensor
autograd saves during one forward (torch.autograd.graph / paddle.autograd saved_tensors_hooks), parameters
left out, each storage counted once, split into what the blocks save and what the head saves after them.

    python saved_activations.py FRAMEWORK CASES_JSON

CASES_JSON: a list of {"spec": ModelSpec dict, "micro_batch": int, "checkpointing": bool}; prints a JSON list
of {"blocks": bytes, "head": bytes}, one per case."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workloads.spec import ModelSpec  # noqa: E402

framework, cases = sys.argv[1], json.loads(sys.argv[2])
if framework == "torch":
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from workloads.torch_model import GPT

    def identify(t) -> tuple[int, int]:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def tokens(spec, micro):
        return torch.randint(0, spec.vocab_size, (micro, spec.seq_len))
else:
    import paddle
    from paddle.autograd import saved_tensors_hooks

    from workloads.paddle_model import GPT

    paddle.set_device("cpu")

    def identify(t) -> tuple[int, int]:
        return t.data_ptr(), int(t.numel()) * t.element_size()

    def tokens(spec, micro):
        return paddle.randint(0, spec.vocab_size, (micro, spec.seq_len))


results = []
for case in cases:
    spec = ModelSpec(**case["spec"])
    model = GPT(spec, activation_checkpointing=case["checkpointing"])
    params = {identify(p)[0] for p in model.parameters()}
    saved: dict[str, dict[int, int]] = {"blocks": {}, "head": {}}
    where = ["blocks"]

    def pack(t, saved=saved, where=where, params=params):
        address, nbytes = identify(t)
        if address not in params:
            saved[where[0]][address] = nbytes
        return t

    model.ln_f.register_forward_pre_hook(lambda *_, where=where: where.__setitem__(0, "head"))
    idx = tokens(spec, case["micro_batch"])
    with saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    results.append({k: sum(v.values()) for k, v in saved.items()})
print(json.dumps(results))
