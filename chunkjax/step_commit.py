"""A step is all-or-nothing: its commit, the one part of a :class:`chunkjax.ChunkedStep` call that
may not be cut short.

The device chunks' updates (:func:`chunkjax.updaters.device_updater`) donate the input state's
master params, optimizer state and compute params: XLA writes the new values into the same
device buffers, so the state is held on the device once (no second copy the planner would have
to count). Once one of them is dispatched the input state is gone. A step therefore runs
everything that can fail first (the programs, the global norm, the streamed chunks' updates,
which write their results into new pinned host buffers and leave the input state's untouched)
and dispatches the donating updates last, in its *commit* (:meth:`PendingStep.commit`): a loop of
dispatches and the new :class:`~chunkjax.step.TrainState`, with Ctrl-C (``SIGINT``) and
``SIGTERM`` held until it ends (:func:`interrupts_deferred`). An exception before the commit
(with host chunks: before the global norm is known, below) leaves the caller's state as it was
(the streamed pipeline stopped, its threads ended). A signal
held during the commit is delivered as it ends, before a caller's ``state, m = step(state, b)``
has stored the new state: a caller that keeps its state across Ctrl-C (the front door's
:class:`chunkjax.OffloadedStep`) runs ``pending = step.begin(state, b)``, then commits and stores
inside one :func:`interrupts_deferred` block (the commit's own block nests in it). Cost: no bytes
of device or host memory; the device chunks' updates queue on the device behind the streamed
chunks' instead of before them (their few milliseconds no longer overlap the streamed
pipeline's transfers).

An exception (not a signal: those wait for the commit) after the global norm is known, with host
chunks in the step, cannot leave the state as it was: from that moment the host thread updates
host chunks in place with the norm (undoing them would need a copy of every host chunk's state,
12 bytes per AdamW parameter of host memory and traffic every step; the speculation's backups
cover only the chunks updated before the norm), while the device and streamed chunks keep the
input's values. The step then marks its input state (:func:`spoil`) and raises its error; any
later use of that state (the next step, ``step.wait``, ``master_params``, ``eval_loss``, a
checkpoint save, the front door's ``sync`` and ``evaluate``) raises :class:`PartialStepError`,
one line saying to restore the last checkpoint, instead of training on a mixed state. The same
for an error of the device runtime inside the commit itself (its device buffers are donated).
The mark costs nothing per step (an attribute of each host chunk's optimizer state object, shared
by every holder of the state); a restored checkpoint is a new state, unmarked.

Without clipping, skip or loss scaling, host chunks are updated in place by the host thread while
the backward runs (no backup is kept: it would cost 12 bytes per AdamW parameter of host memory and
traffic every step), and storage chunks on the early path send their gradients to their workers,
whose new params land in the state's pinned buffers: the step's hold then starts at the first such
hand-over (:func:`in_place_updates`), so a Ctrl-C completes the step, and any other exception from
then on spoils the state as above. Not covered: streamed chunks updated early whose compute params
live on the device (the old params are donated during the backward: :func:`recover` rebuilds them
from the untouched master params, as the front door does); a step with storage chunks and no host
chunks is not marked by :func:`spoil` (the mark lives on host chunks' optimizer states).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

import jax.numpy as jnp
import numpy as np

#: The signals held during a commit (a Python handler raises them as exceptions: KeyboardInterrupt,
#: or the main job's SIGTERM handler).
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


#: The process's one hold of :data:`HELD_SIGNALS` (main thread only): how many holders are open,
#: the handlers installed before the first, the signals that arrived meanwhile. One count, not a
#: stack of swapped handlers, so that holders may end in any order: a step's hold opened in its
#: engine's ``begin`` ends inside the caller's ``interrupts_deferred`` block, after the commit.
_HOLD = {"depth": 0, "old": {}, "got": []}


def _hold_enter() -> bool:
    """Open one holder of the process's signal hold; False (nothing held) outside the main thread
    or where no Python handler can be installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _HOLD["depth"] == 0:
        old = {}
        try:
            for s in HELD_SIGNALS:
                old[s] = signal.signal(s, lambda signum, frame: _HOLD["got"].append(signum))
        except (ValueError, TypeError):  # not the main interpreter's main thread, or no Python handler to swap
            for s, h in old.items():
                signal.signal(s, h)
            return False
        _HOLD["old"] = old
    _HOLD["depth"] += 1
    return True


def _hold_exit() -> None:
    """Close one holder; the last restores the handlers and delivers the signals that arrived
    (each once, to the handler installed before: KeyboardInterrupt for SIGINT by default). Nothing
    when none is open (a hold released after :func:`release_holds` closed it)."""
    if _HOLD["depth"] <= 0:
        return
    _HOLD["depth"] -= 1
    if _HOLD["depth"] > 0:
        return
    old, got = _HOLD["old"], list(dict.fromkeys(_HOLD["got"]))
    _HOLD["old"], _HOLD["got"] = {}, []
    for s, h in old.items():
        signal.signal(s, h)
    for s in got:
        signal.raise_signal(s)


def open_holds() -> int:
    """How many holders of the process's signal hold are open (0: SIGINT and SIGTERM reach their
    handlers at once). A step's hold opens in its engine's ``begin`` and closes at its commit, so a
    value above 0 between steps means a pending step was dropped uncommitted (its signals stay held)."""
    return int(_HOLD["depth"])


def release_holds() -> int:
    """Close every open holder of the process's signal hold (main thread only) and deliver the
    signals that arrived meanwhile, as the last commit would: for a process that abandons its
    pending steps (a notebook after an error, a test). Returns how many holders were open.

    Raises:
      RuntimeError: called outside the main thread while holders are open."""
    n = open_holds()
    if n and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("release_holds: call it from the main thread (signal handlers are restored there)")
    for _ in range(n):
        _hold_exit()
    return n


@contextlib.contextmanager
def interrupts_deferred():
    """Hold :data:`HELD_SIGNALS` while the block runs and deliver them (each once, to the handler
    that was installed before) when the last open hold ends (this block, or an enclosing one, or a
    :class:`SignalHold` still open). Outside the main thread (where Python runs signal handlers) it
    does nothing: signals reach only the main thread."""
    held = _hold_enter()
    try:
        yield
    finally:
        if held:
            _hold_exit()


class SignalHold:
    """:data:`HELD_SIGNALS` held from :meth:`start` until :meth:`release`, which delivers the ones
    that arrived once no other hold is open (:func:`interrupts_deferred`). A step holds signals from
    the moment its host chunks may take its update in place with no way back to the end of its
    commit (:meth:`PendingStep.commit` releases it, inside the caller's block): with clipping, skip
    or loss scaling once :meth:`chunkjax.speculate.Speculation.set_norm` has the norm
    (:func:`hand_norm`); without them from its first host chunk handed to the host thread, in the
    backward (:func:`in_place_updates`). A Ctrl-C then ends the step as after it, never with host
    chunks updated and device chunks not; any other exception from then on spoils the input state
    (:attr:`in_place`, :func:`spoil`). Outside the main thread it does nothing (signals reach only the main
    thread). Release it once; a second release does nothing."""

    def __init__(self):
        self._open = False
        self.in_place = False  # host chunks may have taken the step in place: a failure spoils the state

    def start(self) -> None:
        """Hold signals from now on (once: a second start while open does nothing); marks the step
        as updating host chunks in place (:attr:`in_place`)."""
        self.in_place = True
        if not self._open:
            self._open = _hold_enter()

    def release(self) -> None:
        """End this hold (delivering what arrived if it was the last one open)."""
        if self._open:
            self._open = False
            _hold_exit()


class PartialStepError(RuntimeError):
    """The state was left half updated by a step that failed after chunks took its update in place
    (host chunks once the global norm was known, or without clipping from the backward on; a
    drop-in optimizer's update midway) and other chunks did not (module docstring). Restore the
    last checkpoint."""


#: The attribute :func:`spoil` sets on a host chunk's optimizer state (``Host*State``,
#: :mod:`chunkjax.kernels`): why the state is unusable (str).
SPOILED_ATTR = "spoiled_by"


def _host_states(host_chunks, state):
    for c in host_chunks:
        o = state.opt_state[c]
        yield from (x for x in (o if isinstance(o, tuple) else (o,)) if x is not None)  # a mesh: one per rank


def spoil(host_chunks, state, error: BaseException) -> None:
    """Mark ``state`` (a :class:`~chunkjax.step.TrainState`) as left half updated by a step that
    raised ``error`` after host chunks ``host_chunks`` may have taken its update in place: the mark
    is on those chunks' optimizer state objects, which every holder of the state shares, so that
    :func:`check_whole` refuses it wherever it is used next; ``error`` gets a note saying so.
    Nothing is marked without host chunks."""
    why = spoiled_by(error)
    marked = False
    for x in _host_states(host_chunks, state):
        setattr(x, SPOILED_ATTR, why)
        marked = True
    if marked and hasattr(error, "add_note"):
        error.add_note("chunkjax: the step failed after its host chunks took its update in place (with clipping: once "
                       "its global norm was known): its other chunks were not updated; the state it was given is now "
                       "refused (PartialStepError): restore the last checkpoint")


def spoiled_by(error: BaseException) -> str:
    """What :func:`spoil` records of ``error``: its type and first line (at most 200 characters)."""
    return (f"{type(error).__name__}: {error}".splitlines() or [type(error).__name__])[0][:200]


def refuse_partial(why: str | None, what: str = "a step failed after its global norm was known") -> None:
    """Raise :class:`PartialStepError` (one line: restore the last checkpoint) when ``why`` (a
    :func:`spoiled_by` record, None: whole) says the state is half updated; ``what`` failed."""
    if why is not None:
        raise PartialStepError(
            f"this training state is half updated: {what} ({why}), so its chunks updated in place took that "
            "step's update and its other chunks did not; restore the last checkpoint (chunkjax.restore_checkpoint) "
            "and continue from there")


def check_whole(host_chunks, state) -> None:
    """Raise :class:`PartialStepError` (one line) when :func:`spoil` marked ``state``; else nothing
    (a look at each host chunk's optimizer state object: no array is read)."""
    for x in _host_states(host_chunks, state):
        refuse_partial(getattr(x, SPOILED_ATTR, None))


@contextlib.contextmanager
def applied_on_interrupt(hold: SignalHold, note: str):
    """Release ``hold`` as the block ends (its held signals delivered then); a KeyboardInterrupt
    raised so, after the hold started (:attr:`SignalHold.in_place`: the update was applied), gets
    ``note`` (e.g. do not repeat the batch)."""
    try:
        try:
            yield
        finally:
            hold.release()
    except KeyboardInterrupt as e:
        if hold.in_place and hasattr(e, "add_note"):
            e.add_note(note)
        raise


def in_place_updates(work, spec, state, on_disk) -> tuple:
    """``(on_host, on_program, hold)`` of one step: ``on_host({c: gradient})`` hands one program's
    host gradients to the host thread (``work``'s :meth:`~chunkjax.host_work.HostWork.hand_over`;
    None without host chunks: ``spec``, the step's :class:`~chunkjax.speculate.Speculation`, is
    None), ``on_program({c: gradient})`` hands its storage gradients to ``on_disk`` (the step's
    :class:`~chunkjax.storage.updater.StorageRun`), and ``hold``, the step's :class:`SignalHold`
    for :func:`hand_norm`. When an update does not wait for the global norm (``spec.certain``: no
    clipping, skip or loss scaling, no backup kept; storage chunks on the early path, whose new
    params land in the state's pinned buffers) the first hand-over starts the hold: from then on a
    Ctrl-C completes the step, and any other exception spoils ``state`` (:func:`hand_norm`)."""
    hold = SignalHold()

    def on_host(mine: dict) -> None:
        if spec.certain:  # the host thread updates these in place now, with no way back
            hold.start()
        work.hand_over(spec.update, state, mine)

    def on_program(grads: dict) -> None:
        if on_disk.sends_early(grads):  # their new params go into the state's buffers
            hold.start()
        on_disk.on_program(grads)
    return (None if spec is None else on_host), on_program, hold


def hand_norm(spec, work, state, stream, on_disk, norm, grad_sq, host_chunks=(), hold=None) -> SignalHold:
    """Hand a step's global norm (() float32, None: the step failed before it was known, called
    while its exception propagates) to what waits for it: the host thread's speculation
    (:mod:`chunkjax.speculate`: validated, or rolled back on None), the streamed pipeline (the
    (n_chunks,) squared norms ``grad_sq``) and the storage workers. Returns ``hold`` (the step's
    :class:`SignalHold` from :func:`in_place_updates`; a new one if None), started just before
    host chunks may take a known norm in place. When handing over fails, or the step failed
    (``norm`` None) after host chunks took its update in place (``hold.in_place``), ``state`` is
    marked by :func:`spoil` for ``host_chunks`` and the hold released."""
    hold = SignalHold() if hold is None else hold
    try:
        if spec is not None:
            if norm is not None:
                hold.start()
            spec.set_norm(norm)
            work.validate(spec.validate, state, ready=spec.known)
        stream.set_grad_sq(None if norm is None else grad_sq)  # None: abandoned
        on_disk.set_norm(norm)
    except BaseException as e:
        if hold.in_place:  # host chunks take the step in place: no way back
            spoil(host_chunks, state, e)
        with contextlib.suppress(Exception):
            stream.set_grad_sq(None)  # the streamed pipeline stopped: no thread left waiting for the norm
        hold.release()
        raise
    if norm is None and hold.in_place:  # the step failed after host chunks took it in place
        spoil(host_chunks, state, sys.exc_info()[1] or RuntimeError("the step failed"))
        hold.release()
    return hold


class PendingStep:
    """One step call run up to its commit (:meth:`chunkjax.ChunkedStep.begin`): the gradients,
    norms, metrics and chunk lists, the streamed chunks' results already in them.

    Args:
      step: the :class:`chunkjax.ChunkedStep`.
      state: its input :class:`~chunkjax.step.TrainState` with the step's host work as ``pending``.
      grads: ``{chunk: gradient}``; ``grad_sq``: (n_chunks,) float32 squared norms; ``inv``: ()
        float32 1 / loss scale.
      lists: ``(params, master, opt_state)`` lists of the new state, device chunks still the input's.
      metrics: the step's metrics (``loss``, ``grad_norm``, ...).
    """

    def __init__(self, step, state, grads: dict, grad_sq, inv, lists: tuple, metrics: dict, hold=None):
        self.step, self.state, self.grads, self.grad_sq, self.inv = step, state, grads, grad_sq, inv
        self.lists, self.metrics, self.hold = lists, metrics, hold  # hold: open until the commit ends

    def commit(self):
        """Dispatch the device chunks' updates (donating the input state's device buffers) with
        :data:`HELD_SIGNALS` held; returns ``(new TrainState, metrics)``. A signal that arrives
        meanwhile is delivered when the commit ends (inside an enclosing
        :func:`interrupts_deferred`: when that ends). Once only.

        Raises:
          RuntimeError: committed already; what the device runtime raises (the input state then
            refused: :func:`spoil`).
        """
        if self.lists is None:
            raise RuntimeError("this step is committed already: call the step again")
        step, grads, (params, master, opt) = self.step, self.grads, self.lists
        with interrupts_deferred():
            try:
                for c in step.device_chunks:
                    params[c], master[c], opt[c] = step.updaters["device"].update(step.placement.param_kinds[c])(
                        grads[c], master[c], opt[c], self.grad_sq, jnp.asarray(c, jnp.int32), params[c], self.inv)
            except BaseException as e:  # the device runtime failed mid-commit: the input state is half donated
                spoil(step.host_chunks, self.state, e)
                raise
            finally:  # held since the host chunks took the norm: delivered as this block (or the caller's) ends
                if self.hold is not None:
                    self.hold.release()
            out = self.state._replace(params=tuple(params), master=tuple(master), opt_state=tuple(opt))
            self.state = self.grads = self.lists = None  # nothing of the step kept alive here
            return out, self.metrics


def recover(step, state):
    """``state`` with every deleted compute-params buffer of a trainable chunk rebuilt from the
    chunk's master params (cast to ``step.compute_dtype`` on the host, placed in its param kind):
    what an early-streamed chunk whose params live on the device leaves when its step fails after
    the update donated them (its master params and optimizer state, in pinned host memory, are
    untouched). The same bits as the params before (the compute params are the master's cast).
    Returns ``state`` itself when nothing was deleted. Memory: each rebuilt buffer takes the
    place of the deleted one (no device bytes beyond the state's), plus one chunk of host memory
    while it is cast.

    Raises:
      ValueError: a deleted buffer that cannot be rebuilt (a frozen chunk's params, or master params
        deleted too): the state is lost, restore a checkpoint.
    """
    def deleted(a) -> bool:
        return getattr(a, "is_deleted", lambda: False)()

    lost = [c for c, p in enumerate(state.params) if deleted(p)]
    if not lost:
        return state
    params, topo = list(state.params), step.topology
    for c in lost:
        m = state.master[c]
        if m is None or deleted(m) or isinstance(m, tuple):
            raise ValueError(f"chunk {c}'s compute params were donated by an interrupted step and cannot be rebuilt "
                             "from its master params: restore the state from a checkpoint")
        host = np.asarray(m, np.float32).astype(step.compute_dtype)
        params[c] = topo.put(host, topo.param_sharding(step.placement.param_kinds[c]))
        del host
    return state._replace(params=tuple(params))
