"""Session 25's A/B of the host kernel's division of a chunk among numba threads (issue 23).

On PYTHONPATH, this makes every Python process (the bench's workers too) run the AdamW host kernel
with numba's static division (one equal range per thread: the kernel before session 25) instead of
:mod:`chunkjax.kernel_threads`' guided claims. Only for ``experiments/gpu_checks/division_ab.sh``."""
from experiments.gpu_checks.division_probe import install_static

install_static()
