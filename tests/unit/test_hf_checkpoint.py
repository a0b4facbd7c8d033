"""ballast.model.hf_checkpoint: a Hugging Face checkpoint directory loads, or fails at start naming the file.

Every checkpoint here is the tiny random Llama of ``hf_fixture``, written to a
temporary directory and then broken one way per test. Nothing is downloaded:
one test loads with every socket connect refused.
"""

from __future__ import annotations

import json
import pickle
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_fixture import make_tiny_llama  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from ballast.model.engine import ModelLoadError  # noqa: E402
from ballast.model.hf_checkpoint import (  # noqa: E402
    ChatTemplateError,
    CheckpointError,
    attention_kernels,
    count_tokens,
    inspect_checkpoint,
    load_checkpoint,
    render_chat,
)

PROMPTS = ("The capital of France", "Hello! How are you", "def add(a, b):")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("sharded") / "model", shards=2)


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path):
    return load_checkpoint(tiny_dir)


def _greedy(lm, prompt: str) -> list[int]:
    inputs = lm.tokenizer(prompt, return_tensors="pt")
    out = lm.model.generate(**inputs, do_sample=False, max_new_tokens=8)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# ------------------------------------------------------------------------ the fixture


def test_fixture_is_byte_for_byte_reproducible(tmp_path: Path, tiny_dir: Path) -> None:
    again = make_tiny_llama(tmp_path / "again")
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_fixture_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    make_tiny_llama(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_sharded_fixture_writes_exactly_that_many_shards(tmp_path: Path, sharded_dir: Path) -> None:
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert not (sharded_dir / "model.safetensors").exists()
    three = make_tiny_llama(tmp_path / "three", shards=3)
    assert len(list(three.glob("model-*-of-00003.safetensors"))) == 3


def test_fixture_without_chat_template(tmp_path: Path) -> None:
    info = inspect_checkpoint(make_tiny_llama(tmp_path / "m", chat_template=False))
    assert info.has_chat_template is False


# ------------------------------------------------------------------------- loading


def test_inspect_reads_the_files(tiny_dir: Path) -> None:
    info = inspect_checkpoint(tiny_dir)
    assert info.path == tiny_dir
    assert info.model_type == "llama"
    assert info.architecture == "LlamaForCausalLM"
    assert info.context_length == 128
    assert info.vocab_size == 384
    assert info.eos_token_ids == (1,)
    assert info.has_chat_template is True
    assert info.weight_files == (tiny_dir / "model.safetensors",)
    assert not info.is_sharded


def test_loads_in_eval_mode_on_cpu_in_float32(loaded, tiny_dir: Path) -> None:
    assert loaded.info == inspect_checkpoint(tiny_dir)
    assert loaded.device == "cpu"
    assert loaded.dtype is torch.float32
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype is torch.float32
    assert len(loaded.tokenizer) == loaded.info.vocab_size
    assert loaded.eos_token_ids == (loaded.tokenizer.eos_token_id,)


def test_dtype_may_be_named(tiny_dir: Path) -> None:
    lm = load_checkpoint(tiny_dir, dtype="bfloat16")
    assert lm.dtype is torch.bfloat16
    assert next(lm.model.parameters()).dtype is torch.bfloat16


@pytest.mark.parametrize("dtype", ["int8", "no_such_dtype", torch.int64])
def test_dtype_must_be_floating(tiny_dir: Path, dtype) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(tiny_dir, dtype=dtype)


def test_bad_device_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="device"):
        load_checkpoint(tiny_dir, device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_without_a_gpu_fails_at_start_naming_the_device(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="cuda:0") as info:
        load_checkpoint(tiny_dir, device="cuda")
    assert not isinstance(info.value, CheckpointError)  # the files are fine


def test_sharded_checkpoint_loads_the_same_weights(loaded, sharded_dir: Path) -> None:
    sharded = load_checkpoint(sharded_dir)
    assert sharded.info.is_sharded
    assert [p.name for p in sharded.info.weight_files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    one = loaded.model.state_dict()
    for name, tensor in sharded.model.state_dict().items():
        assert torch.equal(tensor, one[name]), name
    assert _greedy(sharded, PROMPTS[0]) == _greedy(loaded, PROMPTS[0])


def test_greedy_generation_is_deterministic_and_depends_on_the_prompt(loaded) -> None:
    first = [_greedy(loaded, p) for p in PROMPTS]
    assert [_greedy(loaded, p) for p in PROMPTS] == first
    assert all(len(ids) == 8 for ids in first)
    # Not vacuous: different prompts continue differently, not one token repeated.
    assert len({tuple(ids) for ids in first}) == len(PROMPTS)
    assert all(len(set(ids)) > 1 for ids in first)


def test_never_touches_the_network(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"network use: connect{args[1:]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    lm = load_checkpoint(tiny_dir)
    assert len(_greedy(lm, PROMPTS[0])) == 8


# ------------------------------------------------------------------------ text side


def test_render_chat_uses_the_template_and_counts_match(loaded) -> None:
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Café? 東京!"},
    ]
    text = render_chat(loaded.tokenizer, messages)
    assert text == ("<s><|system|>\nYou are brief.</s>\n<|user|>\nCafé? 東京!</s>\n<|assistant|>\n")
    templated_ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert count_tokens(loaded.tokenizer, text) == len(templated_ids)
    # The template wrote the bos; encoding the text again must not add a second one.
    assert loaded.tokenizer.encode(text, add_special_tokens=False)[0] == loaded.tokenizer.bos_token_id


def test_count_tokens_with_special_tokens_adds_the_bos(loaded) -> None:
    plain = count_tokens(loaded.tokenizer, "Hello there")
    assert plain > 0
    assert count_tokens(loaded.tokenizer, "Hello there", add_special_tokens=True) == plain + 1
    assert count_tokens(loaded.tokenizer, "") == 0


def test_render_chat_refused_by_the_template_is_a_request_error(loaded) -> None:
    with pytest.raises(ChatTemplateError, match="chat template"):
        render_chat(loaded.tokenizer, [])
    err = pickle.loads(pickle.dumps(ChatTemplateError("roles must alternate")))
    assert err.reason == "roles must alternate"


def test_render_chat_without_a_template_names_the_checkpoint(tmp_path: Path) -> None:
    root = make_tiny_llama(tmp_path / "m", chat_template=False)
    lm = load_checkpoint(root)
    with pytest.raises(CheckpointError, match="no chat template") as info:
        render_chat(lm.tokenizer, [{"role": "user", "content": "hi"}])
    assert str(root) in str(info.value)


# ------------------------------------------------------------------- bad directories


def _rewrite_tensors(file: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _write_json(file: Path, data: object) -> None:
    file.write_text(json.dumps(data))


def _edit_config(root: Path, **changes: object) -> None:
    config = json.loads((root / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    _write_json(root / "config.json", config)


def _wrong_shape(root: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(16, 32)

    _rewrite_tensors(root / "model.safetensors", change)


def _missing_tensor(root: Path) -> None:
    _rewrite_tensors(root / "model.safetensors", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))


def _bin_only(root: Path) -> None:
    (root / "model.safetensors").unlink()
    (root / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle")


def _truncated(root: Path) -> None:
    data = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(data[: len(data) // 2])


def _lfs_pointer(root: Path) -> None:
    (root / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 174808\n")


def _tokenizer_too_big(root: Path) -> None:
    # The config shrinks below the tokenizer: ids past 300 would have no embedding.
    _edit_config(root, vocab_size=300)


def _unlink(name: str) -> Callable[[Path], None]:
    return lambda root: (root / name).unlink()


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda root: (root / name).write_text(text)


def _config(**changes: object) -> Callable[[Path], None]:
    return lambda root: _edit_config(root, **changes)


# (test id, how the directory breaks, the file the error names, words in its reason)
BAD_DIRS = [
    ("no config.json", _unlink("config.json"), "config.json", "missing"),
    ("config not JSON", _write("config.json", "{model_type: llama"), "config.json", "not valid JSON"),
    ("config a JSON list", _write("config.json", '["llama"]'), "config.json", "JSON object"),
    ("no model_type", _config(model_type=None), "config.json", "no 'model_type'"),
    ("unknown model_type", _config(model_type="no-such-arch"), "config.json", "unknown to transformers"),
    (
        "remote code",
        _config(model_type="mine", auto_map={"AutoModelForCausalLM": "m.M"}),
        "config.json",
        "never run",
    ),
    ("not a causal LM", _config(model_type="vit"), "config.json", "not a causal LM"),
    ("field of wrong type", _config(hidden_size="32"), "config.json", "hidden_size"),
    ("heads do not divide hidden", _config(num_attention_heads=5), "config.json", "attention heads"),
    ("bad context length", _config(max_position_embeddings=0), "config.json", "max_position_embeddings"),
    ("eos id past vocab", _config(eos_token_id=[1, 999]), "config.json", "eos_token_id 999"),
    (
        "generation_config not JSON",
        _write("generation_config.json", "{"),
        "generation_config.json",
        "not valid JSON",
    ),
    ("no tokenizer", _unlink("tokenizer.json"), "tokenizer.json", "missing"),
    (
        "tokenizer_config not JSON",
        _write("tokenizer_config.json", "}"),
        "tokenizer_config.json",
        "not valid JSON",
    ),
    ("no weights", _unlink("model.safetensors"), "model.safetensors", "no weights"),
    (".bin only", _bin_only, "pytorch_model.bin", "pickle"),
    ("truncated weights", _truncated, "model.safetensors", "not a readable safetensors"),
    ("git lfs pointer", _lfs_pointer, "model.safetensors", "Git LFS pointer"),
    # The rest only show when loading.
    ("tokenizer bigger than vocab", _tokenizer_too_big, "tokenizer.json", "vocab_size 300"),
    (
        "wrong shape",
        _wrong_shape,
        "model.safetensors",
        "'model.layers.1.self_attn.q_proj.weight' has shape (16, 32) but config.json needs (32, 32)",
    ),
    ("missing tensor", _missing_tensor, "model.safetensors", "lacks 'model.layers.0.mlp.up_proj.weight'"),
]
LOAD_ONLY = {"tokenizer bigger than vocab", "wrong shape", "missing tensor"}


@pytest.mark.parametrize(
    ("breaks", "file", "words"), [case[1:] for case in BAD_DIRS], ids=[case[0] for case in BAD_DIRS]
)
def test_bad_directory_fails_at_load_naming_the_file(
    tmp_path: Path, tiny_dir: Path, breaks: Callable[[Path], None], file: str, words: str
) -> None:
    root = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    breaks(root)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root)
    assert info.value.path == str(root / file)
    assert f"'{root / file}'" in str(info.value)
    assert words in info.value.reason


# Faults the files alone show are found by inspection, before any tensor is read.
FILE_FAULTS = [case for case in BAD_DIRS if case[0] not in LOAD_ONLY]


@pytest.mark.parametrize(("breaks", "file"), [case[1:3] for case in FILE_FAULTS], ids=[case[0] for case in FILE_FAULTS])
def test_file_faults_are_found_by_inspection(
    tmp_path: Path, tiny_dir: Path, breaks: Callable[[Path], None], file: str
) -> None:
    root = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    breaks(root)
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(root)
    assert info.value.path == str(root / file)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(tmp_path / "nope")
    assert info.value.path == str(tmp_path / "nope")


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a directory"):
        inspect_checkpoint(tmp_path / "model.safetensors")


def _copy_sharded(sharded_dir: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = Path(shutil.copytree(sharded_dir, tmp_path / "model"))
    return root, json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]


def test_index_naming_a_missing_shard(tmp_path: Path, sharded_dir: Path) -> None:
    root, _ = _copy_sharded(sharded_dir, tmp_path)
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="is missing") as info:
        load_checkpoint(root)
    assert info.value.path == str(root / "model-00002-of-00002.safetensors")
    assert "model.safetensors.index.json places" in info.value.reason


def test_index_placing_a_tensor_in_the_wrong_shard(tmp_path: Path, sharded_dir: Path) -> None:
    root, weight_map = _copy_sharded(sharded_dir, tmp_path)
    name = "lm_head.weight"
    other = next(s for s in set(weight_map.values()) if s != weight_map[name])
    weight_map[name] = other
    _write_json(root / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    with pytest.raises(CheckpointError, match="lacks 'lm_head.weight'") as info:
        inspect_checkpoint(root)
    assert info.value.path == str(root / other)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "model.bin", 3])
def test_index_may_only_name_safetensors_in_the_directory(tmp_path: Path, sharded_dir: Path, shard) -> None:
    root, weight_map = _copy_sharded(sharded_dir, tmp_path)
    weight_map["lm_head.weight"] = shard
    _write_json(root / "model.safetensors.index.json", {"weight_map": weight_map})
    with pytest.raises(CheckpointError, match="not a .safetensors file in the directory") as info:
        inspect_checkpoint(root)
    assert info.value.path == str(root / "model.safetensors.index.json")


def test_wrong_shape_in_a_shard_names_that_shard(tmp_path: Path, sharded_dir: Path) -> None:
    root, weight_map = _copy_sharded(sharded_dir, tmp_path)
    name = "model.embed_tokens.weight"
    shard = root / weight_map[name]
    _rewrite_tensors(shard, lambda t: t.__setitem__(name, torch.zeros(384, 16)))
    needs = r"has shape \(384, 16\) but config.json needs \(384, 32\)"
    with pytest.raises(CheckpointError, match=needs) as info:
        load_checkpoint(root)
    assert info.value.path == str(shard)


def test_checkpoint_error_is_a_picklable_model_load_error(tmp_path: Path) -> None:
    err = CheckpointError(str(tmp_path / "config.json"), "is missing (the model config)")
    assert isinstance(err, ModelLoadError) and isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert (back.path, back.reason) == (err.path, err.reason)
    assert str(back) == f"cannot load model from '{tmp_path / 'config.json'}': is missing (the model config)"


def _sdp_backends() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(),
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


def test_a_cuda_forward_leaves_cudnn_attention_out_and_puts_the_setting_back() -> None:
    before = _sdp_backends()
    assert before["cudnn"], "PyTorch's default has cuDNN attention on; this test checks it is turned off"
    with attention_kernels("cuda:0"):
        assert _sdp_backends() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert _sdp_backends() == before
    with attention_kernels("cpu"):
        assert _sdp_backends() == before  # CPU kernels are PyTorch's own choice
