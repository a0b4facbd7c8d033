"""Hugging Face checkpoints: check a local causal-LM directory, then load it.

What a team brings is a directory as ``save_pretrained`` writes it:
``config.json``, tokenizer files (``tokenizer.json``, or ``tokenizer_config.json``
and a vocabulary), a chat template, and safetensors weights, one
``model.safetensors`` or a ``model.safetensors.index.json`` and its shards.
Loading is transformers' own (``AutoModelForCausalLM`` / ``AutoTokenizer``);
this module adds what serving needs around it.

**Everything fails at start.** A replica that comes up and then fails on its
first request has already taken traffic, so every check runs before the model
serves: :func:`inspect_checkpoint` reads only files (JSON and safetensors
headers, no tensor data) and refuses a missing directory, a missing or broken
``config.json``, a ``model_type`` transformers does not know as a causal LM,
missing tokenizer files, missing or unreadable weights, an index naming a shard
that is not there, and ``.bin`` weights. :func:`load_checkpoint` then loads, and
turns what transformers only logs (tensors missing from the files, shapes that
do not match the config) into errors, as well as a tokenizer with more tokens
than the model has embeddings. Each error is a :class:`CheckpointError` naming
the file at fault.

**Safetensors only.** ``.bin`` weights are Python pickles, and unpickling runs
whatever code the file holds; a serving fleet loads directories it did not
write, so it reads only safetensors, which are a JSON header and raw tensor
bytes. A ``.bin`` checkpoint converts once, elsewhere, with
``model.save_pretrained(dir, safe_serialization=True)``. For the same reason
``trust_remote_code`` is off: code shipped in a checkpoint directory is never run.

**Never the network.** Every transformers call passes ``local_files_only=True``
and the path must be an existing directory, so it is never read as a hub
repository id; nothing is downloaded at run time (fetch weights elsewhere, with
``hf download``, and point the config at the directory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from ballast.errors import ModelLoadError

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "ChatTemplateError",
    "LoadedModel",
    "count_tokens",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_tokenizer",
    "render_chat",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# Without tokenizer.json, transformers builds a tokenizer from tokenizer_config.json
# and one of these vocabularies (SentencePiece, byte-level BPE, WordPiece).
_VOCAB_FILE_SETS = (
    ("tokenizer.model",),
    ("spiece.model",),
    ("sentencepiece.bpe.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
)
# Where configs keep the context length when not as max_position_embeddings
# (which transformers' attribute_map already aliases for most families).
_CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "n_ctx",
)
_GIT_LFS_POINTER_PREFIX = b"version https://git-lfs"
_MAX_NAMED = 5  # tensors named in one error message; the rest are counted


class CheckpointError(ModelLoadError):
    """A checkpoint directory cannot be served; ``path`` is the file at fault.

    A :class:`ModelLoadError` (so a ``ValueError``), whose ``(path, reason)``
    go to ``super().__init__``: it pickles intact across Ray process boundaries.
    """


class ChatTemplateError(ValueError):
    """The chat template refused these messages (a request error, not a checkpoint one).

    Templates raise on what they do not accept (roles that do not alternate, a
    system message where none is allowed, no messages at all); the front turns
    this into a 4xx for the request, the replica stays up.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`inspect_checkpoint` learnt from the files, without loading tensors.

    ``architecture`` is the class AutoModelForCausalLM builds for ``model_type``.
    ``eos_token_ids`` joins ``config.json``'s and ``generation_config.json``'s
    (chat models often list their end-of-turn token only in the latter).
    ``weight_files`` are the safetensors files, shards sorted by name.
    """

    path: Path
    model_type: str
    architecture: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    weight_files: tuple[Path, ...]

    @property
    def is_sharded(self) -> bool:
        return len(self.weight_files) > 1 or self.weight_files[0].name != WEIGHTS_FILE

    @property
    def weights_entry(self) -> Path:
        """The file transformers opens first: the single file or the index."""
        return self.path / (WEIGHTS_INDEX_FILE if self.is_sharded else WEIGHTS_FILE)


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode on ``device``, its tokenizer, and what inspection found.

    ``eos_token_ids`` adds the tokenizer's eos token to the checkpoint's.
    """

    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    info: CheckpointInfo
    device: str
    dtype: Any  # torch.dtype
    eos_token_ids: tuple[int, ...]


# ----------------------------------------------------------------------- inspection


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check a checkpoint directory from its files alone; raise CheckpointError on the first fault.

    Reads JSON files and safetensors headers only (no tensor data, nothing from
    the network), so it is cheap enough to run before anything is scheduled.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(str(root), "does not exist (model.path must be a local checkpoint directory)")
    if not root.is_dir():
        raise CheckpointError(
            str(root),
            "is not a directory (a checkpoint is a directory holding config.json, "
            "tokenizer files and safetensors weights)",
        )
    raw_config = _read_json_object(root / CONFIG_FILE, "the model config")
    architecture = _causal_lm_architecture(root / CONFIG_FILE, raw_config)
    config = _auto_config(root)
    text_config = config.get_text_config()
    vocab_size = getattr(text_config, "vocab_size", None)
    if not _is_positive_int(vocab_size):
        raise CheckpointError(str(root / CONFIG_FILE), f"vocab_size must be a positive int, got {vocab_size!r}")
    context_length = _context_length(root / CONFIG_FILE, text_config)
    eos_token_ids = _eos_token_ids(root, config, vocab_size)
    has_chat_template = _check_tokenizer_files(root)
    weight_files = _check_weight_files(root)
    return CheckpointInfo(
        path=root,
        model_type=raw_config["model_type"],
        architecture=architecture,
        context_length=context_length,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids,
        has_chat_template=has_chat_template,
        weight_files=weight_files,
    )


def _is_positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _read_json_object(file: Path, what: str) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(str(file), f"is missing ({what})")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(str(file), f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(str(file), f"cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(str(file), f"must hold a JSON object, not {type(data).__name__}")
    return data


def _causal_lm_architecture(config_file: Path, raw: Mapping[str, Any]) -> str:
    """The AutoModelForCausalLM class name for the config's ``model_type``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ballast.model.untyped import transformers

    known = transformers("models.auto.configuration_auto").CONFIG_MAPPING_NAMES  # not exported
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(str(config_file), "has no 'model_type' (transformers picks the architecture by it)")
    if model_type not in known:
        hint = (
            "; its 'auto_map' points at code shipped in the directory, which is never run"
            if "auto_map" in raw
            else "; a newer transformers may know it"
        )
        raise CheckpointError(
            str(config_file),
            f"model_type {model_type!r} is unknown to transformers {transformers().__version__}{hint}",
        )
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if architecture is None:
        raise CheckpointError(
            str(config_file),
            f"model_type {model_type!r} is not a causal LM (AutoModelForCausalLM cannot load it)",
        )
    return architecture


def _auto_config(root: Path) -> Any:
    """The parsed config; transformers validates field types and geometry here."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    except (StrictDataclassError, OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        # StrictDataclassError: a field of the wrong type, or heads that do not divide hidden_size.
        raise CheckpointError(str(root / CONFIG_FILE), f"transformers rejects it: {e}") from e


def _context_length(config_file: Path, text_config: Any) -> int:
    for key in _CONTEXT_LENGTH_KEYS:
        value = getattr(text_config, key, None)
        if value is not None:
            if not _is_positive_int(value):
                raise CheckpointError(str(config_file), f"{key} must be a positive int, got {value!r}")
            return value
    raise CheckpointError(
        str(config_file),
        f"states no context length (none of {', '.join(_CONTEXT_LENGTH_KEYS)}); "
        "requests could not be checked against it",
    )


def _eos_token_ids(root: Path, config: Any, vocab_size: int) -> tuple[int, ...]:
    sources: list[tuple[Path, object]] = [(root / CONFIG_FILE, getattr(config.get_text_config(), "eos_token_id", None))]
    generation_file = root / GENERATION_CONFIG_FILE
    if generation_file.exists():
        generation = _read_json_object(generation_file, "generation defaults")
        sources.append((generation_file, generation.get("eos_token_id")))
    ids: list[int] = []
    for file, value in sources:
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab_size:
                raise CheckpointError(str(file), f"eos_token_id {v!r} is not a token id below vocab_size {vocab_size}")
            if v not in ids:
                ids.append(v)
    return tuple(ids)


def _check_tokenizer_files(root: Path) -> bool:
    """Raise unless transformers can build a tokenizer here; return whether a chat template ships."""
    tokenizer_config: dict[str, Any] = {}
    if (root / TOKENIZER_CONFIG_FILE).exists():
        tokenizer_config = _read_json_object(root / TOKENIZER_CONFIG_FILE, "tokenizer settings")
    if not (root / TOKENIZER_FILE).is_file():
        has_vocab = any(all((root / name).is_file() for name in names) for names in _VOCAB_FILE_SETS)
        if not (tokenizer_config and has_vocab):
            vocabs = ", ".join(" + ".join(names) for names in _VOCAB_FILE_SETS)
            raise CheckpointError(
                str(root / TOKENIZER_FILE),
                f"is missing, and there is no {TOKENIZER_CONFIG_FILE} with a vocabulary ({vocabs}) "
                "to build the tokenizer from",
            )
    # Templates live in tokenizer_config.json (older saves), chat_template.jinja
    # (transformers >= 4.43 writes this), chat_template.json, or several named
    # ones under additional_chat_templates/.
    return bool(
        tokenizer_config.get("chat_template")
        or (root / "chat_template.jinja").is_file()
        or (root / "chat_template.json").is_file()
        or any((root / "additional_chat_templates").glob("*.jinja"))
    )


def _check_weight_files(root: Path) -> tuple[Path, ...]:
    """The safetensors files, checked to exist and to have readable headers.

    Same precedence as transformers: ``model.safetensors`` first, then the index.
    """
    single = root / WEIGHTS_FILE
    index_file = root / WEIGHTS_INDEX_FILE
    if single.is_file():
        _tensor_names(single)
        return (single,)
    if index_file.is_file():
        return _check_index(root, index_file)
    pickles = sorted(p for p in root.iterdir() if p.name.endswith((".bin", ".bin.index.json", ".pt", ".pth")))
    if pickles:
        raise CheckpointError(
            str(pickles[0]),
            "holds pickled PyTorch weights, which are refused: unpickling runs any code the file "
            "contains. Convert the checkpoint once, elsewhere, with "
            "model.save_pretrained(dir, safe_serialization=True)",
        )
    raise CheckpointError(str(single), f"is missing, and so is {WEIGHTS_INDEX_FILE} (no weights)")


def _check_index(root: Path, index_file: Path) -> tuple[Path, ...]:
    weight_map = _read_json_object(index_file, "the shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(str(index_file), "has no 'weight_map' from tensor names to shard files")
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        # A shard is a plain file name in the directory: no path may lead elsewhere.
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise CheckpointError(
                str(index_file), f"maps {tensor!r} to {shard!r}, not a .safetensors file in the directory"
            )
        by_shard.setdefault(shard, []).append(tensor)
    shards = []
    for shard, tensors in by_shard.items():
        file = root / shard
        if not file.is_file():
            raise CheckpointError(str(file), f"is missing ({WEIGHTS_INDEX_FILE} places {len(tensors)} tensors in it)")
        present = _tensor_names(file)
        absent = [t for t in tensors if t not in present]
        if absent:
            raise CheckpointError(str(file), f"lacks {_name_some(absent)}, which {WEIGHTS_INDEX_FILE} places in it")
        shards.append(file)
    return tuple(sorted(shards))


def _tensor_names(file: Path) -> set[str]:
    """Names in a safetensors header; reads the header only, via the numpy view."""
    from safetensors import SafetensorError, safe_open

    try:
        with file.open("rb") as f:
            head = f.read(len(_GIT_LFS_POINTER_PREFIX))
    except OSError as e:
        raise CheckpointError(str(file), f"cannot be read: {e}") from e
    if head == _GIT_LFS_POINTER_PREFIX:
        raise CheckpointError(
            str(file), "is a Git LFS pointer, not the weights (run `git lfs pull` where it was cloned)"
        )
    try:
        with safe_open(str(file), framework="numpy") as f:
            return set(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(str(file), f"is not a readable safetensors file (truncated or corrupt?): {e}") from e


def _name_some(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:_MAX_NAMED])
    more = len(names) - _MAX_NAMED
    return f"{shown} and {more} more" if more > 0 else shown


# -------------------------------------------------------------------------- loading


def load_checkpoint(path: str | os.PathLike[str], device: str = "cpu", dtype: Any = None) -> LoadedModel:
    """Inspect, then load the tokenizer and the model onto ``device``, in eval mode.

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``dtype`` (a
    ``torch.dtype`` or its name) defaults to bfloat16 on CUDA and float32 on
    CPU (CPU bfloat16 matmuls are slow on most cores). The tokenizer loads
    first, so a mismatched vocabulary fails before the weights are read.
    """
    info = inspect_checkpoint(path)
    device = _resolve_device(info.path, device)
    torch_dtype = _resolve_dtype(dtype, device)
    tokenizer = _load_tokenizer(info)
    model = _load_model(info, device, torch_dtype)
    eos = list(info.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        info=info,
        device=device,
        dtype=torch_dtype,
        eos_token_ids=tuple(eos),
    )


def attention_kernels(device: str) -> AbstractContextManager[Any]:
    """The scaled-dot-product attention kernels a forward on ``device`` may use:
    on CUDA every backend but cuDNN's; elsewhere whatever PyTorch picks.

    cuDNN's attention builds an execution plan for each new shape, and a decoding
    batch has a new shape at every step (its KV cache is one column wider), so with
    it every step pays for a plan, whatever the rows (docs/benchmarks.md, "The
    transformers engine on an H100"). Flash, memory-efficient and math kernels need
    no plan. Scoped to the forward it wraps: the process's own setting is left as it
    was.
    """
    if not str(device).startswith("cuda"):
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def load_tokenizer(path: str | os.PathLike[str]) -> tuple[Any, CheckpointInfo]:
    """The checkpoint's tokenizer and what inspection found, without loading weights
    (the router counts tokens and renders chat templates with it)."""
    info = inspect_checkpoint(path)
    return _load_tokenizer(info), info


# Files a tokenizer is built from (AutoTokenizer reads those present).
_TOKENIZER_FILES = frozenset(
    {"special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja"}
)


def tokenizer_id(path: str | os.PathLike[str]) -> str:
    """Who made a prompt's token ids: a hash of the files ``path``'s tokenizer is built
    from (``tokenizer*``, vocabularies, merges, sentencepiece models). Two directories
    with the same id tokenize alike, so a replica takes the router's ids as they are
    (``protocol.ModelCall.tokenizer``); any other encodes the prompt itself."""
    root = Path(path)
    digest = hashlib.sha256()
    for f in sorted(root.iterdir()):
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in _TOKENIZER_FILES or f.suffix == ".model"):
            digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return "hf:" + digest.hexdigest()[:24]


def _resolve_device(root: Path, device: str) -> str:
    import torch

    if device == "cpu":
        return device
    if device == "cuda":
        device = "cuda:0"
    if not (isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available() or int(device[5:]) >= torch.cuda.device_count():
        # The device, not the checkpoint, is at fault: the base error, naming the directory.
        raise ModelLoadError(str(root), f"{device} was asked for but this process sees no such CUDA device")
    return device


def _resolve_dtype(dtype: Any, device: str) -> Any:
    import torch

    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype such as 'bfloat16', got {dtype!r}")
        dtype = resolved
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    return dtype


def _load_tokenizer(info: CheckpointInfo) -> Any:
    from transformers import AutoTokenizer

    tokenizer_file = info.path / TOKENIZER_FILE
    blamed = tokenizer_file if tokenizer_file.is_file() else info.path / TOKENIZER_CONFIG_FILE
    try:
        tokenizer = AutoTokenizer.from_pretrained(info.path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError, RuntimeError) as e:
        # ImportError: a tokenizer class whose backend (sentencepiece, ...) is not installed.
        raise CheckpointError(str(blamed), f"transformers cannot build the tokenizer: {e}") from e
    # A token id past the embedding table would fail on the first request that produces it.
    if len(tokenizer) > info.vocab_size:
        raise CheckpointError(
            str(blamed),
            f"has {len(tokenizer)} tokens but {CONFIG_FILE} gives the model only "
            f"vocab_size {info.vocab_size} embeddings",
        )
    return tokenizer


def _load_model(info: CheckpointInfo, device: str, dtype: Any) -> Any:
    import torch

    from ballast.model.untyped import transformers

    try:
        # ignore_mismatched_sizes=True makes transformers report wrong shapes in
        # loading_info instead of raising a bare RuntimeError; they are raised
        # below, with missing tensors, which transformers would only log.
        model, loading = transformers().AutoModelForCausalLM.from_pretrained(
            info.path,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=dtype,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
    except torch.OutOfMemoryError:
        raise  # the device is too small; the files are not at fault
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise CheckpointError(str(info.weights_entry), f"transformers cannot load the weights: {e}") from e

    if loading["mismatched_keys"]:
        mismatched = sorted(loading["mismatched_keys"])
        name, file_shape, model_shape = mismatched[0]
        more = f" ({len(mismatched) - 1} more tensors mismatch too)" if len(mismatched) > 1 else ""
        raise CheckpointError(
            str(_file_holding(info, name)),
            f"tensor {name!r} has shape {tuple(file_shape)} but {CONFIG_FILE} needs "
            f"{tuple(model_shape)}{more}: the weights do not match the config",
        )
    if loading["missing_keys"]:
        raise CheckpointError(
            str(info.weights_entry),
            f"lacks {_name_some(sorted(loading['missing_keys']))}, which the {info.architecture} "
            f"of {CONFIG_FILE} needs (they would be random)",
        )
    if loading["error_msgs"]:
        raise CheckpointError(str(info.weights_entry), "; ".join(loading["error_msgs"]))
    if loading["unexpected_keys"]:
        # Extra tensors are not wrong for serving (training-only heads, buffers
        # newer transformers recompute); they are ignored, with a word.
        logger.warning(
            "%s: ignoring tensors the %s does not use: %s",
            info.weights_entry,
            info.architecture,
            _name_some(sorted(loading["unexpected_keys"])),
        )
    # Loaded on CPU, then moved: a device_map would load straight onto the GPU
    # but needs accelerate, which is not worth a dependency for one copy at start.
    return model.to(device).eval()


def _file_holding(info: CheckpointInfo, tensor: str) -> Path:
    """The weights file that holds ``tensor``, else the entry file."""
    if not info.is_sharded:
        return info.weight_files[0]
    try:
        weight_map: dict[str, str] = json.loads(info.weights_entry.read_text(encoding="utf-8"))["weight_map"]
        return info.path / weight_map[tensor]
    except (OSError, ValueError, KeyError, TypeError):
        return info.weights_entry


# ------------------------------------------------------------------------ text side


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    special_tokens_in_content: str = "text",
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages`` (and the ``tools`` the model may call, when
    given), through the tokenizer's chat template; ``template_kwargs`` are the template's
    own variables (``enable_thinking``), checked by the front (``openai_api``), whose
    values a client wrote as it wrote the messages.

    The generation prompt (the assistant's turn header) is appended. The text
    already holds the template's special tokens (a bos, turn markers), so count
    or encode it with ``add_special_tokens=False``, through
    ``special_tokens.encode_text``. With ``special_tokens_in_content`` "text", a
    special token's text in the messages, the tools and the template variables' values
    is escaped first (``special_tokens.escape_content``), so that it is encoded as text
    (a template that writes a variable into the prompt writes text); "control": as it is.
    A template that refuses the messages raises :class:`ChatTemplateError`; a tokenizer
    with no template raises :class:`CheckpointError`.
    """
    import jinja2

    from ballast.model.special_tokens import escape_content

    if special_tokens_in_content == "text":
        messages = escape_content(list(messages), tokenizer)
        tools = escape_content(list(tools), tokenizer) if tools else None
        template_kwargs = {k: escape_content(v, tokenizer) for k, v in (template_kwargs or {}).items()}

    if not getattr(tokenizer, "chat_template", None):
        raise CheckpointError(
            str(getattr(tokenizer, "name_or_path", "") or "<tokenizer>"),
            "has no chat template, so chat messages cannot be turned into a prompt",
        )
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
            **dict(template_kwargs or {}),
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
        raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
    if not isinstance(text, str):  # a batch of conversations was passed
        raise ChatTemplateError("messages must be one conversation (a list of role/content mappings)")
    return text


def count_tokens(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> int:
    """How many tokens ``text`` is, counted by the model's own tokenizer.

    ``add_special_tokens=False`` suits a rendered chat prompt, whose special
    tokens the template already wrote; pass True for a raw prompt that will be
    encoded with them (a Llama tokenizer then adds the bos).
    """
    from ballast.model.special_tokens import encode_text

    return len(encode_text(tokenizer, text, add_special_tokens))
