"""The spec's GPT in Paddle. Read side by side with torch_model.py and tf_model.py."""

from __future__ import annotations

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute

from workloads.spec import OPTIMIZER, ModelSpec, OptimizerSpec


class CausalSelfAttention(nn.Layer):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_heads = spec.n_heads
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(3, axis=2)
        q, k, v = (t.reshape([B, T, self.n_heads, C // self.n_heads]) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        )  # Paddle's layout is (B, T, heads, head_dim)
        return self.proj(y.reshape([B, T, C]))


class MLP(nn.Layer):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.fc = nn.Linear(spec.d_model, spec.d_ff)
        self.proj = nn.Linear(spec.d_ff, spec.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate=False))


class Block(nn.Layer):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.d_model, epsilon=spec.layer_norm_eps)
        self.attn = CausalSelfAttention(spec)
        self.ln2 = nn.LayerNorm(spec.d_model, epsilon=spec.layer_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Layer):
    def __init__(self, spec: ModelSpec, activation_checkpointing: bool = False):
        super().__init__()
        self.spec = spec
        self.activation_checkpointing = activation_checkpointing
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = nn.Embedding(spec.seq_len, spec.d_model)
        self.blocks = nn.LayerList([Block(spec) for _ in range(spec.n_layers)])
        self.ln_f = nn.LayerNorm(spec.d_model, epsilon=spec.layer_norm_eps)

    def forward(self, idx, targets=None):
        """Mean cross-entropy loss, or the logits when no targets are given."""
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(paddle.arange(T))
        for block in self.blocks:
            x = recompute(block, x) if self.activation_checkpointing else block(x)
        logits = self.ln_f(x) @ self.tok_emb.weight.T  # tied LM head
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.astype("float32").reshape([-1, logits.shape[-1]]), targets.reshape([-1])
        )

    @paddle.no_grad()
    def load_spec_weights(self, seed: int = 0):
        """Copy the spec's deterministic weights in, one tensor at a time (Linear already stores
        (in, out))."""
        params = dict(self.named_parameters())
        for name in self.spec.parameter_shapes():
            paddle_name = name + ".weight" if name.endswith("emb") else name
            params[paddle_name].set_value(self.spec.init_weight(name, seed))
        return self


def make_optimizer(model: nn.Layer, opt: OptimizerSpec = OPTIMIZER) -> paddle.optimizer.AdamW:
    """AdamW with weight decay on 2-D parameters only. apply_decay_param_fun is given Paddle's internal
    parameter name (e.g. "linear_3.w_0"), not the structured one, so the set is built from `p.name`."""
    decayed = {p.name for p in model.parameters() if opt.decays(tuple(p.shape))}
    return paddle.optimizer.AdamW(
        learning_rate=opt.lr,
        beta1=opt.beta1,
        beta2=opt.beta2,
        epsilon=opt.eps,
        parameters=model.parameters(),
        weight_decay=opt.weight_decay,
        apply_decay_param_fun=lambda name: name in decayed,
    )


def n_parameters(model: nn.Layer) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())  # shapes only: works under paddle.LazyGuard
