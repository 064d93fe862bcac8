"""Lion inverse: elements whose recovered sign differs from the forward's (an error of lr or 2 lr),
over 3 inversions of 2^22 random elements after 5 steps of history. Measured: 0 of 12,582,912.
Usage: python experiments/rollback/lion_sign_flips.py"""
import numpy as np
from chunkjax.host_update import Lion, host_update_, host_invert_
rng = np.random.default_rng(1)
n = 1 << 22
spec = Lion(1e-4, weight_decay=0.1)
st = spec.host_state(n); master = rng.standard_normal(n).astype(np.float32)
for _ in range(5):
    host_update_(spec, st, rng.standard_normal(n).astype(np.float32), master)
tot = 0
for k in range(3):
    g = rng.standard_normal(n).astype(np.float32)
    b = master.copy()
    host_update_(spec, st, g, master)
    host_invert_(spec, st, g, master)
    flips = int(np.sum(np.abs(master - b) > 0.5e-4))
    tot += flips
    master[:] = b
    host_update_(spec, st, g, master)  # advance the history
print("elements", 3 * n, "sign flips", tot)
