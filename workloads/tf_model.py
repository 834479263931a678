"""The spec's GPT in Keras 3 on TensorFlow. Read side by side with torch_model.py and paddle_model.py.

Every layer builds its variables in __init__, so a model created inside a tf.distribute strategy scope is
mirrored at once and can be counted and loaded before its first call.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # tf.recompute_grad and tf.distribute need it

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402

from workloads.spec import OPTIMIZER, ModelSpec, OptimizerSpec  # noqa: E402


class CausalSelfAttention(keras.layers.Layer):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_heads = spec.n_heads
        self.qkv = layers.Dense(3 * spec.d_model)
        self.proj = layers.Dense(spec.d_model)
        self.qkv.build((None, spec.d_model))
        self.proj.build((None, spec.d_model))
        self.built = True

    def call(self, x):
        B, T, C = ops.shape(x)
        q, k, v = ops.split(self.qkv(x), 3, axis=2)
        q, k, v = (ops.reshape(t, (B, T, self.n_heads, C // self.n_heads)) for t in (q, k, v))
        y = ops.dot_product_attention(q, k, v, is_causal=True)  # Keras's layout is (B, T, heads, head_dim)
        return self.proj(ops.reshape(y, (B, T, C)))


class MLP(keras.layers.Layer):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.fc = layers.Dense(spec.d_ff)
        self.proj = layers.Dense(spec.d_model)
        self.fc.build((None, spec.d_model))
        self.proj.build((None, spec.d_ff))
        self.built = True

    def call(self, x):
        return self.proj(ops.gelu(self.fc(x), approximate=False))  # Keras defaults to the tanh approximation


class Block(keras.layers.Layer):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln1 = layers.LayerNormalization(epsilon=spec.layer_norm_eps)
        self.attn = CausalSelfAttention(spec)
        self.ln2 = layers.LayerNormalization(epsilon=spec.layer_norm_eps)
        self.mlp = MLP(spec)
        self.ln1.build((None, spec.d_model))
        self.ln2.build((None, spec.d_model))
        self.built = True

    def call(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(keras.Model):
    def __init__(self, spec: ModelSpec, activation_checkpointing: bool = False):
        super().__init__()
        self.spec = spec
        self.activation_checkpointing = activation_checkpointing
        self.tok_emb = layers.Embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = layers.Embedding(spec.seq_len, spec.d_model)
        self.blocks = [Block(spec) for _ in range(spec.n_layers)]
        self.ln_f = layers.LayerNormalization(epsilon=spec.layer_norm_eps)
        self.tok_emb.build()
        self.pos_emb.build()
        self.ln_f.build((None, spec.d_model))
        self.built = True

    def call(self, idx, targets=None):
        """Mean cross-entropy loss, or the logits when no targets are given."""
        T = ops.shape(idx)[1]
        x = self.tok_emb(idx) + self.pos_emb(ops.arange(T))
        for block in self.blocks:
            x = tf.recompute_grad(block)(x) if self.activation_checkpointing else block(x)
        logits = ops.matmul(self.ln_f(x), ops.transpose(self.tok_emb.embeddings))  # tied LM head
        if targets is None:
            return logits
        losses = ops.sparse_categorical_crossentropy(targets, ops.cast(logits, "float32"), from_logits=True)
        return ops.mean(losses)

    def spec_variables(self) -> dict[str, keras.Variable]:
        """The variables by the spec's neutral names (Keras calls them embeddings, kernel/bias,
        gamma/beta)."""
        variables = {"tok_emb": self.tok_emb.embeddings, "pos_emb": self.pos_emb.embeddings}
        for name in self.spec.parameter_shapes():
            if name in variables:
                continue
            *path, kind = name.split(".")  # e.g. blocks, 0, attn, qkv, weight
            layer = self
            for part in path:
                layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
            if isinstance(layer, layers.LayerNormalization):
                variables[name] = layer.gamma if kind == "weight" else layer.beta
            else:
                variables[name] = layer.kernel if kind == "weight" else layer.bias
        return variables

    def load_spec_weights(self, seed: int = 0):
        """Assign the spec's deterministic weights, one tensor at a time (Dense kernels are already
        (in, out))."""
        for name, variable in self.spec_variables().items():
            variable.assign(self.spec.init_weight(name, seed))
        return self


def make_optimizer(model: GPT, opt: OptimizerSpec = OPTIMIZER) -> keras.optimizers.AdamW:
    """AdamW with weight decay on 2-D variables only.

    Excluded by variable identity, not `var_names`: that regex matches short names like "bias", so a rename
    would silently decay the wrong tensors. Keras adds epsilon to sqrt(v) before bias correction, PyTorch and
    Paddle to the bias-corrected sqrt(v): Keras's acts 1/sqrt(1 - beta2^t) times larger (4.5x at step 1),
    which matters only where sqrt(v) is as small as eps.
    """
    optimizer = keras.optimizers.AdamW(
        learning_rate=opt.lr,
        weight_decay=opt.weight_decay,
        beta_1=opt.beta1,
        beta_2=opt.beta2,
        epsilon=opt.eps,
    )
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if not opt.decays(tuple(v.shape))]
    )
    optimizer.build(
        model.trainable_variables
    )  # moments now, in the caller's strategy scope, not in a tf.function
    return optimizer


def n_parameters(model: GPT) -> int:
    return sum(
        math.prod(v.shape) for v in model.trainable_variables
    )  # shapes only: works in a StatelessScope
