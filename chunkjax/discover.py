"""Stage discovery: an NNX model and its loss cut into chunkjax stages from one trace (issue 22, item 1).

Technique: the pure loss (``nnx.merge`` of the parameter leaves, the other state and the graph
around the user's ``loss_fn(model, batch)``) is traced once per batch shape to a jaxpr, with each
call of a block marked:

* a **block list** (an ``nnx.List`` or list of modules of one class, the one holding the most
  parameters, or the one named by ``blocks=``): in the traced copy of the model each block's
  class is swapped for a subclass whose ``__call__`` runs the block in a ``jax.jit`` named
  :data:`MARK`, so every call is one equation of the top-level jaxpr;
* a **scanned block** (``nnx.scan`` over layers made with ``nnx.vmap``, stacked parameters): the
  top-level ``scan`` equation whose scanned operands are parameters; its iterations become one
  application of the scan body each, to that layer's slice of the stacked parameters (the layout
  holds per-layer leaves ``<block path>/<layer>/<rest>``; :meth:`Discovery.stack` restacks).

The jaxpr is cut before the first block equation and after each one: every stage evaluates its
slice of equations (``jax.extend.core.jaxpr_as_fun`` of the slice), the values live across a cut
are its activation (a tuple: the residual stream, masks, rotary tables, RNG counters) and its
``param_keys`` are the parameter leaves the slice reads (the params are a flat dict keyed by leaf
path, so every leaf is a top-level key). A part before or after the blocks that reads no
parameter joins its neighbour. Equal slices (the same equations and shapes) share a
``trace_key``, so the tracing pass compiles a block once.

Non-parameter state (``nnx.Rngs`` keys and counts, counters, batch statistics): the leaves the
loss changes enter the step through the batch, tiled over its rows (``(data, state)``; a stage
reads row 0), and their new values leave as the last stage's aux output (``(loss, aux)``); the
leaves it does not change are constants of the stages. Dropout therefore draws the masks the
plain NNX loop draws.

PatrickStar (arXiv 2108.05818) section 4 takes the stage order from module hooks; here it comes
from the traced program.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from chunkjax.dtypes import params_compute_dtype
from chunkjax.flops import matmul_flops
from chunkjax.loss_weight import check_scalar_loss
from chunkjax.stages import Stage

#: Name of the ``jit`` that a marked block call runs in (one top-level equation per call).
MARK = "chunkjax_block"


def path_key(path) -> str:
    """``"a/0/b"`` of a pytree key path of an ``nnx.State`` (the Variable's ``value`` dropped)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def _floating(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def _node_at(root, path: tuple):
    return functools.reduce(lambda node, c: node[c] if isinstance(c, int) else getattr(node, c), path, root)


def _parse_path(blocks) -> tuple:
    if isinstance(blocks, (tuple, list)):
        return tuple(blocks)
    return tuple(int(c) if c.isdigit() else c for c in str(blocks).replace(".", "/").split("/") if c)


def block_lists(model, wrt) -> list[tuple[tuple, int]]:
    """``(path, parameter elements)`` of every list of modules of one class (``nnx.List``, list or
    tuple, two or more) in ``model``, most parameters first."""
    from flax import nnx
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (nnx.List, list, tuple)) and len(node) >= 2 \
                and all(isinstance(m, nnx.Module) for m in node) and len({type(m) for m in node}) == 1:
            n = sum(int(np.size(a)) for m in node for a in jax.tree.leaves(nnx.state(m, wrt)))
            if n:
                out.append((tuple(path), n))
    return sorted(out, key=lambda t: -t[1])


def _marked(cls):
    """A subclass of block class ``cls`` whose call is one ``jit`` equation named :data:`MARK`."""
    from flax import nnx

    def __call__(self, *args, **kwargs):
        gdef, state = nnx.split(self)
        leaves, tdef = jax.tree.flatten((args, kwargs))
        dyn = [i for i, a in enumerate(leaves) if isinstance(a, (jax.Array, np.ndarray))]

        def chunkjax_block(state, vals):
            new_at = dict(zip(dyn, vals))
            a, kw = jax.tree.unflatten(tdef, [new_at.get(i, x) for i, x in enumerate(leaves)])
            m = nnx.merge(gdef, state)
            out = cls.__call__(m, *a, **kw)
            return out, nnx.state(m)

        out, new = jax.jit(chunkjax_block)(state, [leaves[i] for i in dyn])
        nnx.update(self, new)
        return out

    return type(cls.__name__, (cls,), {"__call__": __call__})


def _marks(eqn) -> int:
    """Marked block calls in ``eqn`` (itself or nested)."""
    if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == MARK:
        return 1
    return sum(_marks(e) for j in jcore.jaxprs_in_params(eqn.params) for e in j.eqns)


# ---- the cut program of one batch shape ------------------------------------------------------

@dataclasses.dataclass
class _Op:
    """One evaluation step of a stage: ``fn(*values of ins) -> values of outs`` (keys of the env)."""

    fn: Any
    ins: tuple
    outs: tuple
    key: Any


@dataclasses.dataclass
class _Cut:
    """A traced loss cut into stages (one batch shape)."""

    consts: tuple
    stage_ops: tuple        # per stage: tuple of _Op
    stage_params: tuple     # per stage: param keys read
    live_in: tuple          # per stage: env keys of its input activation
    live_out: tuple         # per stage: env keys of its output activation (the last: the loss key)
    aux: tuple              # env keys of the changed side leaves (aux of the last stage)
    trace_keys: tuple
    names: tuple


def _eqn_group(eqns, role, needed_after):
    """An op evaluating consecutive equations ``eqns`` as one sub-jaxpr."""
    defined, ins = set(), []
    for e in eqns:
        for v in e.invars:
            if not isinstance(v, jcore.Literal) and v not in defined and v not in ins:
                ins.append(v)
        defined.update(v for v in e.outvars if not isinstance(v, jcore.DropVar))
    outs = [v for e in eqns for v in e.outvars if not isinstance(v, jcore.DropVar) and v in needed_after]
    effects = frozenset().union(*(e.effects for e in eqns))
    sub = jcore.ClosedJaxpr(jcore.Jaxpr([], ins, outs, list(eqns), effects), [])
    fn = jcore.jaxpr_as_fun(sub)
    key = ("eqns", tuple(str(e) for e in eqns))
    return _Op(fn, tuple(role(v) for v in ins), tuple(outs), key)


def _scan_layers(eqn, role, per_layer, used):
    """One op per iteration of scan ``eqn`` (its body on that layer's parameters)."""
    p = eqn.params
    if p.get("reverse"):
        raise ValueError("a reversed scan over the blocks is not supported: scan forward or pass blocks=")
    nc, ncar, n = p["num_consts"], p["num_carry"], p["length"]
    body = jcore.jaxpr_as_fun(p["jaxpr"])
    consts, carry0, xs = eqn.invars[:nc], eqn.invars[nc:nc + ncar], eqn.invars[nc + ncar:]
    carry_out, ys = eqn.outvars[:ncar], eqn.outvars[ncar:]
    live_ys = [j for j, v in enumerate(ys) if not isinstance(v, jcore.DropVar) and v in used]
    ops, sid = [], id(eqn)
    for i in range(n):
        cin = [role(v) for v in carry0] if i == 0 else [(sid, i - 1, "c", j) for j in range(ncar)]
        xin = [("param", per_layer[role(v)[1]][i]) if role(v)[0] == "param" else role(v) for v in xs]
        is_p = [role(v)[0] == "param" for v in xs]
        last = i == n - 1
        prev_ys = [(sid, k, "y", j) for j in live_ys for k in range(n - 1)] if last else []

        def fn(*vals, _i=i, _last=last, _is_p=is_p):
            c = vals[:nc + ncar]
            x = [v if ip else jax.lax.index_in_dim(v, _i, keepdims=False)
                 for v, ip in zip(vals[nc + ncar:nc + ncar + len(xs)], _is_p)]
            out = body(*c, *x)
            co, yo = out[:ncar], [out[ncar + j] for j in live_ys]
            if not _last:
                return list(co) + yo
            prev = vals[nc + ncar + len(xs):]
            stacked = [jnp.stack([prev[q * (n - 1) + k] for k in range(n - 1)] + [yo[q]]) for q in range(len(live_ys))]
            return list(co) + stacked

        outs = ([(sid, i, "c", j) for j in range(ncar)] + [(sid, i, "y", j) for j in live_ys]) if not last \
            else list(carry_out) + [ys[j] for j in live_ys]
        ins = tuple([role(v) for v in consts] + cin + xin + prev_ys)
        key = ("layer", str(p["jaxpr"]), tuple(str(v.aval) for v in eqn.invars), i == 0, last)
        ops.append(_Op(fn, ins, tuple(outs), key))
    return ops


def _cut(closed, roles: dict, block_eqns, scan_eqn, per_layer, mutable: tuple) -> _Cut:
    """Cut ``closed`` (outputs: loss, then every side leaf) at its block equations."""
    jaxpr = closed.jaxpr

    def role(v):  # a literal (a constant carry such as jnp.zeros(()) into a scan) stands for itself
        return v if isinstance(v, jcore.Literal) else roles.get(v, v)

    used = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jcore.Literal)}
    used |= {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    # items: (op builder, is block)
    items = []
    for k, e in enumerate(jaxpr.eqns):
        if k == scan_eqn:
            items += [("layer", op) for op in _scan_layers(e, role, per_layer, used)]
        else:
            items.append(("block" if k in block_eqns else "eqn", e))
    blocks = [i for i, (kind, _) in enumerate(items) if kind in ("block", "layer")]
    bounds = [0] + blocks[:1] + [b + 1 for b in blocks] + [len(items)]  # before the first block, after each
    groups = [items[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    outs = [jaxpr.outvars[0]] + [jaxpr.outvars[1 + j] for j in mutable]
    out_keys = [role(v) for v in outs]

    def reads(it):
        if it[0] == "layer":
            return [k for k in it[1].ins if not isinstance(k, jcore.Literal)]
        return [role(v) for v in it[1].invars if not isinstance(v, jcore.Literal)]

    def writes(it):
        if it[0] == "layer":
            return list(it[1].outs)
        return [v for v in it[1].outvars if not isinstance(v, jcore.DropVar)]

    def params_of(group):
        ps = []
        for it in group:
            for r in reads(it):
                if isinstance(r, tuple) and r and r[0] == "param" and r[1] not in ps:
                    ps.append(r[1])
        return ps

    # a part reading no parameter joins its neighbour (the next one; the last joins the previous)
    merged = []
    for g in groups:
        if merged and not params_of(merged[-1]):
            merged[-1] = merged[-1] + g
        else:
            merged.append(g)
    if len(merged) > 1 and not params_of(merged[-1]):
        merged[-2:] = [merged[-2] + merged[-1]]
    if not params_of(merged[0]):
        raise ValueError("the loss reads no parameter: check wrt= (the parameters' nnx filter)")
    n = len(merged)
    written = [[w for it in g for w in writes(it)] for g in merged]
    read_by = [{r for it in g for r in reads(it)} for g in merged]
    live = []
    for s in range(n - 1):
        later = set().union(*read_by[s + 1:]) | {k for k in out_keys if not isinstance(k, jcore.Literal)}
        earlier = [w for g in written[:s + 1] for w in g]
        live.append(tuple(dict.fromkeys(w for w in earlier if w in later)))
    live_in = ((),) + tuple(live)
    live_out = tuple(live) + ((),)
    stage_ops = []
    for s, g in enumerate(merged):
        need_after = set(live_out[s]) | (set(outs) if s == n - 1 else set())
        ops, run = [], []
        for k, it in enumerate(g + [("end", None)]):
            if it[0] == "eqn" or it[0] == "block":
                run.append(it[1])
                continue
            if run:
                later_reads = {r for j in g[k:] if j[0] != "end" for r in reads(j)}
                ops.append(_eqn_group(run, role, later_reads | need_after))
                run = []
            if it[0] == "layer":
                ops.append(it[1])
        stage_ops.append(tuple(ops))
    trace_keys = tuple(hash((tuple((op.key, len(op.ins), len(op.outs)) for op in ops), len(live_in[s]),
                             len(live_out[s]))) for s, ops in enumerate(stage_ops))
    nb = [sum(it[0] in ("block", "layer") for it in g) for g in merged]
    names = tuple(f"block_{sum(nb[:s])}" if nb[s] else ("pre" if s == 0 else "post") for s in range(n))
    return _Cut(tuple(closed.consts), tuple(stage_ops), tuple(tuple(params_of(g)) for g in merged), live_in,
                live_out[:-1] + ((outs[0],),), tuple(out_keys[1:]), trace_keys, names)


# ---- discovery ---------------------------------------------------------------------------------

def _find_scan(jaxpr, roles, keys=None):
    """Index of the top-level scan whose scanned operands hold the most parameter elements
    (only params in ``keys`` when given), or None."""
    best = None
    for k, e in enumerate(jaxpr.eqns):
        if e.primitive.name != "scan":
            continue
        xs = e.invars[e.params["num_consts"] + e.params["num_carry"]:]
        ps = [v for v in xs if roles.get(v, ("",))[0] == "param" and (keys is None or roles[v][1] in keys)]
        n = sum(math.prod(v.aval.shape) for v in ps)
        if n and (best is None or n > best[0]):
            best = (n, k)
    return None if best is None else best[1]


def _layer_keys(keys: list[str], n: int) -> dict:
    """Per-layer keys of stacked leaves: ``<common prefix>/<layer>/<rest>``."""
    parts = [k.split("/") for k in keys]
    pre = 0
    while all(len(p) > pre + 1 for p in parts) and len({p[pre] for p in parts}) == 1:
        pre += 1
    return {k: tuple("/".join(p[:pre] + [str(i)] + p[pre:]) for i in range(n)) for k, p in zip(keys, parts)}


def _roles(jaxpr, param_keys, n_side: int) -> dict:
    n_p = len(param_keys)
    roles = {v: ("param", k) for v, k in zip(jaxpr.invars[:n_p], param_keys)}
    roles.update({v: ("side", j) for j, v in enumerate(jaxpr.invars[n_p:n_p + n_side])})
    roles.update({v: ("data", j) for j, v in enumerate(jaxpr.invars[n_p + n_side:])})
    roles.update({v: ("const", j) for j, v in enumerate(jaxpr.constvars)})
    return roles


@dataclasses.dataclass(frozen=True, eq=False)
class Discovery:
    """An NNX model's loss as chunkjax stages (see the module docstring); from :func:`discover`.

    Attributes:
      graphdef: ``nnx.split``'s graph of the model.
      wrt: the nnx filter of the chunked leaves.
      param_treedef, param_keys, param_avals: the ``wrt`` state's pytree structure, its leaves'
        paths (``"a/0/b"``, leaf order) and ``ShapeDtypeStruct`` s (stacked for scanned leaves).
      side_treedef, side_keys, side_values: the rest of the model's state (leaf order) and its
        values at discovery (the stages' constants).
      mutable: indices of the side leaves the loss changes (they travel in the batch).
      per_layer: stacked key -> its per-layer keys (a scanned block; else empty).
      blocks: the path of the block list or scanned block (``()``: none: one stage).
      mode: ``"list"``, ``"scan"`` or ``"none"``.
      loss_fn: the user's ``loss_fn(model, data)``.
      compute_dtype: dtype of floating params in the traced program.
      example: the example data (``ShapeDtypeStruct`` s) the stages were cut for.
      forward_flops: matrix-product FLOPs of one forward on ``example`` (:func:`chunkjax.flops.matmul_flops`).
    """

    graphdef: Any
    wrt: Any
    param_treedef: Any
    param_keys: tuple
    param_avals: dict
    side_treedef: Any
    side_keys: tuple
    side_values: tuple
    mutable: tuple
    per_layer: dict
    blocks: tuple
    mode: str
    loss_fn: Any
    compute_dtype: Any
    example: Any
    forward_flops: float = 0.0

    @functools.cached_property
    def _cuts(self) -> dict:
        return {}

    @functools.cached_property
    def stages(self) -> tuple:
        """The :class:`~chunkjax.Stage` s, ``apply(params_sub, x, (data, state))`` each."""
        cut = self.cut(self.example)
        return tuple(Stage(cut.names[s], tuple(keys), _StageFn(self, s, cut.trace_keys[s]))
                     for s, keys in enumerate(cut.stage_params))

    # ---- flat params ---------------------------------------------------------------------------
    def layout_params(self, param_leaves) -> dict:
        """The step's params dict of ``ShapeDtypeStruct`` s (per-layer leaves for a scanned block)
        from the ``wrt`` state's leaves (anything with a shape and dtype, leaf order)."""
        out = {}
        for k, a in zip(self.param_keys, param_leaves):
            shape = tuple(np.shape(a))[1:] if k in self.per_layer else np.shape(a)
            out.update((kk, jax.ShapeDtypeStruct(shape, a.dtype)) for kk in self.per_layer.get(k, (k,)))
        return out

    def stack(self, flat: dict) -> list:
        """Inverse of :meth:`layout_params`: the ``wrt`` leaves (leaf order, their own dtypes)."""
        out = []
        for k in self.param_keys:
            a = jnp.stack([jnp.asarray(flat[kk]) for kk in self.per_layer[k]]) if k in self.per_layer else flat[k]
            out.append(jnp.asarray(a).astype(self.param_avals[k].dtype))
        return out

    def _leaf_aval(self, key: str):
        if key in self.param_avals:
            return self.param_avals[key]
        stacked = next(k for k, ks in self.per_layer.items() if key in ks)
        return jax.ShapeDtypeStruct(self.param_avals[stacked].shape[1:], self.param_avals[stacked].dtype)

    def check_model(self, model) -> None:
        """ValueError (one line, the first differing leaf) unless ``model``'s ``wrt`` leaves have
        this discovery's paths, shapes and dtypes."""
        from flax import nnx
        flat = jax.tree_util.tree_flatten_with_path(nnx.split(model, self.wrt, ...)[1])[0]
        have = {path_key(p): a for p, a in flat}
        for k in self.param_keys:
            want = self.param_avals[k]
            if k not in have:
                raise ValueError(f"the model lacks parameter {k!r} ({want.shape} {want.dtype}) that the step holds: "
                                 "sync into a model built like the offloaded one")
            a = have[k]
            if tuple(np.shape(a)) != tuple(want.shape) or jnp.dtype(a.dtype) != jnp.dtype(want.dtype):
                raise ValueError(f"the model's parameter {k!r} is {tuple(np.shape(a))} {a.dtype}, the step's is "
                                 f"{tuple(want.shape)} {want.dtype}: sync into a model built like the offloaded one")
        extra = [k for k in have if k not in self.param_avals]
        if extra:
            raise ValueError(f"the model has parameter {extra[0]!r} that the step lacks: sync into a model built "
                             "like the offloaded one")

    # ---- the traced program ----------------------------------------------------------------------
    def pure(self, mark: bool):
        """``(param leaves, side leaves, data) -> (loss, new side leaves)``: the loss as a pure
        function; ``mark``: block calls marked (a block list)."""
        from flax import nnx

        def pure(pvals, svals, data):
            model = nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, pvals),
                              jax.tree.unflatten(self.side_treedef, svals))
            marked = mark and self.mode == "list"
            if marked:
                for blk in _node_at(model, self.blocks):
                    blk.__class__ = _marked(type(blk))
            loss = self.loss_fn(model, data)
            if marked:
                for blk in _node_at(model, self.blocks):
                    blk.__class__ = type(blk).__mro__[1]
            return loss, jax.tree.leaves(nnx.split(model, self.wrt, ...)[2])
        return pure

    def abstract_inputs(self, data):
        """Abstract ``(param leaves in the compute dtype, side leaves, data)`` of :meth:`pure`."""
        cd = self.compute_dtype
        pv = [jax.ShapeDtypeStruct(a.shape, cd if _floating(a) else a.dtype)
              for a in (self.param_avals[k] for k in self.param_keys)]
        sv = [jax.ShapeDtypeStruct(np.shape(v), v.dtype) for v in self.side_values]
        return pv, sv, jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), data)

    def cut(self, data) -> _Cut:
        """The stages' program for a batch like ``data`` (traced once per shape)."""
        key = (jax.tree.structure(data), tuple((np.shape(a), str(a.dtype)) for a in jax.tree.leaves(data)))
        if key in self._cuts:
            return self._cuts[key]
        closed = jax.make_jaxpr(self.pure(True))(*self.abstract_inputs(data))
        jaxpr = closed.jaxpr
        roles = _roles(jaxpr, self.param_keys, len(self.side_keys))
        block_eqns, scan_eqn, where = set(), None, "/".join(map(str, self.blocks))
        if self.mode == "list":
            counts = [_marks(e) for e in jaxpr.eqns]
            if any(c > 1 for c in counts):
                raise ValueError(f"the calls of the blocks {where!r} run inside one jit/remat/scan equation: call each "
                                 "block at the top level of the loss (pass loss_fn, not nnx.jit(loss_fn): the step compiles it)")
            block_eqns = {k for k, c in enumerate(counts) if c}
            if not block_eqns:
                raise ValueError(f"the loss never calls the blocks {where!r} (block(x)): pass blocks= naming the "
                                 "block list the model runs")
        elif self.mode == "scan":
            scan_eqn = _find_scan(jaxpr, roles, self.per_layer)
            stacked = {v for v in jaxpr.invars if roles[v][0] == "param" and roles[v][1] in self.per_layer}
            for k, e in enumerate(jaxpr.eqns):
                if k != scan_eqn and stacked & {v for v in e.invars if not isinstance(v, jcore.Literal)}:
                    raise ValueError(f"a stacked parameter of the scanned blocks {where!r} is read outside their "
                                     f"scan ({e.primitive.name}): read it inside the scanned block")
        cut = _cut(closed, roles, block_eqns, scan_eqn, self.per_layer, self.mutable)
        if self._cuts and [set(p) for p in next(iter(self._cuts.values())).stage_params] != \
                [set(p) for p in cut.stage_params]:
            raise ValueError("the loss reads other parameters per stage for this batch shape than for the planned one")
        self._cuts[key] = cut
        return cut

    def run_stage(self, s: int, params_sub: dict, x, batch):
        """Stage ``s``: its slice of the traced loss on ``params_sub``, the activation ``x`` and the
        step's batch ``(data, state)`` (``state``: the changed side leaves tiled over the rows).
        Returns the next activation (a tuple), or for the last stage the loss, or ``(loss, new
        changed side leaves)`` when the loss changes any."""
        data, state = batch
        cut = self.cut(data)
        env = {}
        for k in cut.stage_params[s]:
            a = self._leaf_aval(k)
            env[("param", k)] = jnp.asarray(params_sub[k]).astype(self.compute_dtype if _floating(a) else a.dtype)
        env.update({("data", j): v for j, v in enumerate(jax.tree.leaves(data))})
        live = dict(zip(self.mutable, state))
        env.update({("side", j): (live[j][0] if j in live else v) for j, v in enumerate(self.side_values)})
        env.update({("const", j): v for j, v in enumerate(cut.consts)})
        if x is not None:
            env.update(zip(cut.live_in[s], x))

        def read(k):
            return k.val if isinstance(k, jcore.Literal) else env[k]

        for op in cut.stage_ops[s]:
            env.update(zip(op.outs, op.fn(*map(read, op.ins))))
        if s < len(cut.stage_ops) - 1:
            return tuple(env[k] for k in cut.live_out[s])
        loss = read(cut.live_out[s][0])
        return (loss, tuple(map(read, cut.aux))) if self.mutable else loss


class _StageFn:
    """A discovered stage's ``apply``; ``trace_key`` is equal for stages that trace alike (the
    tracing pass compiles one of them, :mod:`chunkjax.trace`)."""

    def __init__(self, discovery: Discovery, s: int, trace_key):
        self.discovery, self.s, self.trace_key = discovery, s, trace_key

    def __call__(self, params_sub, x, batch):
        return self.discovery.run_stage(self.s, params_sub, x, batch)


def discover(model, loss_fn, data, *, wrt=None, blocks=None, compute_dtype=None) -> Discovery:
    """Cut ``loss_fn(model, data)`` into stages (see the module docstring).

    Args:
      model: an ``nnx.Module``.
      loss_fn: ``loss_fn(model, data) -> () float``, the loss.
      data: an example batch (arrays or ``ShapeDtypeStruct`` s, any pytree), the planned shape.
      wrt: the nnx filter of the chunked leaves (default ``nnx.Param``).
      blocks: the attribute path of the block list or scanned block (``"decoder/layers"``) when
        the automatic choice (the list of modules of one class with the most parameters, else the
        scan over the most stacked parameters) is not the right one.
      compute_dtype: dtype of floating params in the traced program (default: theirs).

    Returns:
      a :class:`Discovery` (its ``stages`` for :func:`chunkjax.fit_step`).

    Raises:
      ValueError: two block lists hold equally many parameters (name one with ``blocks=``), a
        ``blocks`` path the model lacks or that is neither a list of modules nor scanned, block
        calls inside one jit/scan, a loss that is not a scalar or reads no parameter (one line
        each).
    """
    from flax import nnx
    wrt = nnx.Param if wrt is None else wrt
    graphdef, pstate, side = nnx.split(model, wrt, ...)
    pflat, ptd = jax.tree_util.tree_flatten_with_path(pstate)
    sflat, std = jax.tree_util.tree_flatten_with_path(side)
    pkeys = tuple(path_key(p) for p, _ in pflat)
    pavals = {k: jax.ShapeDtypeStruct(np.shape(a), a.dtype) for k, (_, a) in zip(pkeys, pflat)}
    if compute_dtype is None:  # the params' one floating dtype; several: one line on what each choice trains
        compute_dtype = params_compute_dtype(pavals)
    mode, path = "none", ()
    lists = block_lists(model, wrt)
    if blocks is not None:
        path = _parse_path(blocks)
        try:
            node = _node_at(model, path)
        except (AttributeError, IndexError, KeyError, TypeError):
            raise ValueError(f"blocks={blocks!r}: the model has no attribute path "
                             f"{'/'.join(map(str, path))!r}") from None
        mode = "list" if isinstance(node, (nnx.List, list, tuple)) else "scan"
    elif lists:
        path = lists[0][0]
    if path and isinstance(_node_at(model, path), (seqs := (nnx.List, list, tuple))) and any(
            isinstance(n, seqs) for n in (_node_at(model, path[:-1]), *_node_at(model, path))):
        raise ValueError(f"the block list {'/'.join(map(str, path))!r} holds lists or is held in one (nested block "
                         "lists): hold the blocks in one flat nnx.List")
    if blocks is None and lists:
        if len(lists) > 1 and lists[0][1] == lists[1][1]:
            names = ["/".join(map(str, p)) for p, _ in lists[:2]]
            raise ValueError(f"block lists {names} hold equally many parameters: name the blocks, "
                             f"e.g. blocks={names[0]!r}")
        mode = "list"
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.dtypes.canonicalize_dtype(a.dtype)), data)
    d = Discovery(graphdef, wrt, ptd, pkeys, pavals, std, tuple(path_key(p) for p, _ in sflat),
                  tuple(a for _, a in sflat), (), {}, path, mode, loss_fn, jnp.dtype(compute_dtype), abstract)
    closed, (loss, _) = jax.make_jaxpr(d.pure(False), return_shape=True)(*d.abstract_inputs(abstract))
    if not isinstance(loss, jax.ShapeDtypeStruct):  # e.g. a chunkjax.WeightedLoss (chunkjax.loss_weight)
        raise ValueError(f"loss_fn returns a {type(loss).__name__}: return the scalar loss here (a WeightedLoss "
                         "trains through chunkjax.fit_step with stages, not yet through the front door)")
    n_p, n_s = len(pkeys), len(sflat)
    ins, outs = closed.jaxpr.invars, closed.jaxpr.outvars
    check_scalar_loss(outs[0].aval, "loss_fn", "return the scalar loss (e.g. the batch mean)")
    mutable = tuple(j for j in range(n_s) if outs[1 + j] is not ins[n_p + j])
    per_layer = {}
    if mode in ("scan", "none"):
        roles = _roles(closed.jaxpr, pkeys, n_s)
        pre = "/".join(map(str, path))
        keys = None if mode == "none" else [k for k in pkeys if k == pre or k.startswith(pre + "/")]
        k = _find_scan(closed.jaxpr, roles, keys)
        if k is None and mode == "scan":
            raise ValueError(f"blocks={blocks!r} is neither a list of modules nor a block the loss scans over: "
                             "hold the blocks in an nnx.List (or scan over one stacked block)")
        if k is not None:
            e = closed.jaxpr.eqns[k]
            xs = e.invars[e.params["num_consts"] + e.params["num_carry"]:]
            stacked = [roles[v][1] for v in xs
                       if roles.get(v, ("",))[0] == "param" and (keys is None or roles[v][1] in keys)]
            per_layer = _layer_keys(stacked, e.params["length"])
            if not path:
                parts = per_layer[stacked[0]][0].split("/")
                path = tuple(parts[:parts.index("0")])
            mode = "scan"
    if mode == "none":
        warnings.warn("found no block list: the model is one stage, so every parameter is fetched at once; hold "
                      "the blocks in an nnx.List (or a list), or scan over one stacked block", stacklevel=2)
    return dataclasses.replace(d, mutable=mutable, per_layer=per_layer, blocks=path, mode=mode,
                               forward_flops=matmul_flops(closed))
