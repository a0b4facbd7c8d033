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
