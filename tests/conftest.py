"""Test-wide settings: 8 forced host devices for multi-device logic (set before jax is imported),
and the CPU backend."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
