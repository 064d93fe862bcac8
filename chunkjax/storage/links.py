"""The emulated bandwidth model of the storage tier: link rates and throttled links.

Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664, section "Evaluation") measures storage
devices at 3 GB/s each behind one 16 GB/s shared host link. A :class:`LinkModel` gives such rates
(bytes/s); a :class:`Link` throttles transfers to one rate: each transfer of ``b`` bytes takes at
least ``b / rate`` seconds, transfers on one link are serialised (a link is one resource shared by
whoever uses it). Results from throttled links are an emulation and are labelled
``emulated: True``. No JAX dependency.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Emulated link rates in bytes/s (None: that link is not throttled).

    The paper's setting (Smart-Infinity, section "Evaluation"): storage devices at 3 GB/s each
    behind one 16 GB/s shared host link, i.e. ``LinkModel(shared_bytes_per_s=16e9,
    disk_bytes_per_s=3e9)``; all rates may be scaled down by one factor on a small machine. Any
    result measured with a rate set is an emulation (:attr:`emulated`).

    Attributes:
      shared_bytes_per_s: the shared link (trainer <-> storage workers, or host <-> all storage
        devices in the baseline), one serialised resource.
      disk_bytes_per_s: each storage device's own link (a worker <-> its directory), one per device.
    """

    shared_bytes_per_s: float | None = None
    disk_bytes_per_s: float | None = None

    def __post_init__(self):
        for f in ("shared_bytes_per_s", "disk_bytes_per_s"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise ValueError(f"LinkModel.{f} = {v!r}: must be None or > 0 bytes/s")

    @property
    def emulated(self) -> bool:
        return self.shared_bytes_per_s is not None or self.disk_bytes_per_s is not None


class Link:
    """A link of a given rate (bytes/s) that transfers are serialised on; counts bytes.

    ``with link.transfer(nbytes): <real transfer>`` makes the block last at least until the link,
    serving transfers one after another at ``bytes_per_s``, has carried ``nbytes`` more; with
    ``bytes_per_s=None`` it only counts. Thread-safe; one object per process (a link shared by
    several processes must be throttled in the one process all its traffic passes through).
    """

    def __init__(self, bytes_per_s: float | None = None, name: str = "link"):
        self.bytes_per_s = bytes_per_s
        self.name = name
        self.bytes = 0
        self._free_at = 0.0
        self._lock = threading.Lock()

    def _reserve(self, nbytes: int, t0: float) -> float:
        with self._lock:
            self.bytes += nbytes
            if self.bytes_per_s is None:
                return 0.0
            start = max(t0, self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at

    @contextlib.contextmanager
    def transfer(self, nbytes: int, *others: "Link | None"):
        """Throttle one transfer of ``nbytes`` on this link and on every link in ``others``."""
        t0 = time.monotonic()
        yield
        end = max([lk._reserve(nbytes, t0) for lk in (self, *others) if lk is not None])
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)


