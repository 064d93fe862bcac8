"""The two forms of a host-updated chunk, and the host bytes each costs (issue 24, item 1).

A chunk updated in place on the host (update location ``host``) keeps its float32 master params
and optimizer state in host memory (12 bytes per parameter for AdamW). Its compute params come
in one of two forms:

* **copy**: a compute-dtype copy in pinned host memory (2 bytes per parameter for bf16), written
  by the host kernel as it updates the master params; a fetch moves that copy (2 bytes per
  parameter up);
* **master-fetch**: no copy. The float32 master params live in pinned host memory themselves
  (a ``jax.Array`` the kernel updates in place through a writable view); a fetch moves them
  (4 bytes per parameter up) and the device casts them to the compute dtype, round to nearest
  even: bit for bit the copy the kernel would have written.

Gradients of host chunks are not model data kept between steps: each leaves its program into
pinned host memory and is dropped as soon as the host kernel consumed it, and the step holds the
next program back until the host thread is done with the one :data:`GRAD_WINDOW_PROGRAMS` - 1
before (:meth:`chunkjax.updaters.HostWork.hand_over`), so at most the host gradients of that many
consecutive programs exist at once (:func:`grad_window_bytes`). Speculated chunks' gradients
are held until the norm is known, within the speculation pool's bound (:mod:`chunkjax.speculate`).

PatrickStar (arXiv 2108.05818, section 4.3) keeps no fp16 param copy of an offloaded chunk either:
it reuses the fp16 param slot for the gradient; here the slot is dropped instead.
"""
from __future__ import annotations

from typing import Sequence

#: Programs whose host-chunk gradients may exist at once: the one the host thread consumes and
#: the one the device produces (:meth:`chunkjax.updaters.HostWork.hand_over`).
GRAD_WINDOW_PROGRAMS = 2


def grad_window_bytes(done_moments: Sequence[int], program_starts: Sequence[int], grad_bytes: int,
                      window: int = GRAD_WINDOW_PROGRAMS) -> int:
    """Host-chunk gradient bytes that exist at once: the most over ``window`` consecutive
    programs of the gradients completed in them.

    Args:
      done_moments: per host-updated chunk, the moment its gradient completes.
      program_starts: the moment each program begins (starts with 0, increasing).
      grad_bytes: one chunk's gradient (bytes; compute dtype).
      window: consecutive programs counted together (>= 1).

    Returns:
      bytes (0 without host chunks).
    """
    starts = list(program_starts)
    per = [0] * len(starts)
    for t in done_moments:
        k = max(i for i, s in enumerate(starts) if s <= t)
        per[k] += grad_bytes
    w = max(1, min(window, len(per)))
    return int(max((sum(per[i:i + w]) for i in range(len(per) - w + 1)), default=0))
