"""The spec's GPT in PyTorch, nanoGPT style. Read side by side with tf_model.py and paddle_model.py."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workloads.spec import OPTIMIZER, ModelSpec, OptimizerSpec


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_heads = spec.n_heads
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.fc = nn.Linear(spec.d_model, spec.d_ff)
        self.proj = nn.Linear(spec.d_ff, spec.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.attn = CausalSelfAttention(spec)
        self.ln2 = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec, activation_checkpointing: bool = False):
        super().__init__()
        self.spec = spec
        self.activation_checkpointing = activation_checkpointing
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = nn.Embedding(spec.seq_len, spec.d_model)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)

    def forward(self, idx, targets=None):
        """Mean cross-entropy loss, or the logits when no targets are given."""
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing else block(x)
        logits = self.ln_f(x) @ self.tok_emb.weight.t()  # tied LM head
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def load_spec_weights(self, seed: int = 0):
        """Copy the spec's deterministic weights in, one tensor at a time (nn.Linear stores W transposed)."""
        params = dict(self.named_parameters())
        for name in self.spec.parameter_shapes():
            array = self.spec.init_weight(name, seed)
            torch_name = name + ".weight" if name.endswith("emb") else name
            if name.endswith("weight") and array.ndim == 2:
                array = np.ascontiguousarray(array.T)
            params[torch_name].copy_(torch.from_numpy(array))
        return self


def optimizer_groups(model: nn.Module, opt: OptimizerSpec = OPTIMIZER) -> list[dict]:
    """AdamW parameter groups: weight decay on 2-D tensors only. Build them before any wrapper flattens
    or partitions the parameters (ZeRO-3 makes every parameter 1-D)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if opt.decays(tuple(p.shape))], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if not opt.decays(tuple(p.shape))], "weight_decay": 0.0},
    ]


def make_optimizer(
    model: nn.Module, opt: OptimizerSpec = OPTIMIZER, implementation: str = "default"
) -> torch.optim.AdamW:
    """torch's AdamW; `implementation` "foreach" or "fused" picks its multi-tensor or single-kernel
    version (the same update, rounded in another order), "default" leaves the choice to torch."""
    kernels = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[implementation]
    return torch.optim.AdamW(
        optimizer_groups(model, opt), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, **kernels
    )


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
