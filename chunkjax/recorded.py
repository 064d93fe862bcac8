"""What a recorded GPU run measured, read back for the cost model: the rates its work ran at while
competing (not each alone) and the drop-in update it timed, so that a prediction with those rates
can be checked against the run's measured seconds (issue 23 item 1; ``docs/dropin.md``, "Rates
under contention").

The records are the results JSON of ``experiments/gpu_checks/dropin.py`` (a drop-in system: its
``split``, ``breakdown_median`` and one steady update's ``timeline`` of ``[kind, chunk, bytes,
start_s, end_s]`` events, :class:`chunkjax.duplex.Event`) and of ``experiments/bench.py`` (the
``chunkjax`` system: ``extra.rates``, ``extra.schedule_counts``, ``extra.chunk_size``, ``update_s``).
Pure arithmetic on the parsed JSON; :meth:`chunkjax.cost.Rates.from_record` builds the rates.
"""
from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

UP_KINDS, DOWN_KINDS = ("fetch", "params"), ("grads", "store")  # as chunkjax.duplex


def _load(record) -> dict:
    return record if isinstance(record, dict) else json.loads(pathlib.Path(record).read_text())


def _busy(spans) -> float:
    """Seconds covered by the union of ``(start, end)`` spans."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy


def recorded_rates(record, system: str | None, fields) -> dict:
    """The :class:`chunkjax.cost.Rates` fields a recorded run measured.

    From a drop-in system: ``h2d_bytes_per_s`` / ``d2h_bytes_per_s``, the bytes of each
    direction's transfers issued after the gradients existed (the end of ``ready``) over the seconds
    that direction was busy with them (both directions ran at once), ``duplex_bytes_per_s`` their
    sum, and ``host_update_s_per_param``, the kernel's seconds inside the update per host-updated
    param. From a bench system: the rates it calibrated (``extra.rates``) with
    ``host_update_s_per_param`` its host thread's update seconds in the step (``update_s``) over
    its host-updated params (``extra.schedule_counts`` x ``extra.chunk_size``) where recorded (then
    without the start-up ``host_update_loaded_s_per_param``: the step is timed at the rate it ran at,
    :func:`chunkjax.host_contention.step_host_s_per_param`).

    Args:
      record: a results JSON (path, or the parsed dict).
      system: its system (None: the first ``chunk_host*`` with a timeline, else ``"chunkjax"``).
      fields: the names :class:`chunkjax.cost.Rates` takes (others in ``extra.rates`` are dropped).

    Raises:
      ValueError: no such system, or nothing to read from it.
    """
    systems = _load(record).get("systems") or {}
    name = system or next((k for k in systems if k.startswith("chunk_host") and "timeline" in systems[k]),
                          "chunkjax")
    s = systems.get(name)
    if not isinstance(s, dict):
        raise ValueError(f"the record has no system {name!r} (it has {sorted(systems)}): pass system= one of them")
    if "timeline" in s:
        ev, split = s["timeline"], s["split"]
        ready = max((e[4] for e in ev if e[0] == "ready"), default=0.0)
        rate = {}
        for key, kinds in (("h2d", UP_KINDS), ("d2h", DOWN_KINDS)):
            mine = [e for e in ev if e[0] in kinds and e[3] >= ready]
            busy = _busy((e[3], e[4]) for e in mine)
            if busy <= 0:
                raise ValueError(f"system {name!r} moved nothing {key} after its gradients existed: "
                                 "record an update with streamed or host chunks")
            rate[key] = sum(e[2] for e in mine) / busy
        out = dict(h2d_bytes_per_s=rate["h2d"], d2h_bytes_per_s=rate["d2h"],
                   duplex_bytes_per_s=rate["h2d"] + rate["d2h"])
        kernel_s, n_host = (s.get("breakdown_median") or {}).get("kernel_s"), split["host"] * split["chunk_size"]
        if kernel_s and n_host:
            out["host_update_s_per_param"] = kernel_s / n_host
        return out
    extra = s.get("extra") or {}
    if not extra.get("rates"):
        raise ValueError(f"system {name!r} records no rates (extra.rates) and no timeline: pass a record of "
                         "experiments/bench.py or experiments/gpu_checks/dropin.py")
    out = {k: float(v) for k, v in extra["rates"].items() if k in fields}
    n_host = sum(n for k, n in (extra.get("schedule_counts") or {}).items() if k.endswith("update_host"))
    if s.get("update_s") and n_host and extra.get("chunk_size"):
        out["host_update_s_per_param"] = s["update_s"] / (n_host * extra["chunk_size"])
        out.pop("host_update_loaded_s_per_param", None)  # the in-step rate is the loaded one: time the step at it
    return out


class RecordedUpdate(NamedTuple):
    """A GPU run's drop-in update as ``experiments/gpu_checks/dropin.py`` records it
    (:func:`recorded_update`): the arguments of :func:`chunkjax.dropin.predict_update_parts` and
    :func:`chunkjax.dropin.split_offloaded`, and the measured seconds they predict.

    Attributes:
      n_offloaded, n_host, depth, chunk_size: the split (``n_offloaded - n_host`` streamed).
      state_bytes, grad_bytes, param_bytes: per chunk, the bytes its timeline moved (a streamed
        chunk's fetch, plus its float32 master where the run's streamed chunks were lean, i.e.
        moved their optimizer state only; a host chunk's gradient and params, averaged over the
        host chunks).
      measured_s: the median ``update_s`` of the steady updates (:class:`chunkjax.duplex.UpdateBreakdown`).
      streamed_bytes: a streamed chunk's fetch where it differs from ``state_bytes`` (lean), else None.
    """

    n_offloaded: int
    n_host: int
    depth: int
    chunk_size: int
    state_bytes: float
    grad_bytes: float
    param_bytes: float
    measured_s: float
    streamed_bytes: float | None = None


def recorded_update(system: dict) -> RecordedUpdate:
    """The :class:`RecordedUpdate` of one drop-in system of a results JSON (its ``split``,
    ``timeline`` of ``[kind, chunk, bytes, start_s, end_s]`` and ``breakdown_median``).

    Raises:
      ValueError: the system has no split, timeline or measured update (a failed run).
    """
    if not all(k in system for k in ("split", "timeline", "breakdown_median")):
        raise ValueError("the system records no split/timeline/breakdown_median: pass a chunk_host system of "
                         "experiments/gpu_checks/dropin.py that ran")
    sp, ev = system["split"], system["timeline"]
    nb = lambda kind: [e[2] for e in ev if e[0] == kind]  # noqa: E731
    n_host, fetches = sp["host"], nb("fetch")
    fetch = max(fetches) if fetches else 0.0
    lean = bool(sp.get("lean"))  # (float32) streamed chunks moving their state only: the master is 4 B/param more
    return RecordedUpdate(sp["streamed"] + n_host, n_host, sp["depth"], sp["chunk_size"],
                          fetch + 4 * sp["chunk_size"] if lean else fetch, sum(nb("grads")) / max(1, n_host),
                          sum(nb("params")) / max(1, n_host), system["breakdown_median"]["update_s"],
                          fetch if lean else None)
