"""Test doubles shared by the unit tests."""


class FakeClock:
    """An injected clock advanced by hand, in whole seconds (STYLE 2: inject time, never patch it)."""

    def __init__(self, now_s: int = 0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: int = 1) -> None:
        self.now_s += seconds


class FakeSleep:
    """An injected ``asyncio.sleep`` that lets time pass only when the test says so.

    Each call is recorded in ``slept_s`` and parks its task until ``wake()``, which
    first lets tasks that are about to sleep reach their sleep, then releases every
    sleeper and lets the event loop run until they have all parked again or finished.
    No real time passes; a loop that sleeps once a tick moves one tick per ``wake()``.
    """

    # Loop turns after a wake: a woken task needs one to be scheduled and one to run to
    # its next await; the spare ones let short chains of awaits settle too.
    SETTLE_TURNS = 10

    def __init__(self) -> None:
        self.slept_s: list[float] = []
        self._parked: list = []

    async def __call__(self, seconds: float) -> None:
        import asyncio

        self.slept_s.append(seconds)
        parked = asyncio.get_running_loop().create_future()
        self._parked.append(parked)
        await parked

    @property
    def parked(self) -> int:
        """Tasks asleep right now."""
        return sum(not f.done() for f in self._parked)

    async def wake(self) -> None:
        await self.settle()
        parked, self._parked = self._parked, []
        for f in parked:
            if not f.done():
                f.set_result(None)
        await self.settle()

    async def settle(self) -> None:
        """Let every runnable task run until it waits again (no time passes)."""
        import asyncio

        for _ in range(self.SETTLE_TURNS):
            await asyncio.sleep(0)
