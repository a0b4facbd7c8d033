"""Pure parts of ballast.model.server (the replica itself runs in the integration suite; its
loop is tested through its own constructor in test_replica_loop.py)."""

import pytest


def test_a_cpu_replica_takes_its_configured_torch_threads():
    import torch

    from ballast.config import ModelConfig
    from ballast.model.engine import build_engine

    before = torch.get_num_threads()
    small = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 64}
    try:
        torch.set_num_threads(2)
        build_engine(ModelConfig(device="cpu", architecture=small, cpu_threads=1))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        build_engine(ModelConfig(device="cpu", architecture=small, cpu_threads=None))  # None: torch's own choice
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_replica_leaves_the_kv_cache_to_an_engine_that_schedules_itself():
    from ballast.config import ModelConfig
    from ballast.model.server import scheduler_config
    from ballast.policies.engines import ENGINES

    for backend, row in ENGINES.items():
        m = ModelConfig(backend=backend, path=None if backend == "builtin" else "/models/m", max_batch_size=8)
        budget = scheduler_config(m, 512).kv_budget_tokens
        assert budget == (None if row.self_scheduling else 8 * 512), backend
    assert scheduler_config(ModelConfig(max_batch_size=8, kv_cache_tokens=1000), 512).kv_budget_tokens == 1000


def small_builtin_engine():
    from ballast.model.builtin_checkpoint import BackendSpec, load_backend
    from ballast.model.builtin_decoder import TinyDecoderConfig

    cfg = TinyDecoderConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
    return load_backend(BackendSpec(config=cfg, device="cpu", compile="eager"))


def test_each_engine_names_its_row_and_has_the_faces_the_row_claims():
    # The replica reaches an engine's LoRA, prefix-cache and scheduler faces where the engine
    # table says the engine has them (engine.serving_lora, ...): each class must have them.
    from ballast.model.builtin_engine import TorchDecoderBackend
    from ballast.model.engine import ReportsPrefix, SchedulesItself, ServesLoRA
    from ballast.model.hf_engine import HFBackend
    from ballast.model.vllm_engine import VLLMBackend
    from ballast.policies.engines import ENGINES

    classes = {"builtin": TorchDecoderBackend, "transformers": HFBackend, "vllm": VLLMBackend}
    assert {cls.engine_name: name for name, cls in classes.items()} == {name: name for name in ENGINES}
    faces = {"lora": ServesLoRA, "prefix_events": ReportsPrefix, "self_scheduling": SchedulesItself}
    claimed = {name: {ability for ability in faces if getattr(ENGINES[name], ability)} for name in ENGINES}
    assert claimed == {"builtin": set(), "transformers": set(), "vllm": set(faces)}
    for name, abilities in claimed.items():
        for ability in abilities:
            members = [m for m in vars(faces[ability]) if not m.startswith("_")]
            assert members and all(hasattr(classes[name], m) for m in members), (name, ability)


def test_a_replica_reads_what_its_engine_does_from_the_table_not_from_the_object():
    # A built-in engine that happened to carry vLLM's methods still has none of vLLM's
    # abilities: the replica asks the table (the vLLM engine's side: test_vllm_engine.py).
    from ballast.model.server import ModelServer

    engine = small_builtin_engine()
    for name in ("stats", "prefix_report", "prefix_blocks", "serves_adapter"):
        setattr(engine, name, lambda *a, _name=name: pytest.fail(f"{_name} read off a built-in engine"))
    engine.lora_slots = 4
    server = ModelServer.__new__(ModelServer)  # only the backend is read
    server._backend = engine
    assert server._engine_stats() is None and server._prefix_report(0.0) is None
    assert server._prefix_counts(None) == {}
    assert server._adapter_holdings().slots == 0
    assert server._engine_lost() is None and server._engine_processes() == ()


async def test_a_call_naming_an_adapter_is_refused_by_an_engine_whose_row_serves_no_lora():
    from ballast.errors import EngineRefused
    from ballast.model.protocol import ModelCall
    from ballast.model.replica_loop import ReplicaLoop
    from ballast.model.special_tokens import BYTES_TOKENIZER
    from ballast.policies.scheduler import SchedulerConfig

    engine = small_builtin_engine()
    engine.serves_adapter = lambda name: True  # not asked: the table says no LoRA
    loop = ReplicaLoop(
        engine,
        SchedulerConfig(kv_budget_tokens=512, context_tokens=64),
        chunk_tokens=2,
        batch_limit=4,
        max_deadline_s=60.0,
        max_tokens_limit=63,
    )
    call = ModelCall(prompt="", prompt_ids=(72, 105), tokenizer=BYTES_TOKENIZER, max_tokens=4, adapter="sql")
    try:
        with pytest.raises(EngineRefused, match="adapter 'sql' is not served") as refused:
            await loop.prepare(call)
        assert refused.value.field == "model"
    finally:
        loop.stop()
