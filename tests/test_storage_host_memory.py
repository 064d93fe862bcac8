"""The disk tier's host memory outside the chunks (issue 24: GPT3_18B with the disk tier left the
H200's machine ~0.3 GB of MemAvailable while the trainer matched its plan): each near-storage
worker process's resident memory is counted by the plan (:func:`chunkjax.host_memory.storage_host_bytes`).
"""
import os

import pytest

from chunkjax import host_memory as hm


def test_storage_host_bytes_counts_every_worker_and_the_trainer():
    g, f = 100 * 2**20, 600 * 2**20
    one = hm.storage_host_bytes(g, f, 1)
    assert one == 3 * f + (hm.STORAGE_WORKER_MESSAGES + hm.STORAGE_TRAINER_MESSAGES) * g
    assert hm.storage_host_bytes(g, f, 2) - one == 3 * f + hm.STORAGE_WORKER_MESSAGES * g
    assert hm.storage_host_bytes(g, f, 1, staging_buffers=5) - one == 2 * f
    assert hm.storage_host_bytes(g, f, 0) == 0
    assert hm.storage_process_bytes(2) == 2 * hm.STORAGE_WORKER_BASE_BYTES and hm.storage_process_bytes(0) == 0


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
    2 Mi-element chunks: 25 MB chunk files); a sampler reads the worker's RssAnon every 20 ms. Its
    peak is never above the plan's count for it, and below it by at most the count's margins: its
    base (128 MiB) is 36 MB above the 97.6 MB measured here (room for other numba / numpy builds),
    its messages (4 chunks of bf16) may not all be in flight when sampled (measured 164-187 MB
    with 8-16 storage chunks), and 10 % for the allocator."""
    from experiments.storage_host_memory import main
    out = main(["--chunk-size", str(2**21), "--d-model", "512", "--layers", "6", "--steps", "2",
                "--storage", str(tmp_path), "--every-s", "0.02"])
    assert out["storage_chunks"] >= 3, out["counts"]  # every staging buffer is used
    measured, accounted = out["worker_anon_peak"], out["worker_bytes_accounted"]
    assert measured >= 3 * out["file_bytes"], out["peaks"]  # the staging buffers are resident
    slack = (hm.STORAGE_WORKER_BASE_BYTES - 97.6e6) + hm.STORAGE_WORKER_MESSAGES * 2 * 2**21 + 0.1 * measured
    assert measured <= accounted <= measured + slack, (measured, accounted)
