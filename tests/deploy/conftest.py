"""tests/deploy under CI (CI=true): a skip is a failure (tests/deploy/ci.py says why)."""
from __future__ import annotations

import pytest
from tests.deploy.ci import HOW, under_ci


def _fail_a_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and under_ci():
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which runs every deploy test ({reason}); {HOW}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_a_skip(outcome.get_result())
