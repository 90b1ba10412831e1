"""Under CI (CI=true, as CI runs .ci/run) a deploy, compose, monitoring or Kubernetes test that would skip fails
instead: .ci/run installs every tool these tests need, so a skip there means a missing install step, not a machine
that cannot run them. Used at module level by those test files (a tool they all need) and by tests/deploy/conftest.py
(any skip inside tests/deploy).
"""
from __future__ import annotations

import os

import pytest

HOW = ".ci/run installs podman, buildah, catatonit, debootstrap, runc, docker-compose, kubectl, curl and promtool"


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def must_run(reason: str | None, what: str) -> None:
    """Nothing where `reason` is None; under CI fail the calling module's collection with why it cannot run."""
    if reason and under_ci():
        pytest.fail(f"{what} would be skipped under CI ({reason}); CI runs every one of them: {HOW}", pytrace=False)
