"""The progress line each stage of `prepare` prints when it ends, for either engine."""

from typing import Callable


def stage_line(log: Callable[[str], None], engine: str, stage: str, documents: int, seconds: float) -> None:
    """The progress line of a finished stage: its documents and documents/s."""
    log(f"{engine} {stage}: {documents:,} documents in {seconds:.2f} s "
        f"({documents / max(seconds, 1e-9):,.0f} documents/s)")
