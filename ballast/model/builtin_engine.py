"""The built-in engine: a random-weight byte-level decoder, batched by Ballast's own loop.

Why a hand-written model: the serving stack has to be exercised end to end (GPU
memory, batching, streaming, recycling) on machines that may not download
anything at run time, so no hub checkpoint or tokenizer can be fetched. A tiny
byte-level decoder-only transformer is small enough to write here, builds
deterministically from a seed (so every replica of a deployment serves the same
weights without shipping a file), and still has the shape of the real workload:
a prefill, then one token per step against a KV cache, batched with left
padding. Its outputs are meaningless text; its cost profile is the point.

Tokens are raw UTF-8 bytes (vocabulary 256, id == byte value), so there is no
tokenizer to ship either; byte-level has no EOS, so every sequence produces
exactly the number of tokens it asked for.

The model's ``forward`` is written so that ``torch.jit.script`` can compile it
and the compiled module runs through the very same generation loop; an operator
can therefore ship either a ``state_dict`` (needs this code to rebuild the
module) or a self-contained TorchScript archive. ``torch.jit`` is deprecated in
torch 2.x (it warns with ``DeprecationWarning``) but still works in 2.13; it is
the only format that carries code and weights in one file and reloads without
this module's class definitions.
"""

from __future__ import annotations

import codecs
import math
import os
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ballast.model.batching import describe_engine, ids_by_row, left_pad, refuse_bad_ids, rows_to_keep
from ballast.errors import ModelLoadError
from ballast.policies.validation import check_int, check_name

__all__ = [
    "BYTE_VOCAB_SIZE",
    "BackendSpec",
    "ByteStreamDecoder",
    "LiveBatch",
    "SamplingConfig",
    "TinyDecoder",
    "TinyDecoderConfig",
    "TorchDecoderBackend",
    "build_tiny_decoder",
    "detect_checkpoint_format",
    "encode_prompt",
    "load_backend",
    "save_state_dict",
    "save_torchscript",
]

# One token per byte value; id == byte value.
BYTE_VOCAB_SIZE = 256
# An empty prompt still needs one token to condition on.
_EMPTY_PROMPT_BYTES = b"\n"
_PRINTABLE_IDS = (10, *range(32, 127))  # "\n" and printable ASCII


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


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked from the logits.

    temperature 0 means greedy (argmax). With temperature > 0 tokens are drawn
    from a ``torch.Generator`` seeded with ``seed`` at the start of every
    ``generate_chunks`` call, so a call is reproducible on its own — but the
    draws are shared across the batch, so batch composition changes samples.
    ``printable_only`` masks the logits to printable ASCII plus newline so the
    demo output is readable; turn it off to sample all 256 byte values.
    """

    temperature: float = 0.0
    seed: int = 0
    printable_only: bool = True

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingConfig.temperature must be a finite float >= 0, got {t!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"SamplingConfig.seed must be an int >= 0, got {self.seed!r}")
        if not isinstance(self.printable_only, bool):
            raise ValueError(f"SamplingConfig.printable_only must be a bool, got {self.printable_only!r}")


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
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        new_k: list[Tensor] = []
        new_v: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, attn_mask, past_k[i], past_v[i])
            new_k.append(k)
            new_v.append(v)
        logits = self.lm_head(self.ln_f(x))
        return logits, torch.stack(new_k), torch.stack(new_v)


def _empty_decoder(cfg: TinyDecoderConfig) -> TinyDecoder:
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
    model = _empty_decoder(cfg)
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


# ------------------------------------------------------------------------ tokenizing


def encode_prompt(prompt: str, max_new_tokens: int, max_seq_len: int) -> list[int]:
    """UTF-8 bytes of ``prompt``, truncated from the left to fit the context.

    Keeps the most recent ``max_seq_len - max_new_tokens`` bytes, so that the
    prompt plus everything generated fits the position table. An empty prompt
    becomes a single newline so there is something to condition on. Truncation
    may cut a multi-byte character; the model only sees bytes, so that is fine.
    """
    if not 0 <= max_new_tokens <= max_seq_len - 1:
        raise ValueError(
            f"max_new_tokens must be in [0, {max_seq_len - 1}] for max_seq_len {max_seq_len}, got {max_new_tokens}"
        )
    data = prompt.encode("utf-8") or _EMPTY_PROMPT_BYTES
    keep = max_seq_len - max_new_tokens
    return list(data[-keep:])


class ByteStreamDecoder:
    """Incremental UTF-8 decoding of one sequence's generated bytes.

    A multi-byte character split across two chunks is held back until its last
    byte arrives; invalid bytes become U+FFFD instead of raising, because a
    random model emits arbitrary bytes when not restricted to ASCII.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Decode more bytes; ``final=True`` flushes a dangling partial char as U+FFFD."""
        return self._decoder.decode(bytes(token_ids), final=final)


_REQUIRED_MODEL_ATTRS = ("vocab_size", "n_layers", "n_heads", "head_dim", "max_seq_len")


class TorchDecoderBackend:
    """:class:`ModelBackend` around a module with :class:`TinyDecoder`'s forward contract.

    ``model`` may be an eager TinyDecoder or a ``torch.jit.ScriptModule`` loaded
    from an archive; the generation loop reads the cache geometry from the
    module's int attributes, so both run the same code.

    Concurrency: a ``generate_chunks`` call keeps all its state (cache, sampler
    generator, decoders) local, and the module is only read, so concurrent calls
    from several threads are safe; they simply share the device.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        name: str,
        device: str,
        source: str,
        sampling: SamplingConfig = SamplingConfig(),
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if device != "cpu" and not (isinstance(device, str) and device.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
        missing = [a for a in _REQUIRED_MODEL_ATTRS if not isinstance(getattr(model, a, None), int)]
        if missing:
            raise ValueError(f"model lacks int attributes {missing} needed to shape the KV cache")
        if int(model.vocab_size) != BYTE_VOCAB_SIZE:
            raise ValueError(f"model vocab_size must be {BYTE_VOCAB_SIZE}, got {model.vocab_size}")
        params = list(model.parameters())
        if not params:
            raise ValueError("model has no parameters; cannot infer its dtype")
        self.name = name
        self.device = device
        self.source = source
        self.sampling = sampling
        self.max_seq_len = int(model.max_seq_len)
        self.parameter_count = sum(p.numel() for p in params)
        self._model = model.to(device).eval()
        self._n_layers = int(model.n_layers)
        self._n_heads = int(model.n_heads)
        self._head_dim = int(model.head_dim)
        self._dtype = params[0].dtype
        allowed = torch.zeros(BYTE_VOCAB_SIZE, dtype=torch.bool, device=device)
        allowed[list(_PRINTABLE_IDS)] = True
        self._printable = allowed

    # ---------------------------------------------------------------- public API

    def generate_chunks(
        self, prompts: list[str], max_new_tokens: list[int], chunk_tokens: int = 4
    ) -> Iterator[list[str]]:
        """Batched generation, decoded to text chunk by chunk.

        Each yielded list has one piece per prompt covering ``chunk_tokens``
        decode steps ("" once that sequence has produced its own
        ``max_new_tokens``). The batch runs until the longest request is done,
        so ``ceil(max(max_new_tokens) / chunk_tokens)`` lists are yielded.
        Arguments are validated here, before the first ``next()``.
        """
        token_chunks = self.generate_token_chunks(prompts, max_new_tokens, chunk_tokens)
        return self._decode_chunks(token_chunks, max_new_tokens)

    def generate_token_chunks(
        self,
        prompts: list[str],
        max_new_tokens: list[int],
        chunk_tokens: int = 4,
        *,
        use_cache: bool = True,
    ) -> Iterator[list[list[int]]]:
        """Like :meth:`generate_chunks` but yields raw byte ids per prompt.

        ``use_cache=False`` recomputes the whole sequence every step: quadratic,
        for tests and debugging only — it is the reference the cache must match.
        """
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"got {len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        for n in max_new_tokens:
            if isinstance(n, bool) or not isinstance(n, int):
                raise ValueError(f"max_new_tokens entries must be ints, got {n!r}")
        encoded = [encode_prompt(p, n, self.max_seq_len) for p, n in zip(prompts, max_new_tokens)]
        return self._token_chunks(encoded, list(max_new_tokens), chunk_tokens, use_cache)

    def warmup(self, batch_sizes: Sequence[int] = (1,)) -> None:
        """Two short generations per batch size, through the live batch the replica runs:
        allocator, kernels, (on CUDA) context, and TorchScript's profiling runs, which
        specialise the graph per input shape on its first calls, all done before traffic."""
        steps = max(1, min(8, self.max_seq_len - 2))
        for n in batch_sizes:
            for _ in range(2):
                for _ in self.generate_chunks(["Hello"] * n, [steps] * n, chunk_tokens=4):
                    pass

    def describe(self) -> dict[str, Any]:
        return describe_engine(self)

    # ------------------------------------------------------------------ internals

    def _decode_chunks(self, token_chunks: Iterator[list[list[int]]], max_new_tokens: list[int]) -> Iterator[list[str]]:
        decoders = [ByteStreamDecoder() for _ in max_new_tokens]
        produced = [0] * len(max_new_tokens)
        for chunk in token_chunks:
            pieces = []
            for i, ids in enumerate(chunk):
                produced[i] += len(ids)
                # Flush on the sequence's last byte so a dangling partial
                # character shows as U+FFFD instead of vanishing.
                final = bool(ids) and produced[i] == max_new_tokens[i]
                pieces.append(decoders[i].feed(ids, final=final) if ids else "")
            yield pieces

    def _token_chunks(
        self,
        encoded: list[list[int]],
        max_new_tokens: list[int],
        chunk_tokens: int,
        use_cache: bool,
    ) -> Iterator[list[list[int]]]:
        if not encoded or max(max_new_tokens) == 0:
            return
        if use_cache:
            # The cached path is the live batch the replica runs, with every
            # sequence joining at once.
            batch = LiveBatch(self)
            pending = list(enumerate(zip(encoded, max_new_tokens)))
            while pending or batch.size:
                with torch.inference_mode():  # per chunk, never across a yield
                    out = batch.run_chunk([(i, e, n) for i, (e, n) in pending], chunk_tokens)
                pending = []
                yield [out.get(b, []) for b in range(len(encoded))]
            return
        total_steps = max(max_new_tokens)
        state = _DecodeState(self, encoded, total_steps)
        for first in range(0, total_steps, chunk_tokens):
            last = min(first + chunk_tokens, total_steps)
            # inference_mode is entered per chunk, never held across a yield: a
            # generator suspended inside the context would leak the (thread-local)
            # mode into whatever the caller runs between next() calls.
            with torch.inference_mode():
                # One device->host copy per chunk rather than per token.
                steps = [state.step(s) for s in range(first, last)]
                step_tokens = torch.stack(steps).tolist()
            yield [
                [tokens[b] for s, tokens in zip(range(first, last), step_tokens) if s < max_new_tokens[b]]
                for b in range(len(encoded))
            ]

    def open_batch(self) -> "LiveBatch":
        """An empty :class:`LiveBatch` (iteration-level batching) on this backend."""
        return LiveBatch(self)

    # Byte-level tokens have no end-of-sequence: every row runs to its max_new_tokens.
    eos_ids: frozenset[int] = frozenset()
    vocab_size: int = BYTE_VOCAB_SIZE

    @property
    def tokenizer_id(self) -> str:
        """Bytes: ``special_tokens.BYTES_TOKENIZER``, whatever the weights."""
        from ballast.model.special_tokens import BYTES_TOKENIZER

        return BYTES_TOKENIZER

    async def check(self, sampling: Any) -> Any:
        """``sampling`` as sent: this engine samples as its config says, and the router
        refuses what it cannot honour."""
        return sampling

    def stream_decoder(self, keep_special_tokens: bool = False) -> ByteStreamDecoder:
        """Text for a row's ids, piece by piece (the replica holds one per request); bytes
        have no special tokens to keep."""
        return ByteStreamDecoder()

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's bytes (``special_tokens.encode_bytes``, as the router makes them: no
        :data:`~ballast.model.special_tokens.MARK`, an empty prompt one newline); bytes have
        no special tokens, so ``add_special_tokens`` changes nothing."""
        from ballast.model.special_tokens import encode_bytes

        return encode_bytes(prompt)

    def fit(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], int]:
        """(prompt ids, max new tokens) for a row: max_new_tokens at most ``max_seq_len - 1``
        (shortened, never lengthened), and the prompt's last ``max_seq_len - max_new_tokens``
        ids, as ``encode_prompt`` keeps a prompt's last bytes. No ids: one newline."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        n = min(max_new_tokens, self.max_seq_len - 1)
        kept = [int(i) for i in ids] or list(_EMPTY_PROMPT_BYTES)
        return kept[-(self.max_seq_len - n) :], n

    def encode(self, prompt: str, max_new_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids as a live batch takes them (validated like generate).

        Bytes have no special tokens, so ``add_special_tokens`` changes nothing; a
        prompt longer than the context keeps its end (``encode_prompt``)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        from ballast.model.special_tokens import strip_marks  # a prompt another model's template rendered

        return encode_prompt(strip_marks(prompt), max_new_tokens, self.max_seq_len)

    def _empty_cache(self, batch: int) -> Tensor:
        """A KV cache with no positions yet: [L, batch, H, 0, Dh]."""
        return torch.zeros(
            self._n_layers, batch, self._n_heads, 0, self._head_dim, dtype=self._dtype, device=self.device
        )

    def _left_padded(self, encoded: list[list[int]], extra: int = 0) -> tuple[Tensor, Tensor]:
        """(ids, valid) [B, P + extra]: prompts right-aligned in P columns, ``valid`` False on padding."""
        width = max(len(e) for e in encoded)
        ids = torch.zeros(len(encoded), width + extra, dtype=torch.long, device=self.device)
        valid = torch.ones(len(encoded), width + extra, dtype=torch.bool, device=self.device)
        for b, e in enumerate(encoded):
            pad = width - len(e)
            ids[b, pad:width] = torch.tensor(e, dtype=torch.long, device=self.device)
            valid[b, :pad] = False
        return ids, valid

    def _generator(self) -> torch.Generator | None:
        """A sampler seeded from the config; None when greedy."""
        if self.sampling.temperature == 0:
            return None
        return torch.Generator(device=self.device).manual_seed(self.sampling.seed)

    def _sample(self, logits: Tensor, gen: torch.Generator | None) -> Tensor:
        """Pick one id per row from last-position logits [B, V] -> [B]."""
        logits = logits.float()
        if self.sampling.printable_only:
            logits = logits.masked_fill(~self._printable, float("-inf"))
        if self.sampling.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / self.sampling.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def _split_refused(joins: Sequence[tuple], vocab_size: int) -> tuple[list[tuple], dict[Any, BaseException]]:
    """The joins whose ids are all in the vocabulary, and the others' refusals by key."""
    ok, refused = [], {}
    for join in joins:
        why = refuse_bad_ids(join[0], join[1], vocab_size)
        if why is None:
            ok.append(join)
        else:
            refused[join[0]] = why
    return ok, refused


class LiveBatch:
    """Iteration-level ("continuous") batching: sequences join and leave between chunks.

    A request that arrives while others are generating joins at the next chunk
    instead of waiting for the whole batch to finish, and a finished sequence
    leaves at once instead of idling to the batch's longest member. That is what
    keeps a short request's latency independent of the long ones beside it.

    Layout: one KV cache ``[L, B, H, T, Dh]`` for the rows in the batch. Every row's
    real tokens are a *suffix* of the T columns (left padding, ``valid[b, j]``
    False on padding), and ``lengths[b]`` counts them, so a row's positions are
    the same alone or batched. Joining rows are prefilled on their own, then both
    caches are left-padded to a common width and stacked; leaving rows are
    dropped and columns no row uses are trimmed, so T never exceeds the longest
    row (≤ ``max_seq_len``). Each row also holds its last sampled token, not yet
    fed to the model; a decode step feeds it at position ``lengths[b]``.

    Greedy output of a row equals generating it alone. With temperature > 0 the
    draws come from one generator per batch, seeded once, so samples depend on
    what else is in the batch. A join whose ids are not bytes (0-255) is refused
    alone before its prefill and handed back by ``take_failed``; the other rows go
    on. Not thread-safe: one caller at a time (the replica's engine loop runs one
    chunk at a time in a worker thread).
    """

    def __init__(self, backend: TorchDecoderBackend) -> None:
        self._backend = backend
        self._keys: list[Any] = []
        self._remaining: list[int] = []  # tokens each row still has to emit
        dev = backend.device
        self._k = backend._empty_cache(0)
        self._v = self._k
        self._valid = torch.zeros(0, 0, dtype=torch.bool, device=dev)
        self._lengths = torch.zeros(0, dtype=torch.long, device=dev)
        self._last = torch.zeros(0, dtype=torch.long, device=dev)
        self._gen = backend._generator()
        self._failed: dict[Any, BaseException] = {}  # rows refused alone, until take_failed

    @property
    def size(self) -> int:
        """Rows generating now."""
        return len(self._keys)

    @property
    def width(self) -> int:
        """Columns in the KV cache (the longest row)."""
        return int(self._valid.shape[1])

    def keys(self) -> list[Any]:
        return list(self._keys)

    def remove(self, keys: "Sequence[Any] | set[Any]") -> None:
        """Drop these rows (cancelled, past their deadline); unknown keys are ignored."""
        keep = rows_to_keep(self._keys, keys)
        if keep is not None:
            self._select(keep)

    def run_chunk(self, joins: "Sequence[tuple]", steps: int) -> dict[Any, list[int]]:
        """Admit ``joins`` (key, prompt ids, max new tokens), then up to ``steps`` tokens per row.

        Returns the ids each row emitted in this chunk, for every row that was in
        the batch or joined (a joiner's first token comes from its prefill). Rows
        that emitted their last token have left the batch when this returns. Call
        under ``torch.inference_mode()``.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        seen = set(self._keys)
        for key, ids, n, *_ in joins:  # a 4th item (per-row sampling) is the HF engine's
            if key in seen:
                raise ValueError(f"key {key!r} is already in the batch")
            seen.add(key)
            if not ids or len(ids) + n > self._backend.max_seq_len or n < 0:
                raise ValueError(
                    f"row {key!r}: {len(ids)} prompt ids + {n} new tokens must fit "
                    f"max_seq_len {self._backend.max_seq_len} (use encode())"
                )
        joins, refused = _split_refused(joins, BYTE_VOCAB_SIZE)
        self._failed.update(refused)
        emitted: list[tuple[list[Any], Tensor]] = []  # (rows, [B] ids) per forward
        if self._keys:
            emitted.append((list(self._keys), self._decode()))
        live = [(key, ids, n) for key, ids, n, *_ in joins if n > 0]
        if live:
            part = self._prefill([ids for _, ids, _ in live])
            emitted.append(([key for key, _, _ in live], part[-1]))
            self._drop_finished()
            self._append([key for key, _, _ in live], [n - 1 for _, _, n in live], part)
        self._drop_finished()
        for _ in range(steps - 1):
            if not self._keys:
                break
            emitted.append((list(self._keys), self._decode()))
            self._drop_finished()
        return ids_by_row(emitted, {key: [] for key, *_ in joins})

    def take_failed(self) -> dict[Any, BaseException]:
        """Rows refused alone since the last call (a prompt id outside the vocabulary),
        with their errors; they never shared a step with the other rows."""
        out, self._failed = self._failed, {}
        return out

    # ------------------------------------------------------------------ internals

    def _decode(self) -> Tensor:
        """One decode step for every row: feed each row's last token; returns the new ones [B]."""
        dev = self._backend.device
        batch = len(self._keys)
        valid = torch.cat([self._valid, torch.ones(batch, 1, dtype=torch.bool, device=dev)], dim=1)
        logits, self._k, self._v = self._backend._model(
            self._last[:, None], self._lengths[:, None], valid[:, None, :], self._k, self._v
        )
        self._valid = valid
        self._lengths = self._lengths + 1
        self._last = self._backend._sample(logits[:, -1, :], self._gen)
        for i in range(batch):
            self._remaining[i] -= 1
        return self._last

    def _prefill(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Prefill new rows as their own left-padded batch: (k, v, valid, lengths, first ids)."""
        backend = self._backend
        ids, valid = backend._left_padded(prompts)
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        empty = backend._empty_cache(len(prompts))
        logits, k, v = backend._model(ids, positions, _prefill_mask(valid), empty, empty)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=backend.device)
        return k, v, valid, lengths, self._backend._sample(logits[:, -1, :], self._gen)

    def _append(
        self, keys: list[Any], remaining: list[int], part: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
    ) -> None:
        k, v, valid, lengths, last = part
        width = max(self.width, int(valid.shape[1]))
        self._k = torch.cat([left_pad(self._k, width, 3), left_pad(k, width, 3)], dim=1)
        self._v = torch.cat([left_pad(self._v, width, 3), left_pad(v, width, 3)], dim=1)
        self._valid = torch.cat([left_pad(self._valid, width, 1), left_pad(valid, width, 1)], dim=0)
        self._lengths = torch.cat([self._lengths, lengths])
        self._last = torch.cat([self._last, last])
        self._keys += keys
        self._remaining += remaining

    def _drop_finished(self) -> None:
        if any(r <= 0 for r in self._remaining):
            self._select([i for i, r in enumerate(self._remaining) if r > 0])

    def _select(self, keep: list[int]) -> None:
        """Keep these rows, then trim leading columns that no remaining row uses."""
        index = torch.tensor(keep, dtype=torch.long, device=self._backend.device)
        self._k = self._k.index_select(1, index)
        self._v = self._v.index_select(1, index)
        self._valid = self._valid.index_select(0, index)
        self._lengths = self._lengths.index_select(0, index)
        self._last = self._last.index_select(0, index)
        self._keys = [self._keys[i] for i in keep]
        self._remaining = [self._remaining[i] for i in keep]
        used = self._valid.any(dim=0)
        start = int(used.long().argmax()) if bool(used.any()) else self.width
        if start:
            self._k = self._k[:, :, :, start:]
            self._v = self._v[:, :, :, start:]
            self._valid = self._valid[:, start:]


def _prefill_mask(valid: Tensor) -> Tensor:
    """[B, T, T]: causal, no padding keys, and the diagonal always open.

    The diagonal keeps padding queries from having an all-False row. torch
    2.13's CPU kernel returns zeros for such a row, but other SDPA kernels
    and versions return NaN, and a NaN in a padded row's K/V would poison
    real rows through 0 * NaN in the attention matmul. The padded rows'
    outputs are never used, so letting them see themselves costs nothing.
    """
    upto = valid.shape[1]
    dev = valid.device
    causal = torch.ones(upto, upto, dtype=torch.bool, device=dev).tril()
    mask = causal.unsqueeze(0) & valid[:, None, :]
    return mask | torch.eye(upto, dtype=torch.bool, device=dev).unsqueeze(0)


class _DecodeState:
    """The no-cache reference: every step recomputes the whole left-padded batch.

    Quadratic, for tests and debugging only (``use_cache=False``): it is what the
    live batch's KV cache must reproduce. Prompts are left-padded to a common
    width P; generated tokens fill columns P, P+1, ... for every row.
    """

    def __init__(self, backend: TorchDecoderBackend, encoded: list[list[int]], total_steps: int) -> None:
        ids, valid = backend._left_padded(encoded, extra=total_steps)
        self.backend = backend
        self.width = max(len(e) for e in encoded)
        self.ids = ids
        self.key_valid = valid
        # Rows that already finished keep decoding (the batch runs to the longest
        # request) and could run past the position table; their output is
        # discarded, so clamping them is harmless.
        self.positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0, max=backend.max_seq_len - 1)
        self.gen = backend._generator()

    def step(self, s: int) -> Tensor:
        """Recompute through decode step ``s`` (0 = prefill); the new token per row [B]."""
        upto = self.width + s
        b = self.backend
        empty = b._empty_cache(self.ids.shape[0])
        logits, _, _ = b._model(
            self.ids[:, :upto], self.positions[:, :upto], _prefill_mask(self.key_valid[:, :upto]), empty, empty
        )
        token = b._sample(logits[:, -1, :], self.gen)
        self.ids[:, upto] = token
        return token


# ---------------------------------------------------------------------- loading


_CHECKPOINT_FORMATS = ("auto", "state_dict", "torchscript")
_DEVICES = ("auto", "cpu", "cuda")
_COMPILE_MODES = ("torchscript", "eager")


@dataclass(frozen=True)
class BackendSpec:
    """Which model a replica serves and where; validated where it is built.

    ``config`` describes the model for the seed and ``state_dict`` paths; a
    TorchScript archive carries its own geometry and ``config`` is ignored.
    """

    name: str = "tiny-decoder"
    seed: int = 0
    checkpoint_path: str | None = None
    checkpoint_format: str = "auto"
    device: str = "auto"
    config: TinyDecoderConfig = field(default_factory=TinyDecoderConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # "torchscript" compiles an eager module for serving (see load_backend); "eager" runs it as is.
    compile: str = "torchscript"

    def __post_init__(self) -> None:
        check_name("BackendSpec.name", self.name)
        check_int("BackendSpec.seed", self.seed, minimum=0)
        if self.checkpoint_path is not None and (not isinstance(self.checkpoint_path, str) or not self.checkpoint_path):
            raise ValueError(
                f"BackendSpec.checkpoint_path must be None or a non-empty str, got {self.checkpoint_path!r}"
            )
        if self.checkpoint_format not in _CHECKPOINT_FORMATS:
            raise ValueError(
                f"BackendSpec.checkpoint_format must be one of {_CHECKPOINT_FORMATS}, got {self.checkpoint_format!r}"
            )
        if self.checkpoint_format != "auto" and self.checkpoint_path is None:
            raise ValueError(f"BackendSpec.checkpoint_format={self.checkpoint_format!r} needs a checkpoint_path")
        if self.device not in _DEVICES:
            raise ValueError(f"BackendSpec.device must be one of {_DEVICES}, got {self.device!r}")
        if self.compile not in _COMPILE_MODES:
            raise ValueError(f"BackendSpec.compile must be one of {_COMPILE_MODES}, got {self.compile!r}")
        if not isinstance(self.config, TinyDecoderConfig):
            raise ValueError(f"BackendSpec.config must be a TinyDecoderConfig, got {self.config!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"BackendSpec.sampling must be a SamplingConfig, got {self.sampling!r}")


def _resolve_device(requested: str, path: str) -> str:
    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda:0"
    if requested == "cuda":
        raise ModelLoadError(path, "device 'cuda' requested but torch.cuda.is_available() is False")
    return "cpu"


def detect_checkpoint_format(path: str) -> str:
    """ "torchscript" or "state_dict", from the file's contents (not its name).

    Both formats are zip archives; only a TorchScript archive holds the
    serialized code (``<root>/code/...``) and ``<root>/constants.pkl``. Anything
    else — including a legacy non-zip pickle — is treated as a state_dict and
    left to ``torch.load`` to accept or reject.
    """
    if not zipfile.is_zipfile(path):
        return "state_dict"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return "state_dict"
    for name in names:
        parts = name.split("/")
        if parts[-1] == "constants.pkl" or (len(parts) > 2 and parts[1] == "code"):
            return "torchscript"
    return "state_dict"


def _load_state_dict_model(path: str, cfg: TinyDecoderConfig, device: str) -> TinyDecoder:
    try:
        # weights_only: a checkpoint must not be able to run code on load.
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # corrupt zip, pickle error, wrong format...
        raise ModelLoadError(path, f"cannot read state_dict: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, Mapping):
        raise ModelLoadError(path, f"expected a state_dict mapping, got {type(state).__name__}")
    model = _empty_decoder(cfg)
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as exc:  # missing/unexpected keys, shape mismatch
        raise ModelLoadError(path, f"state_dict does not match {cfg}: {exc}") from exc
    return model.eval()


def _load_torchscript_model(path: str, device: str) -> nn.Module:
    try:
        model = torch.jit.load(path, map_location=device)
    except Exception as exc:
        raise ModelLoadError(path, f"cannot read TorchScript archive: {type(exc).__name__}: {exc}") from exc
    return model


def load_backend(spec: BackendSpec) -> TorchDecoderBackend:
    """Build the backend a spec describes; every failure is a :class:`ModelLoadError`.

    No checkpoint: weights from ``spec.seed``. ``checkpoint_format="auto"``
    sniffs the file (see :func:`detect_checkpoint_format`).
    """
    path = spec.checkpoint_path
    device = _resolve_device(spec.device, path or f"seed:{spec.seed}")
    if path is None:
        model: nn.Module = build_tiny_decoder(spec.config, spec.seed)
        source = f"seed:{spec.seed}"
    else:
        if not os.path.isfile(path):
            raise ModelLoadError(path, "file not found")
        fmt = spec.checkpoint_format
        if fmt == "auto":
            fmt = detect_checkpoint_format(path)
        if fmt == "torchscript":
            model = _load_torchscript_model(path, device)
        else:
            model = _load_state_dict_model(path, spec.config, device)
        source = path
    if spec.compile == "torchscript" and not isinstance(model, torch.jit.ScriptModule):
        model = _script(model, source)
    try:
        return TorchDecoderBackend(model, name=spec.name, device=device, source=source, sampling=spec.sampling)
    except ValueError as exc:  # e.g. a TorchScript module without the geometry attrs
        raise ModelLoadError(source, str(exc)) from exc


def _script(model: nn.Module, source: str) -> nn.Module:
    """``torch.jit.script(model)`` for serving, or a :class:`ModelLoadError` saying why not.

    Why: the decoder is small, so an eager decode step is mostly Python dispatch
    (docs/benchmarks.md, TorchScript), and that Python holds the GIL the replica's event
    loop needs to take requests and hand out chunks. Outputs are the same tokens.
    torch.jit warns that it is deprecated; the warning is silenced here only.
    """
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(model)
    except Exception as exc:
        raise ModelLoadError(
            source, f"cannot compile with TorchScript ({type(exc).__name__}: {exc}); set model.compile: eager"
        ) from exc


def _atomic_write(path: str, write: Any) -> None:
    # Write next to the target and rename, so a replica starting concurrently
    # never reads a half-written checkpoint.
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_state_dict(model: TinyDecoder, path: str | os.PathLike[str]) -> None:
    """``torch.save(model.state_dict())``; reload with ``BackendSpec(checkpoint_path=...)``."""
    _atomic_write(os.fspath(path), lambda p: torch.save(model.state_dict(), p))


def save_torchscript(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Script ``model`` (unless it already is) and save a self-contained archive."""
    scripted = model if isinstance(model, torch.jit.ScriptModule) else torch.jit.script(model)
    _atomic_write(os.fspath(path), lambda p: torch.jit.save(scripted, p))
