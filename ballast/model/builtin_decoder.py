"""The built-in engine's model: a random-weight byte-level decoder-only transformer.

Why a hand-written model: the serving stack has to be exercised end to end (GPU
memory, batching, streaming, recycling) on machines that may not download
anything at run time, so no hub checkpoint or tokenizer can be fetched. A tiny
byte-level decoder-only transformer is small enough to write here, builds
deterministically from a seed (so every replica of a deployment serves the same
weights without shipping a file), and still has the shape of the real workload:
a prefill, then one token per step against a KV cache, batched with left
padding. Its outputs are meaningless text; its cost profile is the point.

Invariants: the vocabulary is the 256 byte values (id == byte value); building
from a seed draws only from a local generator, never the global RNG; and
``forward`` stays compilable by ``torch.jit.script`` with the geometry kept as
plain int attributes, so a scripted or loaded archive runs through the same
generation loop (:mod:`ballast.model.builtin_engine`) and batch
(:mod:`ballast.model.builtin_batch`); ``hidden`` (the hidden states after the final norm,
which a pooled row's vector is made of) is exported with it, so an archive scripted from
this module carries it too. This module knows nothing of batching,
sampling or files (:mod:`ballast.model.builtin_checkpoint`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ballast.policies.validation import check_int

__all__ = ["BYTE_VOCAB_SIZE", "TinyDecoder", "TinyDecoderConfig", "build_tiny_decoder", "empty_decoder"]

# One token per byte value; id == byte value.
BYTE_VOCAB_SIZE = 256


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TinyDecoderConfig:
    """Geometry of :class:`TinyDecoder`. The default is about 3.4M parameters."""

    vocab_size: int = BYTE_VOCAB_SIZE
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    max_seq_len: int = 512

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            check_int(f"TinyDecoderConfig.{name}", getattr(self, name), minimum=1)
        if self.vocab_size != BYTE_VOCAB_SIZE:
            raise ValueError(
                f"TinyDecoderConfig.vocab_size must be {BYTE_VOCAB_SIZE} "
                f"(byte-level tokens, id == byte value), got {self.vocab_size}"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"TinyDecoderConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.max_seq_len < 2:
            raise ValueError(
                "TinyDecoderConfig.max_seq_len must be >= 2 (one prompt token plus one "
                f"generated token), got {self.max_seq_len}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# ---------------------------------------------------------------------------- model


class _Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: TinyDecoderConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn_qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_out = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.mlp_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor, attn_mask: Tensor, past_k: Tensor, past_v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b = x.size(0)
        t = x.size(1)
        qkv = self.attn_qkv(self.ln1(x))
        # [B, T, 3, H, Dh] -> three [B, H, T, Dh]
        qkv = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        # attn_mask [B, T, T_past+T] broadcasts over heads; True = may attend.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.unsqueeze(1))
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        x = x + self.attn_out(y)
        x = x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))
        return x, k, v


class TinyDecoder(nn.Module):
    """Decoder-only byte-level transformer with a KV-cache forward.

    ``forward(input_ids[B,T], position_ids[B,T], attn_mask[B,T,T_past+T] bool,
    past_k[L,B,H,T_past,Dh], past_v) -> (logits[B,T,V], new_k, new_v)`` where
    ``new_k``/``new_v`` are ``[L,B,H,T_past+T,Dh]``. The first step passes past
    tensors with ``T_past == 0``. The caller owns masking and positions, which is
    what lets one forward serve prefill, incremental decode, left-padded batches
    and the no-cache reference path alike.

    The geometry is kept as plain int attributes (not ``Final``) because
    TorchScript keeps those on the compiled module, so a loaded archive still
    tells the generation loop how to shape an empty cache.
    The LM head is a separate (untied) projection; see build_tiny_decoder for why.
    ``hidden`` is ``forward`` without the LM head: the hidden states after ``ln_f``
    [B, T, D], exported so that a scripted module keeps it.
    """

    def __init__(self, cfg: TinyDecoderConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.n_layers = cfg.n_layers
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.max_seq_len = cfg.max_seq_len
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList([_Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attn_mask: Tensor,
        past_k: Tensor,
        past_v: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        h, k, v = self.hidden(input_ids, position_ids, attn_mask, past_k, past_v)
        return self.lm_head(h), k, v

    @torch.jit.export
    def hidden(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attn_mask: Tensor,
        past_k: Tensor,
        past_v: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``forward``'s hidden states after the final norm [B, T, D] (what the LM head
        reads) instead of its logits, with the cache grown by T."""
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        new_k: list[Tensor] = []
        new_v: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, attn_mask, past_k[i], past_v[i])
            new_k.append(k)
            new_v.append(v)
        return self.ln_f(x), torch.stack(new_k), torch.stack(new_v)


def empty_decoder(cfg: TinyDecoderConfig) -> TinyDecoder:
    """A TinyDecoder with uninitialised CPU weights.

    Built on the meta device so that the nn.Linear/nn.Embedding default
    initialisers never draw from (and so never advance) the global RNG.
    """
    with torch.device("meta"):
        model = TinyDecoder(cfg)
    return model.to_empty(device="cpu")


def build_tiny_decoder(cfg: TinyDecoderConfig, seed: int) -> TinyDecoder:
    """Deterministic weights from ``seed``, on CPU, in eval mode.

    Draws only from a local ``torch.Generator``: the global RNG is untouched, so
    building a model never perturbs anything else seeded in the process.

    The scale is deliberately *not* GPT-2's training init (std 0.02): with that,
    an untrained model's residual stream is dominated by the current token's
    embedding and it just repeats its last input byte, so the output would not
    depend on attention at all — and tests that batching or the KV cache are
    right would pass vacuously. Embeddings are N(0, 1) and weight matrices
    N(0, 1/fan_in) (PyTorch's default scale), so attention matters, logits have
    unit spread, and greedy output is varied, context-dependent text.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    model = empty_decoder(cfg)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Residual-branch output projections are scaled down with depth so the
    # residual stream's variance does not grow with n_layers.
    residual_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        # named_parameters() order is registration order: stable across runs.
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif name.startswith("ln") or ".ln" in name:
                param.fill_(1.0)  # LayerNorm weight
            elif name.endswith("_emb.weight"):
                nn.init.normal_(param, 0.0, 1.0, generator=gen)
            else:  # Linear weight [out, in]
                std = 1.0 / math.sqrt(param.shape[1])
                if name.endswith(("attn_out.weight", "mlp_out.weight")):
                    std *= residual_scale
                nn.init.normal_(param, 0.0, std, generator=gen)
    return model.eval()
