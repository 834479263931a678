"""What a model's attention holds where no fused kernel computes it: the (B, H, T, T) fp32 softmax outputs of
every layer, from forward to backward (a softmax's gradient reads its output). Analytic, from the spec; the
stacks that run such an attention say where in their settings(), which the predictor's memory reads, and
tests/probes/saved_activations.py measures it on a CPU where the framework can."""

from __future__ import annotations

from core.config import RunConfig


def size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def materialised_attention(cfg: RunConfig, why: str) -> dict:
    """Bytes of materialised attention one rank holds for backward (a lower bound: the logits and mask
    aside), and `why` the stack's attention materialises them."""
    b, h, t = cfg.batch.micro_batch, cfg.model.spec.n_heads, cfg.model.spec.seq_len
    per_layer = b * h * t * t * 4
    held_layers = 1 if cfg.model.activation_checkpointing else cfg.model.spec.n_layers
    held = held_layers * per_layer
    return {
        "implementation": "materialised (B,H,T,T) logits",
        "flash": False,
        "shape": [b, h, t, t],
        "dtype": "float32",
        "bytes_per_layer": per_layer,
        "layers_held_for_backward": held_layers,
        "bytes_held_for_backward": held,
        "basis": "analytic",
        "summary": (
            f"attention: materialised (B,H,T,T) fp32 logits, {b}x{h}x{t}x{t}x4 B = {size(per_layer)} per "
            f"layer; softmax outputs held for backward: {held_layers} layer(s) = {size(held)} "
            f"(analytic, a lower bound; {why})"
        ),
    }
