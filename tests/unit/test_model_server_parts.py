"""Pure parts of serve_app.model.server (the replica itself runs in the integration suite)."""

from policies.window import CountWindow
from serve_app.model.server import WAIT_WINDOW_S, WINDOW, recent_percentile


def stamped(samples: list[tuple[float, float]]) -> CountWindow[float]:
    """A replica's wait window holding (stamp, value) samples, oldest first."""
    window: CountWindow[float] = CountWindow(WINDOW)
    for at_s, value in samples:
        window.add(value, at_s)
    return window


def test_queue_wait_p95_forgets_waits_older_than_the_window():
    # A burst of 5 s waits, then nothing admitted (level 4 sheds all): the burst must age
    # out, or the replica keeps reporting it and holds the level up by itself.
    waits = stamped([(float(t), 5000.0) for t in range(20)])
    assert recent_percentile(waits, 20.0, WAIT_WINDOW_S, 0.95) == 5000.0
    assert recent_percentile(waits, 20.0 + WAIT_WINDOW_S + 0.5, WAIT_WINDOW_S, 0.95) is None
    assert len(waits) == 0  # dropped, not just skipped


def test_queue_wait_p95_of_recent_samples():
    waits = stamped([(100.0 + i * 0.01, float(i)) for i in range(100)])
    assert recent_percentile(waits, 101.0, WAIT_WINDOW_S, 0.95) == 95.0
    assert recent_percentile(stamped([]), 0.0, WAIT_WINDOW_S, 0.95) is None


def test_a_cpu_replica_takes_its_configured_torch_threads():
    import torch

    from serve_app.config import ModelConfig
    from serve_app.model.server import build_backend

    before = torch.get_num_threads()
    small = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 64}
    try:
        torch.set_num_threads(2)
        build_backend(ModelConfig(device="cpu", architecture=small, cpu_threads=1))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        build_backend(ModelConfig(device="cpu", architecture=small, cpu_threads=None))  # None: torch's own choice
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
