"""The disk tier's host memory outside the chunks (issue 24: GPT3_18B with the disk tier left the
H200's machine ~0.3 GB of MemAvailable while the trainer matched its plan): each near-storage
worker process's resident memory is counted by the plan (:func:`chunkjax.host_memory.storage_host_bytes`,
:func:`chunkjax.host_memory.storage_process_bytes`).
"""
import os

import pytest

from chunkjax import host_memory as hm


def test_storage_bytes_count_every_worker_and_the_trainer():
    g, f = 100 * 2**20, 600 * 2**20
    assert hm.storage_host_bytes(f, 1) == 3 * f and hm.storage_host_bytes(f, 2, staging_buffers=5) == 10 * f
    assert hm.storage_host_bytes(f, 0) == 0
    one = hm.storage_process_bytes(1, g)
    assert one == hm.STORAGE_WORKER_BASE_BYTES + (hm.STORAGE_WORKER_MESSAGES + hm.STORAGE_TRAINER_MESSAGES) * g
    assert hm.storage_process_bytes(2, g) - one == hm.STORAGE_WORKER_BASE_BYTES + hm.STORAGE_WORKER_MESSAGES * g
    assert hm.storage_process_bytes(0, g) == 0


def test_a_storage_plans_need_counts_its_workers(tmp_path):
    """A GPU plan with storage chunks: the staging buffers in its pageable bytes, each worker's
    base and messages in its process bytes, 3 % for the rest of the machine on top."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from chunkjax import fit, fit_host
    from chunkjax.errors import PlanError
    from chunkjax.host_update import AdamW
    from chunkjax.storage.updater import StorageOptions
    from models import gpt
    cfg = gpt.get_config("micro", n_layers=3)
    p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((2, 17), jnp.int32),
                    host_optimizer=AdamW(1e-3), compute_dtype=jnp.bfloat16, min_chunks=8, check_host=False,
                    host_budget=10**12, storage=StorageOptions((str(tmp_path / "a"),)))
    p = dataclasses.replace(p, platform="gpu")
    with pytest.raises(PlanError) as e:
        fit.plan(p, 1)
    floor = e.value.min_budget_bytes
    free = fit.plan(p, floor)
    s = fit.plan(dataclasses.replace(p, host_budget_bytes=free.predicted.host_bytes // 2), floor)
    pr = s.predicted
    assert pr.storage_chunks and pr.storage_workers == p.storage_devices
    file_bytes = 3 * (-(-p.cb.master // 4096) * 4096)  # master, m, v: each padded to 4096 bytes
    assert pr.storage_host_bytes == hm.storage_host_bytes(file_bytes, p.storage_devices) > 0
    need = fit_host.host_need(p, s)
    assert need["process_bytes"] == (hm.process_bytes(p.layout, "gpu")
                                     + hm.storage_process_bytes(p.storage_devices, p.cb.grad))
    run = need["pinned_pool_bytes"] + need["pageable_bytes"] + need["process_bytes"]
    assert need["need_bytes"] == run + int(hm.SYSTEM_HOST_SHARE * run)


def test_system_share_only_on_a_gpu_plan():
    """A plan's need counts the rest of the machine's growth on a GPU (SYSTEM_HOST_SHARE), not on
    the CPU, and not in a bare host need (the lower-bound refusals)."""
    env = {"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE": "true", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "10"}
    need = hm.host_need(10 * 2**30, 20 * 2**30, 0, 2**30, "gpu", env, system=True)
    run = need["pinned_pool_bytes"] + need["pageable_bytes"] + need["process_bytes"]
    assert need["system_bytes"] == int(hm.SYSTEM_HOST_SHARE * run) and need["need_bytes"] == run + need["system_bytes"]
    assert hm.host_need(10 * 2**30, 20 * 2**30, 0, 2**30, "gpu", env)["need_bytes"] == run
    cpu = hm.host_need(10 * 2**30, 20 * 2**30, 0, 2**30, "cpu", system=True)
    assert cpu["system_bytes"] == 0 and cpu["need_bytes"] == 31 * 2**30


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_worker_resident_memory_within_its_accounting(tmp_path):
    """A GPT whose offloaded chunks partly live on disk runs two steps (bf16 compute, one worker,
    2 Mi-element chunks: 25 MB chunk files, 8 of them on disk); a sampler reads the worker's RssAnon every 20 ms. Its
    peak is never above the plan's count for it, and below it by at most the count's margins: its
    base (128 MiB) is 36 MB above the 97.6 MB measured here (room for other numba / numpy builds),
    its messages (4 chunks of bf16) may not all be in flight when sampled (measured 164-187 MB
    with 8-16 storage chunks), and 10 % for the allocator."""
    from experiments.storage_host_memory import main
    out = main(["--chunk-size", str(2**21), "--d-model", "512", "--layers", "4", "--steps", "2",
                "--storage", str(tmp_path), "--every-s", "0.02"])
    assert out["storage_chunks"] >= 3, out["counts"]  # every staging buffer is used
    measured, accounted = out["worker_anon_peak"], out["worker_bytes_accounted"]
    assert measured >= 3 * out["file_bytes"], out["peaks"]  # the staging buffers are resident
    slack = (hm.STORAGE_WORKER_BASE_BYTES - 97.6e6) + hm.STORAGE_WORKER_MESSAGES * 2 * 2**21 + 0.1 * measured
    assert measured <= accounted <= measured + slack, (measured, accounted)
