"""Progress of long work on stderr: done / total, the rate and the time left, on one line.

    progress = Progress("prefill", total=8192, unit="tokens")
    progress.update(1024)   # -> "prefill  1,024/8,192 tokens  12.5%  210 tokens/s  ETA 33s"
    progress.close()        # or progress.update(8192): reaching the total ends the line too

It stays silent during the first `delay` seconds (short work prints nothing) and whenever the
stream is not a terminal, unless `enabled=True` (tests, logs).
"""
import sys
import time


class Progress:
    def __init__(self, what: str, total: float, unit: str = "tokens", enabled: bool | None = None,
                 stream=None, delay: float = 1.0, every: float = 0.5):
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled if enabled is not None else _is_terminal(self.stream)
        self.delay, self.every = delay, every
        self.start = self.last = time.perf_counter()
        self.shown = False

    def line(self, done: float, elapsed: float) -> str:
        rate = done / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else float("inf")
        return (f"{self.what}  {done:,.0f}/{self.total:,.0f} {self.unit}  {done / self.total:6.1%}  "
                f"{rate:,.1f} {self.unit}/s  ETA {_duration(left)}")

    def update(self, done: float) -> None:
        """Show `done` (after `delay`, at most every `every` seconds); reaching the total ends the line."""
        now = time.perf_counter()
        if self.enabled and now - self.start >= self.delay and not (self.shown and now - self.last < self.every):
            self.stream.write("\r" + self.line(done, now - self.start) + "\033[K")
            self.stream.flush()
            self.last, self.shown = now, True
        if done >= self.total:
            self.close()

    def close(self) -> None:
        """End the line (if one was shown), leaving the final count on screen."""
        if self.shown:
            self.stream.write("\r" + self.line(self.total, time.perf_counter() - self.start) + "\033[K\n")
            self.stream.flush()
            self.shown = False


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    """12 -> '12s', 200 -> '3m20s', 7300 -> '2h01m'; inf -> '?'."""
    if seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
