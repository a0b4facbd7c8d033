"""The LoRA adapters a vLLM engine serves beside its base model.

A backend started with ``enable_lora`` serves named adapters (local directories in PEFT's
format): :meth:`LoRATable.add` loads one into vLLM at once (``AsyncLLM.add_lora``), so
that a bad directory is refused there with vLLM's reason (``AdapterRefused``), never on a
request; :meth:`LoRATable.remove` unloads it. Each adapter keeps one ``LoRARequest`` (its
name, an int id never reused by this engine, its directory); a row whose join names an
adapter runs with it, and a row naming one that is not loaded is refused alone
(``EngineRefused`` naming ``model``, ``ballast.model.vllm_batch``). vLLM keeps at most
``max_cpu_loras`` adapters in memory and ``max_loras`` in one step; one it evicted is read
again from its directory when a row needs it. A removed adapter's rows already in the
engine finish with it.

On CPU, vLLM's LoRA ops (``vllm/lora/ops/torch_ops``) index a row without an adapter
(index -1) as the last adapter slot, so a base-model row that shares a step with adapter
rows would run with an adapter there (vllm PR #48421): there, base rows run with a zero
adapter instead (:attr:`LoRATable.base`), which gives the base model's output exactly.

``lora_engine_kwargs`` sets the engine's LoRA arguments from the adapters served at start.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ballast.errors import AdapterRefused, ModelLoadError
from ballast.model.untyped import VLLMObject
from ballast.model.vllm_loop import CALL_SLACK_S, EngineLoop

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = ["BASE_ADAPTER", "LoRATable", "lora_engine_kwargs", "precheck_adapters"]

log = logging.getLogger("ballast.vllm")

#: The zero adapter base-model rows run with on CPU (:attr:`LoRATable.base`); not a name a
#: request or an operator can give (names are checked: ``check_adapter_name``).
BASE_ADAPTER = "ballast:base"
ADAPTER_LOAD_S = 120.0  # one adapter's load into vLLM (read from disk, checked, copied in)
# LoRA settings Ballast sets when a model has adapters and leaves them out: vLLM's own
# max_lora_rank (16, which covers the common r <= 16 fine-tunes; the LoRA buffers vLLM
# allocates at start grow with it), raised to the largest rank among the adapters loaded at
# start; an adapter added later above it is refused with vLLM's reason.
DEFAULT_MAX_LORA_RANK = 16
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's max_lora_rank accepts
MAX_ADAPTER_NAME = 128


class LoRATable:
    """The adapters one engine serves, by name (see the module docstring).

    ``lock`` guards the table and the ids: ``add`` and ``remove`` run on any thread, batches
    read the table on the engine loop. An adapter enters the table only once vLLM loaded it
    and leaves it before vLLM unloads it, so a row never runs with one vLLM refused.
    ``llm`` is vLLM's ``AsyncLLM`` (``lora_config`` None: LoRA off, every add refused)."""

    def __init__(self, loop: EngineLoop, llm: VLLMObject, *, model: str, device: str) -> None:
        self._loop = loop
        self._llm = llm
        self._model = model
        self._device = device
        self._lock = threading.Lock()
        self._served: dict[str, LoRARequest] = {}
        self._ids = 0  # the last LoRARequest id handed out; ids are never reused
        self._base: LoRARequest | None = None  # on CPU with LoRA on: the zero adapter base rows run with
        self._base_dir: str | None = None
        self._closed = False

    def load(self, adapters: Mapping[str, str]) -> None:
        """The adapters served from the start; AdapterRefused for the first one refused."""
        for name, path in adapters.items():
            self.add(name, path)

    def add(self, name: str, path: str) -> None:
        """Load the PEFT adapter in the local directory ``path`` into vLLM now, served as
        ``name``. AdapterRefused (nothing loaded) for a name that is not a plain one or is
        taken by another directory, a path that is not a local directory, LoRA off, or
        vLLM's own refusal, with its reason. Adding a loaded adapter again is a no-op."""
        from vllm.lora.request import LoRARequest

        check_adapter_name(name, self._model, path)
        where = adapter_dir(name, path)
        if self._llm.vllm_config.lora_config is None:
            raise AdapterRefused(name, path, f"model {self._model!r} was started without enable_lora")
        with self._lock:
            held = self._served.get(name)
            if held is not None:
                if held.lora_path != where:
                    raise AdapterRefused(name, path, f"the name is taken by {held.lora_path}; remove it first")
                return
            self._ids += 1
            req = LoRARequest(lora_name=name, lora_int_id=self._ids, lora_path=where)
        try:
            self._loop.call(self._llm.add_lora(req), ADAPTER_LOAD_S)
        except Exception as e:  # vLLM's reason, from its engine core (the adapter alone: the engine goes on)
            raise AdapterRefused(name, path, f"vLLM refuses it: {e}") from None
        with self._lock:
            kept = self._served.setdefault(name, req)
        if kept is not req:  # a concurrent add of the same name won: unload this copy
            self._loop.call(self._llm.remove_lora(req.lora_int_id), CALL_SLACK_S)
        if self._base is None:
            self._add_base()

    def remove(self, name: str) -> bool:
        """Stop serving ``name`` and unload it from vLLM; False when it was not loaded. Rows
        already in the engine with it finish; a row that joins after is refused."""
        with self._lock:
            req = self._served.pop(name, None)
        if req is None:
            return False
        self._loop.call(self._llm.remove_lora(req.lora_int_id), CALL_SLACK_S)
        return True

    def served(self) -> dict[str, str]:
        """The adapters served, by name: their directories."""
        with self._lock:
            return {name: req.lora_path for name, req in self._served.items()}

    def serves(self, name: str) -> bool:
        with self._lock:
            return name in self._served

    def request(self, name: str) -> LoRARequest | None:
        """The adapter's ``LoRARequest``; None when it is not loaded."""
        with self._lock:
            return self._served.get(name)

    @property
    def base(self) -> LoRARequest | None:
        """The zero adapter base-model rows run with (on CPU with LoRA on, once an adapter
        gave it its shapes); None: base rows run without one."""
        return self._base

    @property
    def slots(self) -> int:
        """Adapters vLLM keeps in its batch slots (``max_loras``); 0 without LoRA."""
        lora = self._llm.vllm_config.lora_config
        return int(lora.max_loras) if lora is not None else 0

    def close(self) -> None:
        """The engine is gone: no zero adapter is made any more, and its directory is removed."""
        self._closed = True
        if self._base_dir is not None:
            shutil.rmtree(self._base_dir, ignore_errors=True)

    def _add_base(self) -> None:
        """On CPU with LoRA on, load a zero adapter (every LoRA weight 0: exactly the base
        model's output) that base-model rows run with, so that no row in a step runs without
        an adapter: vLLM's CPU LoRA ops take such a row's index (-1) for the last slot and
        give it that adapter's output (vllm PR #48421). Its shapes are a loaded adapter's;
        none loaded yet: the first one added makes it. Not on GPU, where rows without an
        adapter are right. It takes one of the step's ``max_loras`` slots when base rows
        share a step with adapter rows (``lora_engine_kwargs`` leaves one for it)."""
        from vllm.lora.request import LoRARequest

        if self._closed or self._device != "cpu" or self._llm.vllm_config.lora_config is None:
            return
        with self._lock:
            source = next((req.lora_path for req in self._served.values()), None)
        if source is None:
            return
        where = tempfile.mkdtemp(prefix="ballast-base-lora-")
        if not write_zero_adapter(Path(source), Path(where)):
            shutil.rmtree(where, ignore_errors=True)
            log.warning("model %r: no safetensors in %s to shape a zero adapter from", self._model, source)
            return
        with self._lock:
            self._ids += 1
            req = LoRARequest(lora_name=BASE_ADAPTER, lora_int_id=self._ids, lora_path=where)
        self._loop.call(self._llm.add_lora(req), ADAPTER_LOAD_S)
        self._base, self._base_dir = req, where


def lora_engine_kwargs(
    engine_kwargs: dict[str, Any], adapters: Mapping[str, str], base_slot: bool = False
) -> dict[str, Any]:
    """``engine_kwargs`` with LoRA turned on when there are ``adapters`` (unless it says
    ``enable_lora``), ``max_loras`` (adapters in one step) as many as the adapters up to 4
    (one more with ``base_slot``: on CPU, the zero adapter base rows run with,
    ``LoRATable.base``), and ``max_lora_rank`` vLLM's 16 or the smallest rank
    vLLM takes that holds the largest adapter's (read from its ``adapter_config.json``; one
    that cannot be read is vLLM's to refuse when it is loaded)."""
    out = dict(engine_kwargs)
    if not adapters or out.get("enable_lora") is False:
        return out
    out["enable_lora"] = True
    out.setdefault("max_loras", max(1, min(len(adapters), 4)) + int(base_slot))
    if "max_lora_rank" not in out:
        rank = max([DEFAULT_MAX_LORA_RANK, *(adapter_rank(p) for p in adapters.values())])
        out["max_lora_rank"] = next((r for r in LORA_RANKS if r >= rank), LORA_RANKS[-1])
    return out


def adapter_rank(path: str) -> int:
    """The largest rank in a PEFT adapter's ``adapter_config.json`` (0: none readable)."""
    try:
        c = json.loads((Path(path) / "adapter_config.json").read_text())
        return max([int(c.get("r") or 0), *(int(v) for v in (c.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def precheck_adapters(adapters: Mapping[str, str], model: str) -> None:
    """ModelLoadError for an adapter whose name or directory :meth:`LoRATable.add` refuses."""
    for name, path in adapters.items():
        try:
            check_adapter_name(name, model, path)
            adapter_dir(name, path)
        except AdapterRefused as e:
            raise ModelLoadError(e.path, f"adapter {e.name!r}: {e.reason}") from None


def adapter_dir(name: str, path: str) -> str:
    """``path`` as an absolute local directory (vLLM would take anything else for a
    Hugging Face repository id and download it: nothing is downloaded here)."""
    p = Path(path).expanduser() if isinstance(path, str) and path else None
    if p is None or not p.is_dir():
        raise AdapterRefused(name, str(path), "not a local directory")
    return str(p.resolve())


def check_adapter_name(name: str, model: str, path: str) -> None:
    """A name a request can give as its ``model`` (alone or as ``<model>:<name>``): printable,
    no whitespace or colon, at most ``MAX_ADAPTER_NAME`` characters, not the model's own."""
    ok = isinstance(name, str) and 0 < len(name) <= MAX_ADAPTER_NAME and name.isprintable()
    if not ok or name == model or any(c.isspace() or c == ":" for c in name):
        raise AdapterRefused(
            str(name),
            path,
            f"an adapter's name is 1-{MAX_ADAPTER_NAME} printable characters, no whitespace or ':', "
            f"and not the model's own name {model!r}",
        )


def write_zero_adapter(source: Path, out: Path) -> bool:
    """A PEFT adapter in ``out`` shaped as the one in ``source``, every weight zero; False
    when ``source`` holds no ``adapter_model.safetensors`` to shape it from."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = source / "adapter_model.safetensors"
    if not weights.is_file():
        return False
    shutil.copyfile(source / "adapter_config.json", out / "adapter_config.json")
    save_file({k: torch.zeros_like(v) for k, v in load_file(str(weights)).items()}, str(out / weights.name))
    return True
