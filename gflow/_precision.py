"""gflow computes in float64: importing gflow switches JAX's x64 mode on.

Set the environment variable ``GFLOW_X64=0`` before importing gflow to leave JAX's setting
alone; gflow then builds its arrays in ``jnp.float32`` unless a ``dtype`` is passed.
"""

import os

import jax
import jax.numpy as jnp

if os.environ.get("GFLOW_X64", "1") != "0":
    jax.config.update("jax_enable_x64", True)


def default_dtype():
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
