"""One framework's GPT on fixed inputs, saved to .npz for tests/test_crossframework.py to compare.

    python tests/xf_probe.py {torch,tf,paddle} OUT.npz [--preset tiny]

Imports only the framework it probes (two in one process can crash), and runs on CPU in fp32 with one
thread. From the spec's weights (seed 0) it records the logits and loss on the probe batch (data step 0),
the losses of STEPS AdamW steps on data steps 0..STEPS-1 and the probe-batch loss after them, the first
CHECKPOINTED_STEPS of those steps again with activation checkpointing, which parameters one AdamW step with
zero gradients decays, and the parameter count of the built model and of every preset built without
allocating its weights (a 1.3B model would need 5 GB per framework).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU only, in every framework
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402

from workloads.data import SyntheticTokens  # noqa: E402
from workloads.spec import PRESETS, ModelSpec  # noqa: E402

SEED = 0
BATCH = 4
STEPS = 5
CHECKPOINTED_STEPS = 2


def batch(spec: ModelSpec, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of data step `step`: the same int64 tokens for every framework."""
    seqs = SyntheticTokens(spec.vocab_size, spec.seq_len, seed=SEED).samples(step, range(BATCH))
    return seqs[:, :-1], seqs[:, 1:]


def neutral_name(name: str) -> str:
    """Torch/Paddle parameter name -> the spec's name (embeddings are "tok_emb", not "tok_emb.weight")."""
    return name.removesuffix(".weight") if name.startswith(("tok_emb.", "pos_emb.")) else name


def probe_torch(spec: ModelSpec) -> dict:
    import torch

    from workloads.torch_model import GPT, make_optimizer, n_parameters

    torch.set_num_threads(1)

    def train(model, n_steps):
        optimizer, losses = make_optimizer(model), []
        for step in range(n_steps):
            x, y = (torch.from_numpy(a) for a in batch(spec, step))
            loss = model(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    x, y = (torch.from_numpy(a) for a in batch(spec, 0))
    model = GPT(spec).load_spec_weights(SEED)
    out = {"n_params": n_parameters(model)}
    with torch.no_grad():
        out["logits"], out["loss"] = model(x).numpy(), model(x, y).item()
    out["losses"] = train(model, STEPS)
    with torch.no_grad():
        out["final_loss"] = model(x, y).item()
    out["checkpointed_losses"] = train(
        GPT(spec, activation_checkpointing=True).load_spec_weights(SEED), CHECKPOINTED_STEPS
    )

    model = GPT(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
            p.grad = torch.zeros_like(p)
    make_optimizer(model).step()
    out["decayed"] = [neutral_name(n) for n, p in model.named_parameters() if p.min() < 1]

    def count_without_weights(preset):
        with torch.device("meta"):
            return n_parameters(GPT(preset))

    out["preset_n_params"] = [count_without_weights(preset) for preset in PRESETS.values()]
    return out


def probe_tf(spec: ModelSpec) -> dict:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    from workloads.tf_model import GPT, make_optimizer, n_parameters

    def train(model, n_steps):
        optimizer, losses = make_optimizer(model), []
        for step in range(n_steps):
            x, y = batch(spec, step)
            with tf.GradientTape() as tape:
                loss = model(x, y)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        return losses

    x, y = batch(spec, 0)
    model = GPT(spec).load_spec_weights(SEED)
    out = {"n_params": n_parameters(model)}
    out["logits"], out["loss"] = model(x).numpy(), float(model(x, y))
    out["losses"] = train(model, STEPS)
    out["final_loss"] = float(model(x, y))
    out["checkpointed_losses"] = train(
        GPT(spec, activation_checkpointing=True).load_spec_weights(SEED), CHECKPOINTED_STEPS
    )

    model = GPT(spec)
    for v in model.trainable_variables:
        v.assign(tf.ones(v.shape))
    make_optimizer(model).apply_gradients([(tf.zeros(v.shape), v) for v in model.trainable_variables])
    out["decayed"] = [n for n, v in model.spec_variables().items() if float(tf.reduce_min(v)) < 1]

    def count_without_weights(preset):
        # Variables created in a StatelessScope stay uninitialised; initialize_variables=False keeps its exit
        # from allocating them (the default would fill all 1.3B).
        with keras.StatelessScope(initialize_variables=False):
            return n_parameters(GPT(preset))

    out["preset_n_params"] = [count_without_weights(preset) for preset in PRESETS.values()]
    return out


def probe_paddle(spec: ModelSpec) -> dict:
    import paddle

    from workloads.paddle_model import GPT, make_optimizer, n_parameters

    paddle.set_device("cpu")

    def train(model, n_steps):
        optimizer, losses = make_optimizer(model), []
        for step in range(n_steps):
            x, y = (paddle.to_tensor(a) for a in batch(spec, step))
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        return losses

    x, y = (paddle.to_tensor(a) for a in batch(spec, 0))
    model = GPT(spec).load_spec_weights(SEED)
    out = {"n_params": n_parameters(model)}
    with paddle.no_grad():
        out["logits"], out["loss"] = model(x).numpy(), float(model(x, y))
    out["losses"] = train(model, STEPS)
    with paddle.no_grad():
        out["final_loss"] = float(model(x, y))
    out["checkpointed_losses"] = train(
        GPT(spec, activation_checkpointing=True).load_spec_weights(SEED), CHECKPOINTED_STEPS
    )

    model = GPT(spec)
    for p in model.parameters():
        p.set_value(np.ones(p.shape, np.float32))
    optimizer = make_optimizer(model)
    sum(
        (p * 0).sum() for p in model.parameters()
    ).backward()  # Paddle has no setter for .grad: zero gradients
    optimizer.step()
    out["decayed"] = [neutral_name(n) for n, p in model.named_parameters() if float(p.min()) < 1]

    def count_without_weights(preset):
        with paddle.LazyGuard():
            return n_parameters(GPT(preset))

    out["preset_n_params"] = [count_without_weights(preset) for preset in PRESETS.values()]
    return out


PROBES = {"torch": probe_torch, "tf": probe_tf, "paddle": probe_paddle}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("framework", choices=PROBES)
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", default="tiny", choices=PRESETS)
    args = parser.parse_args()
    out = PROBES[args.framework](PRESETS[args.preset])
    np.savez(args.out, preset_names=list(PRESETS), **{k: np.asarray(v) for k, v in out.items()})


if __name__ == "__main__":
    main()
