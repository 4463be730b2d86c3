"""Shared fixtures for the kallpa package's tests (scripts/test.sh runs them against build/python)."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = pathlib.Path(os.environ.get("KALLPA_TEST_MODEL", ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# Tolerances of a float32/float16/bfloat16 result against the float64 contract.
TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2}


def close(actual, expected, dtype="float32"):
    actual = np.asarray(actual, dtype=np.float64)
    tol = TOL[dtype]
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


def close_lse(actual, expected, dtype="float32"):
    actual = np.asarray(actual, dtype=np.float64)
    finite = np.isfinite(expected)
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected))
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=TOL[dtype], atol=TOL[dtype])
