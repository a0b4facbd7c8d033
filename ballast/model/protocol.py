"""What crosses the Serve boundary between a router and a model replica: typed messages.

A front (``router/generate.py``, ``router/openai.py``) builds one ``ModelCall`` per
request (``to_call``); the pipeline sets the admitted ``max_tokens`` and the caller's
tenant once (``admitted``); the resilient caller stamps each attempt's deadline (``for_attempt``)
and, when a replica is lost mid-stream, the ids already delivered (``resumed``). The
replica answers a stream with ``ModelChunk``s and a unary call with one
``ModelResult``. Inside the replica, each row it admits joins its engine's batch as one
``Join``. Nothing on the way re-reads a dict: a field a layer needs is a field
here, defined once.

Invariants (the replica checks them; the router builds them so):

* ``prompt_ids`` are the prompt tokenized once, at the front, by the primary model's
  tokenizer, whose identity is ``tokenizer``; a replica whose engine has another
  tokenizer (a fallback model, or a caller that sent no ids) encodes ``prompt`` itself.
  Both say the same prompt.
* ``max_tokens`` is the admitted length (level, model limit and context already
  applied by the router); 0 until the pipeline admits the call. A replica whose
  context is shorter (a fallback model) shortens it to fit; it never lengthens it.
* ``deadline`` is the attempt's: the time it has left when sent and the same instant
  on the wall clock; the replica takes the stricter of the two (see
  ``AttemptDeadline.left_s``).
* ``resume`` carries the ids (and characters) a stream already delivered: the replica
  prefills them after the prompt and sends only what follows.
* ``priority`` is the engine's order among rows waiting in it (vLLM's ``priority``: a lower
  value goes first, arrival order among equals): 0 for every interactive call,
  ``BATCH_PRIORITY`` for a batch line's, so an interactive row waiting in an engine that
  schedules itself starts before every batch row waiting there (rows already running go
  on). The engines Ballast batches take rows in the order the replica admits them and
  ignore it.

All messages are frozen and hashable (the answer cache keys on a call), and picklable
(Ray ships them between processes).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ballast.policies.sampling import GREEDY_BELOW_TEMPERATURE, MAX_SEED, MIN_SEED


@dataclass(frozen=True)
class RowSampling:
    """How one row picks its tokens. temperature 0 is greedy; seed None draws a fresh one;
    top_k None: every token; ``min_tokens``: no end of sequence before that many;
    ``ignore_eos``: an end-of-sequence token does not end the row."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # vLLM's only (the router refuses any other value for the other engines): above 1
    # penalises tokens already in the prompt or the answer.
    repetition_penalty: float = 1.0
    # vLLM's only, as repetition_penalty (OpenAI's): -2 to 2, 0 neutral; presence penalises a
    # token once it appeared, frequency by how often.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's only, as repetition_penalty: (token id, bias -100 to 100) pairs added to those
    # tokens' logits (OpenAI's logit_bias), at most MAX_LOGIT_BIAS.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's only, as repetition_penalty: the answer is JSON following this JSON Schema
    # (its text), by the engine's guided decoding.
    json_schema: str | None = None
    json_schema_of: str = "response_format"  # the request field it came from (or "tools"), for a refusal
    # vLLM's only, as json_schema (at most one of the two): xgrammar's structural tag (its
    # JSON text) that vLLM's tool parser built for a request's tools.
    structural_tag: str | None = None
    # vLLM's only, as json_schema: the answer's text keeps the special tokens (a tool
    # parser looks for its markers among them).
    keep_special_tokens: bool = False

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if t < GREEDY_BELOW_TEMPERATURE:  # logits / 1e-40 overflow: a temperature this low is greedy
            object.__setattr__(self, "temperature", 0.0)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an int in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not (0 < r <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        _check_logit_bias(self.logit_bias)
        if self.json_schema is not None and self.structural_tag is not None:
            raise ValueError("structural_tag: one grammar a row; json_schema is set too")

    def for_vocab(self, vocab_size: int) -> RowSampling:
        """This sampling for a model of ``vocab_size`` tokens: a top_k at or past it is every token."""
        if self.top_k is not None and self.top_k >= vocab_size:
            return replace(self, top_k=None)
        return self

    @property
    def asks(self) -> frozenset[str]:
        """The fields only some engines honour that this sampling asks for
        (``ballast.policies.engines.ASKED_BY``): the neutral values ask for nothing."""
        asked = set()
        if self.repetition_penalty != 1.0:
            asked.add("repetition_penalty")
        asked |= {n for n in ("presence_penalty", "frequency_penalty") if getattr(self, n) != 0}
        if self.logit_bias:
            asked.add("logit_bias")
        if self.json_schema is not None:
            asked.add("json_schema")
        if self.structural_tag is not None:
            asked.add("structural_tag")
        if self.keep_special_tokens:
            asked.add("keep_special_tokens")
        return frozenset(asked)

    @classmethod
    def of(cls, req: Mapping[str, Any]) -> RowSampling:
        """The sampling fields of a mapping (absent fields take the defaults), checked and
        normalised; a value out of range is ``EngineRefused`` naming its field."""
        from ballast.errors import EngineRefused

        def number(name: str, default: float) -> float:
            v = req.get(name)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise EngineRefused(f"{name} must be a number, got {v!r}", field=name)
            return float(v)

        try:
            return cls(
                temperature=number("temperature", 0.0),
                top_p=number("top_p", 1.0),
                seed=req.get("seed"),
                top_k=req.get("top_k"),
                min_tokens=req.get("min_tokens") or 0,
                ignore_eos=bool(req.get("ignore_eos")),
                repetition_penalty=number("repetition_penalty", 1.0) or 1.0,
                presence_penalty=number("presence_penalty", 0.0),
                frequency_penalty=number("frequency_penalty", 0.0),
                logit_bias=_logit_bias_pairs(req.get("logit_bias")),
                json_schema=req.get("json_schema"),
                json_schema_of=str(req.get("json_schema_of") or "response_format"),
                structural_tag=req.get("structural_tag"),
                keep_special_tokens=bool(req.get("keep_special_tokens")),
            )
        except ValueError as e:  # every message starts with the field's name
            raise EngineRefused(str(e), field=str(e).split(" ", 1)[0]) from None


MAX_LOGIT_BIAS = 300  # tokens one request may bias


def _check_logit_bias(pairs: Any) -> None:
    if not isinstance(pairs, tuple) or len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} tokens")
    for pair in pairs:
        ok = isinstance(pair, tuple) and len(pair) == 2
        tid, bias = pair if ok else (None, None)
        if not ok or isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {pair!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) or abs(bias) > 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")


def _logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """A mapping of token ids (ints, or their decimal text as JSON keys are) to biases, as
    sorted pairs; ValueError naming logit_bias for anything else."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {type(value).__name__}")
    pairs = []
    for k, v in value.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        pairs.append((tid, v))
    return tuple(sorted(pairs))


GREEDY = RowSampling()

#: A batch line's engine priority (``ModelCall.priority``): after every interactive call's 0.
BATCH_PRIORITY = 1


#: The most likeliest tokens a position's log-probabilities may list (vLLM's own default
#: ``max_logprobs``, and OpenAI's top_logprobs bound).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class IdLogprobs:
    """One position's log-probabilities as an engine computes them: the token's ``id`` and
    its ``logprob``, and the ``top`` likeliest (id, logprob) pairs, likeliest first (as many as
    the row asked). Raw: the log-softmax of the model's logits before any sampling rule
    (temperature, penalties, grammar), as vLLM's default ``logprobs_mode``."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """What one chunk computed for a row that asked (``Batch.take_logprobs``): ``tokens``,
    one per id the chunk emitted for the row, in order; ``prompt``, on the chunk the row
    prefilled, one per prompt position from the second on (the first has no context)."""

    tokens: tuple[IdLogprobs, ...] = ()
    prompt: tuple[IdLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A position's log-probabilities as the caller gets them: the token as text (the
    replica's tokenizer names it, as vLLM's ``convert_ids_list_to_tokens``), its logprob
    (None only for a prompt's first token), and the likeliest tokens with theirs."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


POOLING_KINDS = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class Pooling:
    """How a row's prompt becomes one vector (an embeddings model's): its hidden states
    after the model's final norm pooled by ``kind`` (``last``: the last token's, vLLM's LAST;
    ``mean``: the mean over the prompt; ``cls``: the first token's), the first
    ``dimensions`` of them when set (a Matryoshka model's shorter vector; None: all), then
    L2-normalised when ``normalize`` (after the cut, as vLLM's)."""

    kind: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"Pooling.kind must be one of {POOLING_KINDS}, got {self.kind!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"Pooling.dimensions must be an int >= 1 or None, got {d!r}")


def _check_k(name: str, k: int | None) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
        raise ValueError(f"Join.{name} must be an int in [0, {MAX_TOP_LOGPROBS}] or None, got {k!r}")


@dataclass(frozen=True, slots=True)
class Join:
    """One row that joins its engine's batch at the next chunk (``engine.Batch.run_chunk``).

    ``key`` names the row in its batch (hashable, unique among the batch's rows); ``ids``
    its prompt ids as the engine's ``fit`` left them (kept as a tuple); ``max_new_tokens``
    the most it emits (0: it joins and leaves at once, with no token); ``sampling`` how it
    picks its tokens (None: greedy); ``adapter`` the LoRA adapter it runs with (None: the
    base model; only vLLM serves adapters, the other engines refuse such a row alone);
    ``cache_salt`` its tenant's cache group (None: none; vLLM shares prefix blocks only
    among rows of one salt); ``priority`` its call's (``ModelCall.priority``: vLLM's order
    among rows waiting in it; the other engines ignore it).

    Checked where built: a field of the wrong type is a ValueError here. Whether the row
    fits the context is the engine's to say (its ``run_chunk`` raises), and whether its ids
    are in the vocabulary too (a row outside it is refused alone, ``take_failed``), so ids
    are only made a tuple here: a resumed stream's ids come from the client's side.
    """

    key: Hashable
    ids: Sequence[int]
    max_new_tokens: int
    sampling: RowSampling | None = None
    adapter: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    # Log-probabilities the row asks for (``Batch.take_logprobs``): ``logprobs`` k for each
    # token it emits (0: the chosen token's only; None: none), ``prompt_logprobs`` k for each
    # prompt position (None: none). A row with ``prompt_logprobs`` and ``max_new_tokens`` 0
    # is prefilled, gives its prompt's log-probabilities, and leaves with no token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # An embeddings row (``Batch.take_embeddings``): prefilled, its prompt pooled into one
    # vector, and it leaves with no token (``max_new_tokens`` must be 0).
    pool: Pooling | None = None

    def __post_init__(self) -> None:
        _check_k("logprobs", self.logprobs)
        _check_k("prompt_logprobs", self.prompt_logprobs)
        if self.pool is not None and (not isinstance(self.pool, Pooling) or self.max_new_tokens != 0):
            raise ValueError("Join.pool must be a Pooling, on a row of max_new_tokens 0")
        try:
            hash(self.key)
        except TypeError:
            raise ValueError(f"Join.key must be hashable, got {self.key!r}") from None
        if isinstance(self.ids, (str, bytes)) or not isinstance(self.ids, Sequence):
            raise ValueError(f"Join.ids must be a sequence of token ids, got {type(self.ids).__name__}")
        object.__setattr__(self, "ids", tuple(self.ids))
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"Join.max_new_tokens must be an int >= 0, got {n!r}")
        if self.sampling is not None and not isinstance(self.sampling, RowSampling):
            raise ValueError(f"Join.sampling must be a RowSampling or None, got {type(self.sampling).__name__}")
        for name in ("adapter", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"Join.{name} must be a non-empty str or None, got {value!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"Join.priority must be an int, got {self.priority!r}")


@dataclass(frozen=True)
class Resume:
    """Where a stream stands when it is sent again: the token ids it delivered (the
    primary model's) and the characters of text they gave (Unicode code points)."""

    ids: tuple[int, ...]
    text_chars: int = 0

    def after(self, ids: tuple[int, ...], chars: int) -> Resume:
        """This resume with ``ids`` and ``chars`` more delivered."""
        return Resume(self.ids + ids, self.text_chars + chars)


@dataclass(frozen=True)
class AttemptDeadline:
    """One attempt's deadline: ``budget_s`` left when the router sent it, and the same
    instant on the wall clock (``at_wall_s``)."""

    budget_s: float
    at_wall_s: float

    @classmethod
    def starting(cls, budget_s: float, now_wall_s: float) -> AttemptDeadline:
        return cls(budget_s, now_wall_s + budget_s)

    def left_s(self, now_wall_s: float) -> float:
        """Time left at the replica: the stricter of the budget (it cannot count the time
        the call took to arrive) and the wall-clock instant (it can, but relies on clocks
        in step across nodes: NTP's milliseconds against ``REPLICA_LEAD_S``)."""
        return min(self.budget_s, self.at_wall_s - now_wall_s)


@dataclass(frozen=True)
class ModelCall:
    """One request as a model replica takes it (the module docstring's invariants)."""

    prompt: str
    prompt_ids: tuple[int, ...] = ()
    tokenizer: str = ""  # whose tokens prompt_ids are ("" none: the replica encodes prompt)
    add_special_tokens: bool = True  # for prompt: a chat prompt holds its template's already
    max_tokens: int = 0
    sampling: RowSampling | None = None  # None: the engine's default (greedy)
    stops: tuple[str, ...] = ()
    resume: Resume | None = None
    deadline: AttemptDeadline | None = None
    # Which model and fine-tune the call is for (None: the deployment's own model).
    model: str | None = None
    adapter: str | None = None
    # How the request router may place it (``ballast.policies.affinity.route_mode``): set
    # with the admitted length; not part of what the call asks (an answer cache ignores it).
    route: str = field(default="affinity", compare=False)
    # Replicas (Serve's unique ids) the request router is to pass over while another is
    # ready: a hedge's, or a re-send's after its attempt went silent there. Not part of what
    # the call asks.
    avoid: tuple[str, ...] = field(default=(), compare=False)
    # The salt of the tenant's prefix-cache group (``ballast.policies.cache_groups``), set
    # with the admitted length: the engine's prefix cache and the routers' view of it are
    # shared only among calls of one salt. None: no group (a call built outside a router).
    cache_salt: str | None = None
    # Whose request it is (the tenant its API key says), set with the admitted length: the
    # replica shares what one tenant may hold of it (its grammar compile threads) by it.
    # Not part of what the call asks ("": none named, one tenant for the replica).
    tenant: str = field(default="", compare=False)
    # The engine's order among rows waiting in it (the module docstring): 0, or
    # BATCH_PRIORITY for a batch line's call (``as_batch``). Not part of what the call asks.
    priority: int = field(default=0, compare=False)
    # Choices: n rows from one prompt, each its own seed (``seed + i`` when the call sets
    # one), answered as chunks and choices by ``index``; every row counts as the tokens it
    # costs. At most the router's configured bound (``limits.max_choices``).
    n: int = 1
    # Log-probabilities (``Join.logprobs`` / ``prompt_logprobs``): k likeliest for each token
    # generated (0: the chosen one's only; None: none), and for each prompt position (echo).
    # ``max_tokens`` 0 is a call for the prompt's only (it needs ``prompt_logprobs``).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # An embeddings call: each of ``inputs`` (token ids of the model's tokenizer, ``tokenizer``)
    # is one row pooled as ``pool`` says, answered as a chunk by its index with its vector;
    # ``prompt``/``prompt_ids`` are unused and ``max_tokens`` is 0.
    pool: Pooling | None = None
    inputs: tuple[tuple[int, ...], ...] = ()

    @property
    def input_tokens(self) -> int:
        """What the model prefills for the call: its prompt's ids and a resumed stream's,
        or an embeddings call's inputs' together."""
        if self.pool is not None:
            return sum(len(i) for i in self.inputs)
        return len(self.prompt_ids) + len(self.resumed_ids)

    @property
    def asks(self) -> frozenset[str]:
        """The call fields only some engines honour that this call asks for (its sampling's,
        and ``adapter`` when it names one)."""
        asked = self.sampling.asks if self.sampling is not None else frozenset()
        return asked | {"adapter"} if self.adapter is not None else asked

    @property
    def resumed_ids(self) -> tuple[int, ...]:
        return self.resume.ids if self.resume is not None else ()

    def admitted(
        self, max_tokens: int, route: str = "affinity", cache_salt: str | None = None, tenant: str = ""
    ) -> ModelCall:
        """The call with the length the router admitted, how it may be routed, the salt of its
        tenant's cache group, and whose it is."""
        return replace(self, max_tokens=max_tokens, route=route, cache_salt=cache_salt, tenant=tenant)

    def as_batch(self) -> ModelCall:
        """The call as a batch line's: after every interactive row in the engine."""
        return replace(self, priority=BATCH_PRIORITY)

    def for_attempt(self, left_s: float, now_wall_s: float) -> ModelCall:
        """The call as one attempt sends it: with that attempt's deadline."""
        return replace(self, deadline=AttemptDeadline.starting(left_s, now_wall_s))

    def avoiding(self, replicas: tuple[str, ...]) -> ModelCall:
        """The call routed away from ``replicas`` (while another is ready)."""
        return replace(self, avoid=tuple(dict.fromkeys(self.avoid + replicas)))

    def resumed(self, resume: Resume) -> ModelCall:
        """The call carried on after ``resume`` (a lost replica's delivered ids)."""
        return replace(self, resume=resume)


@dataclass(frozen=True)
class ModelChunk:
    """A piece of a stream: its text (what the caller does not have yet) and token ids.

    ``finish_reason`` on the last chunk ("stop": end of sequence or a stop string;
    "length": max_tokens). ``queue_wait_ms`` and ``max_tokens`` (what the replica ran
    with) on the first chunk of a new request; a resumed stream's first chunk has no
    queue wait (not a new request's)."""

    text: str
    ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    queue_wait_ms: float | None = None
    max_tokens: int | None = None
    # How many prompt tokens the engine took from its prefix cache (its first tokens' chunk;
    # None: not said, an engine without a prefix cache).
    cached_tokens: int | None = None
    # Which choice it belongs to (``ModelCall.n``): each choice's chunks come in order, the
    # choices' interleaved; each ends with its own finish_reason.
    index: int = 0
    # One per id when the call asked for ``logprobs``; the prompt's (``prompt_logprobs``,
    # the first position's logprob None) on choice 0's first chunk.
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # An embeddings call's row: its input's vector (float32, little-endian; ``Pooling``).
    embedding: bytes | None = None

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def without_wait(self) -> ModelChunk:
        return replace(self, queue_wait_ms=None) if self.queue_wait_ms is not None else self


@dataclass(frozen=True)
class ModelResult:
    """A unary answer: the whole text, its token count, why it ended, what the replica
    ran it with, and where its time went (``queue_wait_ms`` waiting for a batch,
    ``compute_ms`` the rest)."""

    text: str
    tokens: int
    finish_reason: str | None
    max_tokens: int = 0
    queue_wait_ms: float = 0.0
    compute_ms: float = 0.0
    replica_id: str = ""
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache
    logprobs: tuple[TokenLogprob, ...] = ()  # choice 0's, one per token (when asked)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # when asked (echo)
    # Every choice of a call with ``n`` > 1, by index (choice 0 first; its text,
    # finish_reason and logprobs are the fields above too, and ``tokens`` above counts all
    # choices' tokens: what the call cost). Empty for a call of one choice.
    choices: tuple[ChoiceResult, ...] = ()
    # An embeddings call's vectors, one per input in order (float32, little-endian).
    embeddings: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class ChoiceResult:
    """One choice of a unary answer with several (``ModelResult.choices``)."""

    index: int
    text: str
    tokens: int
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] = ()
