"""Shared test setup: fake CPU devices and a persistent compilation cache.

Both are set before any test touches a JAX backend. The cache only skips recompiling the
same programs (it is keyed on the compiled HLO); it never changes results.
"""

import os
import tempfile
from pathlib import Path

import jax

CACHE_DIR = Path(os.environ.get("MOE_TRAIN_TEST_JAX_CACHE",
                                Path(tempfile.gettempdir()) / "moe_train_test_jax_cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
