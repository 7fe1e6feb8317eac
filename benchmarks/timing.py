"""The one timing rule every benchmark here uses."""

import time


def best(fn, repeats: int, inner: int = 1) -> float:
    """Best of ``repeats`` of the mean seconds per call over ``inner`` calls: the cost with the least noise from
    whatever else the machine is doing."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return min(times)
