"""The one parser of budget spellings (device and host byte budgets), shared by the front door
(:func:`chunkjax.offload`), the fit path (:func:`chunkjax.fit_step`), the drop-in optimizers
(:class:`chunkjax.ChunkedOptimizer`, :class:`chunkjax.NnxOptimizer`) and the planner CLI
(``experiments/plan.py``'s device budget).

Spellings, the same everywhere:

* a byte count: an int (``2**30``), a float with a whole value (``3.5e6``), or a string: a plain
  or exponent count (``"123456"``, ``"1e9"``) or a size with a unit (``"512MiB"``, ``"24GB"``,
  ``"2GiB"``: :func:`chunkjax.parse_bytes`); positive;
* ``"auto"``: the budget the API finds itself (the front door and the fit path: the smallest
  budget with every chunk offloaded plus a fifth of the model's chunk bytes,
  :func:`chunkjax.fit.auto_budget`);
* ``"min"``: the least budget the API's plan needs (the front door and the planner CLI: the
  same, :func:`chunkjax.fit.min_budget`, the least a run can be given, over the fit path's
  compiled-step headroom; the drop-in optimizers: their plan's least).

An API that cannot give a keyword a meaning (``"auto"`` for a drop-in optimizer, which does not
see the training loop's own device memory; ``"auto"`` for the planner CLI, which plans for a
GPU it does not run on) refuses it in one line naming the spellings it takes.
"""
from __future__ import annotations

import math

#: The keyword spellings (lower case; matched case-insensitively, spaces stripped).
KEYWORDS = ("auto", "min")
#: The largest byte size taken (1 PiB): no accelerator, host or budget of this field is larger, so a
#: bigger number is a typo (an exponent or a unit too many) rather than a budget.
MAX_BYTES = 2**50


def parse_bytes(text: str) -> int:
    """Parse ``"8GiB"``, ``"512MiB"``, ``"24GB"``, ``"1e9"`` or ``"123456"`` into bytes.

    Raises:
      ValueError: unparsable, not positive or above :data:`MAX_BYTES` (one line naming the accepted forms).
    """
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        val = float(num)
    except ValueError:
        val = None
    if val is None or unit not in units or not math.isfinite(val):
        raise ValueError(f"cannot parse {text!r} as a byte size: use e.g. 8GiB, 512MiB, 24GB or a plain byte count")
    if val <= 0:
        raise ValueError(f"a byte size must be positive, got {text!r}: use e.g. 8GiB, 512MiB or 24GB")
    return _at_most_max(int(val * units[unit]), text)


def _at_most_max(n: int, text) -> int:
    if n > MAX_BYTES:
        raise ValueError(f"{text!r} is {n:.3g} bytes, more than the {MAX_BYTES // 2**50} PiB any machine has: "
                         "check the exponent and the unit (e.g. 24GiB, 2.4e10)")
    return n


def spellings(takes) -> str:
    """The spellings an API taking the keywords ``takes`` accepts, for messages."""
    forms = ["bytes (an int, or a whole float such as 3.5e6)", "a size string such as '2GiB' or '1e9'"]
    forms += [repr(k) for k in KEYWORDS if k in takes]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


def parse_budget(budget, *, takes=KEYWORDS, who: str = "device_budget", api: str = "this API") -> int | str:
    """``budget`` in one of the spellings of the module docstring -> bytes (int) or the keyword
    (``"auto"`` / ``"min"``, lower case).

    Args:
      budget: int, float, or str.
      takes: the keywords the calling API gives a meaning (a subset of :data:`KEYWORDS`).
      who: the API's name for the argument, for messages (``"device_budget"``, ``"host_budget"``; a tool passes its flag).
      api: the API, for messages (``"the drop-in optimizer"``).

    Raises:
      ValueError: an unparsable string, a size not positive or above :data:`MAX_BYTES`, or a keyword not in ``takes`` (one
        line naming what the API takes). TypeError: another type (a bool, None, a list...) or a
        float without a whole value.
    """
    if isinstance(budget, str):
        key = budget.strip().lower()
        if key in KEYWORDS:
            if key not in takes:
                raise ValueError(f"{who}={budget!r} is not supported by {api} ({_why(key)}): pass {spellings(takes)}")
            return key
        return parse_bytes(budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"{who} must be {spellings(takes)}; got {type(budget).__name__}")
    if isinstance(budget, float) and not (math.isfinite(budget) and budget == int(budget)):
        raise TypeError(f"{who} must be a whole number of bytes, got {budget!r}: pass {spellings(takes)}")
    if budget <= 0:
        raise ValueError(f"a byte size must be positive, got {budget!r}: use e.g. 8GiB, 512MiB or 24GB")
    return _at_most_max(int(budget), budget)


def _why(key: str) -> str:
    if key == "auto":
        return "'auto' is planned from the whole step's chunks and activations, which it does not see"
    return "'min' is the least that a plan of the whole step needs, which it does not make"
