"""The framework-free model spec: one GPT-style decoder every backend builds, line for line the same.

Architecture (identical in every framework file): learned token and position embeddings, `n_layers`
pre-LayerNorm blocks (LN -> causal self-attention -> residual, LN -> MLP with exact erf GELU ->
residual), a final LayerNorm, and an LM head TIED to the token embedding (logits = x @ tok_emb.T), as in
GPT-2 and nanoGPT. Every Linear and LayerNorm has a bias. No dropout, so runs are deterministic.

Nothing here imports a deep-learning framework: the harness process uses it to count parameters and
FLOPs, and each worker uses `init_weights` so that every framework starts from the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from dataclasses import dataclass

import numpy as np

# Bytes of model state per parameter for AdamW, by how the precision is implemented.
#   fp32:                    param 4 + grad 4 + exp_avg 4 + exp_avg_sq 4
#   autocast (torch/TF/Paddle O1): the same fp32 params/grads/moments; low precision only in compute
#   master weights (ZeRO, Paddle O2): param 2 + grad 2 + fp32 master 4 + moments 8   (ZeRO paper, K=12)
# These three are 16 bytes per parameter; what differs is which part a backend shards.
#   fp32-master (ZeRO-1/2/3 over an fp32 module, in fp32 or under torch_autocast): fp32 param 4 + grad 4,
#   and the ZeRO optimizer's own fp32 copy of its partition 4 + moments 8: 20 bytes, at every precision.
PARAM_BYTES = {"fp32": 4, "autocast": 4, "master": 2, "fp32-master": 4}
GRAD_BYTES = {"fp32": 4, "autocast": 4, "master": 2, "fp32-master": 4}
OPTIMIZER_BYTES = {"fp32": 8, "autocast": 8, "master": 12, "fp32-master": 12}

# What a backend shards across N ranks, in ZeRO's terms.
SHARDING_LEVELS = ("none", "optimizer", "gradients", "parameters")


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for field in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.vocab_size > 1 << 32:
            raise ValueError(f"vocab_size must fit uint32 token files (<= {1 << 32:,})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter by framework-neutral name, in model order.

        Layout: a Linear's weight is stored (in_features, out_features), i.e. y = x @ W + b, as Keras and
        Paddle store it; PyTorch's nn.Linear stores the transpose and its model file transposes on load.
        """
        d, f = self.d_model, self.d_ff
        shapes: dict[str, tuple[int, ...]] = {"tok_emb": (self.vocab_size, d), "pos_emb": (self.seq_len, d)}
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            shapes.update(
                {
                    p + "ln1.weight": (d,),
                    p + "ln1.bias": (d,),
                    p + "attn.qkv.weight": (d, 3 * d),
                    p + "attn.qkv.bias": (3 * d,),
                    p + "attn.proj.weight": (d, d),
                    p + "attn.proj.bias": (d,),
                    p + "ln2.weight": (d,),
                    p + "ln2.bias": (d,),
                    p + "mlp.fc.weight": (d, f),
                    p + "mlp.fc.bias": (f,),
                    p + "mlp.proj.weight": (f, d),
                    p + "mlp.proj.bias": (d,),
                }
            )
        shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
        return shapes

    @functools.cached_property
    def n_params(self) -> int:
        """Exact parameter count (the tied LM head adds none). Cached: the prediction reads it thousands of
        times a search, and counting walks every parameter's shape."""
        return sum(int(np.prod(s)) for s in self.parameter_shapes().values())

    @property
    def n_matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all Linear weights plus the LM head (V x d).

        Position embeddings are a lookup, so they are excluded; the token embedding is a lookup too, but as
        the tied head it is a real V x d matmul, so it is counted once.
        """
        d, f = self.d_model, self.d_ff
        per_layer = d * 3 * d + d * d + d * f + f * d
        return self.n_layers * per_layer + self.vocab_size * d

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 x matmul params + 12 x layers x d_model x seq_len.

        The PaLM / torchtitan convention: forward + backward of the dense matmuls (2 + 4 FLOPs per
        parameter) plus attention scores and weighted values (12 * L * H * Q * T with H*Q = d_model), not
        halved for the causal mask. Activation recomputation is not counted (this is model FLOPs, for MFU).
        """
        return 6 * self.n_matmul_params + 12 * self.n_layers * self.d_model * self.seq_len

    def model_state_bytes(
        self, precision: str = "fp32", scheme: str | None = None, sharding: str = "none", world_size: int = 1
    ) -> dict[str, float]:
        """Analytic bytes of params + grads + AdamW state held by ONE rank.

        `scheme` is how low precision is implemented: "autocast" (fp32 params, low-precision compute) or
        "master" (low-precision params and grads plus an fp32 master copy); fp32 ignores both. A
        "fp32-master" optimizer keeps its own fp32 copy whatever the precision, so it counts in fp32 too.
        `sharding` is what is split over `world_size` ranks, cumulative as in ZeRO stages 1/2/3.
        """
        if sharding not in SHARDING_LEVELS:
            raise ValueError(f"sharding must be one of {SHARDING_LEVELS}")
        kind = "fp32" if precision == "fp32" else (scheme or "autocast")
        if scheme == "fp32-master":
            kind = scheme
        n, level = self.n_params, SHARDING_LEVELS.index(sharding)
        opt = n * OPTIMIZER_BYTES[kind] / (world_size if level >= 1 else 1)
        grads = n * GRAD_BYTES[kind] / (world_size if level >= 2 else 1)
        params = n * PARAM_BYTES[kind] / (world_size if level >= 3 else 1)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}

    def init_weights(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Deterministic float32 weights by neutral name: the same numbers for every framework and rank.

        GPT-2 initialisation: N(0, 0.02) for embeddings and Linear weights, N(0, 0.02/sqrt(2L)) for the
        two residual projections, zero biases, LayerNorm weight 1. Each tensor draws from its own stream
        seeded by (seed, crc32(name)), so one tensor never depends on the order or shape of another.
        """
        return {name: self.init_weight(name, seed) for name in self.parameter_shapes()}

    def init_weight(self, name: str, seed: int = 0) -> np.ndarray:
        """One tensor of `init_weights`; lets a large model be loaded without holding every array at once."""
        shape = self.parameter_shapes()[name]
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            return np.ones(shape, np.float32)
        if name.endswith("bias"):
            return np.zeros(shape, np.float32)
        std = (
            0.02 / np.sqrt(2 * self.n_layers)
            if name.endswith(("attn.proj.weight", "mlp.proj.weight"))
            else 0.02
        )
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW hyper-parameters every backend uses: constant learning rate, no clipping, and decoupled weight
    decay on 2-D tensors only (Linear weights and embeddings; never biases or LayerNorm), as in nanoGPT."""

    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    @staticmethod
    def decays(shape: tuple[int, ...]) -> bool:
        return len(shape) >= 2


OPTIMIZER = OptimizerSpec()


PRESETS: dict[str, ModelSpec] = {
    # Under 2M parameters: trains in seconds on a CPU, for CI and smoke runs.
    "tiny": ModelSpec(vocab_size=2048, seq_len=128, d_model=128, n_layers=4, n_heads=4, d_ff=512),
    # GPT-2 small / medium shapes (vocab padded to a multiple of 64, as nanoGPT does).
    "small": ModelSpec(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12, d_ff=3072),
    "350m": ModelSpec(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16, d_ff=4096),
    # The headline workload: ~1.3B parameters.
    "1b": ModelSpec(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=16, d_ff=8192),
}

# CLI override flag -> ModelSpec field.
OVERRIDES = {
    "vocab": "vocab_size",
    "seq_len": "seq_len",
    "d_model": "d_model",
    "layers": "n_layers",
    "heads": "n_heads",
    "ffn": "d_ff",
}


def resolve(name: str, **overrides) -> ModelSpec:
    """A preset with optional field overrides (None values are ignored); unknown names raise KeyError."""
    if name not in PRESETS:
        raise KeyError(name)
    changes = {OVERRIDES.get(k, k): v for k, v in overrides.items() if v is not None}
    if "d_model" in changes and "d_ff" not in changes:
        changes["d_ff"] = 4 * changes["d_model"]  # keep the usual 4x MLP unless told otherwise
    return dataclasses.replace(PRESETS[name], **changes)
