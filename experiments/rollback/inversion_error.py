"""Rollback by inversion against optax: the largest errors over 20 steps (CPU, float32).

Drives chunkjax.speculate.Speculation as tests/test_rollback.py does (every chunk speculated
before the norm) and prints, per case, the largest error of the master params (relative to
max(|p|, 1e-2)), of m (in units of max|m|) and of v (relative) against eager optax, with
rollback by inversion and by backup. The ill-conditioned regime is "every" (clipping far below
the norm) with the policy off ("always"): the history of v is built from clipped gradients, the
speculated step adds an unclipped one ~1/c^2 larger; and "spikeN": step 12's gradient N times the
others (clip at 3x the usual norm: factor ~3/N) after a step that did not clip, the policy on. Usage: python experiments/rollback/inversion_error.py
"""
import json
import sys

import numpy as np

sys.path.insert(0, "tests")
import test_rollback as tr  # noqa: E402
from chunkjax.host_update import AdamW  # noqa: E402


def errors(st, ref):
    ref_p, ref_state = ref
    adam = [x for x in __import__("jax").tree.leaves(ref_state, is_leaf=lambda x: hasattr(x, "_fields"))
            if type(x).__name__ == "ScaleByAdamState"][0]
    p = max(float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-2))) for a, b in zip(st.master, ref_p))
    m = max(float(np.max(np.abs(s.m - np.asarray(adam.mu[c]))) / np.max(np.abs(adam.mu[c])))
            for c, s in enumerate(st.opt_state))
    v = max(float(np.max(np.abs(s.v - np.asarray(adam.nu[c])) / np.maximum(np.asarray(adam.nu[c]), 1e-30)))
            for c, s in enumerate(st.opt_state))
    return p, m, v


rows = []
for case, clip in (("never", 1e3), ("some", 3.0), ("every", 1e-1), ("every", 1e-2), ("every", 1e-3),
                   ("spike30", 3.0), ("spike100", 3.0), ("spike1000", 3.0)):
    spec = AdamW(1e-3, weight_decay=0.1, max_grad_norm=clip * tr.NORM)
    scales = tr.SCALES[:12] + [float(case[5:])] + tr.SCALES[13:] if case.startswith("spike") else tr.SCALES
    grads = tr._grads(scales)
    ref = tr._optax(spec, grads)
    for rollback, policy in (("invert", "after_common"), ("invert", "always"), ("backup", "always")):
        st, _ = tr._run(spec, grads, rollback=rollback, policy=policy)
        p, m, v = errors(st, ref)
        rows.append(dict(case=case, clip_over_norm1=clip, rollback=rollback, policy=policy, params_rel=p, m_rel_max=m,
                         v_rel=v))
        print(f"{case:6s} clip={clip:<6g} {rollback:7s} {policy:13s} params {p:.2e}  m {m:.2e}  v {v:.2e}")
print(json.dumps(rows))
