"""Shared fixtures: a closed-form cost model (known coefficients) and a small shape pool."""

import pytest

from planner_testlib import toy_cost_model, toy_shapes


@pytest.fixture(scope="session")
def cost_model():
    return toy_cost_model()


@pytest.fixture(scope="session")
def shapes():
    return toy_shapes()
