"""The built-in engine's checkpoints: which model a replica serves, loaded and saved.

A replica's model comes from ``BackendSpec.seed`` (built here, nothing read) or
from a local file, either a ``state_dict`` (needs
:mod:`ballast.model.builtin_decoder` to rebuild the module) or a self-contained
TorchScript archive. ``torch.jit`` is deprecated in torch 2.x (it warns with
``DeprecationWarning``) but still works in 2.13; it is the only format that
carries code and weights in one file and reloads without this package's class
definitions.

Invariants: every load failure is a :class:`ModelLoadError` naming the file; a
``state_dict`` is read with ``weights_only=True``, so a checkpoint cannot run
code on load; the format is sniffed from the file's contents, not its name;
and a save is written beside its target and renamed, so a replica starting
meanwhile never reads half a file.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ballast.errors import ModelLoadError
from ballast.model.builtin_decoder import TinyDecoder, TinyDecoderConfig, build_tiny_decoder, empty_decoder
from ballast.model.builtin_engine import SamplingConfig, TorchDecoderBackend
from ballast.model.untyped import torch_jit
from ballast.policies.validation import check_int, check_name

__all__ = [
    "BackendSpec",
    "detect_checkpoint_format",
    "load_backend",
    "save_state_dict",
    "save_torchscript",
]


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
    model = empty_decoder(cfg)
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as exc:  # missing/unexpected keys, shape mismatch
        raise ModelLoadError(path, f"state_dict does not match {cfg}: {exc}") from exc
    return model.eval()


def _load_torchscript_model(path: str, device: str) -> nn.Module:
    try:
        model: nn.Module = torch_jit().load(path, map_location=device)
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
