"""Matrix-product FLOPs of a traced program (the cost model's compute figure: :mod:`chunkjax.cost`
times them at :attr:`chunkjax.cost.Rates.matmul_flops_per_s`)."""
from __future__ import annotations

import math


def _dot_flops(eqn) -> float:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    rhs_free = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
    return 2.0 * math.prod(lhs) * rhs_free


def _conv_flops(eqn) -> float:
    rhs, out = eqn.invars[1].aval.shape, eqn.outvars[0].aval.shape
    o = eqn.params["dimension_numbers"].rhs_spec[0]  # the kernel's output-feature axis
    return 2.0 * math.prod(out) * math.prod(rhs) / rhs[o]


def matmul_flops(jaxpr) -> float:
    """FLOPs of the matrix products (``dot_general``, ``conv_general_dilated``: 2 per
    multiply-add) that a (closed) jaxpr runs once, sub-programs included: a ``scan`` counts its
    body ``length`` times, a ``cond`` its costliest branch, a ``while`` its body once (the trip
    count is not known when tracing). Elementwise work is not counted: the cost model times FLOPs
    at the matmul rate (:attr:`chunkjax.cost.Rates.matmul_flops_per_s`).

    Counted from the traced program, so it is the same on every backend: XLA's cost analysis of
    a lowered program raises ``NotImplementedError`` on the GPU's PJRT plugin (``Lowered.cost_analysis``
    then returns None), which gave the front door 0 FLOPs on the H200 and a predicted step of
    transfers and updates only.
    """
    from jax.extend.core import jaxprs_in_params
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name == "dot_general":
            total += _dot_flops(e)
        elif name == "conv_general_dilated":
            total += _conv_flops(e)
        elif name == "scan":
            total += e.params["length"] * matmul_flops(e.params["jaxpr"])
        elif name == "cond":
            total += max(matmul_flops(b) for b in e.params["branches"])
        elif name == "while":
            total += matmul_flops(e.params["body_jaxpr"])
        else:
            total += sum(matmul_flops(j) for j in jaxprs_in_params(e.params))
    return total
