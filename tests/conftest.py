import numpy as np
import pytest

import gflow  # noqa: F401  (switches JAX to float64 before any test builds arrays)


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(20260301)
