"""Test doubles shared by the unit tests."""


class FakeClock:
    """An injected clock advanced by hand, in whole seconds (STYLE 2: inject time, never patch it)."""

    def __init__(self, now_s: int = 0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: int = 1) -> None:
        self.now_s += seconds
