"""A clock the test moves by hand (``clock.t += 2.0``), for code that takes ``clock=`` (placement,
router state, the prefill queue and local-prefill budget)."""


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
