"""Pure parts of ballast.model.server (the replica itself runs in the integration suite; its
loop is tested through its own constructor in test_replica_loop.py)."""


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
