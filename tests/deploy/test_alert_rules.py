"""The chart's alerts, proven with promtool: the rendered rules pass `promtool check rules`, and the
unit tests in alert_rules_test.yaml fire each alert on a series that should fire it and keep it
silent on one that should not; a wrong threshold or `for` makes them fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.prometheus_rules import dump_rule_file, render_rule_file

UNIT_TESTS = Path(__file__).with_name("alert_rules_test.yaml")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # a failure, not a skip: the alerts would go unproven
        pytest.fail("promtool not found: `make setup` installs it (Debian's prometheus package)")
    return path


def run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def unit_test(promtool: str, directory: Path, overrides: dict | None = None):
    """Render the rules into `directory` beside a copy of the unit tests, and run them."""
    render_rule_file(directory, overrides)
    shutil.copy(UNIT_TESTS, directory)
    return run(promtool, "test", "rules", UNIT_TESTS.name, cwd=directory)


def rule_override(**values) -> dict:
    return {"monitoring": {"prometheusRule": values}}


def test_rules_pass_promtool_check(promtool, tmp_path):
    rules = render_rule_file(tmp_path)
    result = run(promtool, "check", "rules", rules.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 14 rules found" in result.stdout


def test_alert_unit_tests_pass(promtool, tmp_path):
    result = unit_test(promtool, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_rejects_a_broken_expression(promtool, tmp_path):
    rules_path = render_rule_file(tmp_path)
    rules = yaml.safe_load(rules_path.read_text())
    alert = rules["groups"][1]["rules"][0]
    alert["expr"] = alert["expr"].replace(">", "> >")
    dump_rule_file(rules, rules_path)
    result = run(promtool, "check", "rules", rules_path.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "parse error" in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("overrides", "alert"),
    [
        (rule_override(kvCacheUsageThreshold=0.999), "TritonLLMKVCacheFull"),
        (rule_override(waitingThreshold=50), "TritonLLMQueueGrowing"),
        (rule_override(ttftFor="11m"), "TritonLLMTimeToFirstTokenHigh"),
        (rule_override(preemptionsPerSecond=0.8), "TritonLLMPreemptions"),
        (rule_override(stubUnhealthyFor="4m"), "TritonModelStubUnhealthy"),
        (rule_override(serverDownFor="3m"), "TritonServerDown"),
        # The A/B rollback signal: a smaller margin or traffic floor fires on the silent cases
        # (within the margin, 14% slower, too little traffic), a longer `for` misses the firing ones.
        (rule_override(versionRegression={"errorRateMargin": 0.01}), "TritonLLMVersionRegression"),
        (rule_override(versionRegression={"ttftP99Margin": 0.1}), "TritonLLMVersionRegression"),
        (
            rule_override(versionRegression={"minRequestsPerSecond": 0.04}),
            "TritonLLMVersionRegression",
        ),
        (rule_override(versionRegression={"for": "11m"}), "TritonLLMVersionRegression"),
    ],
)
def test_unit_tests_catch_a_wrong_threshold_or_duration(promtool, tmp_path, overrides, alert):
    """So the suite cannot pass vacuously: off by a little, the alert's own case fails."""
    result = unit_test(promtool, tmp_path, overrides)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"alertname: {alert}," in output


def expected_alerts() -> tuple[set[str], set[str]]:
    """The alert names with a firing case and those with a silent case in the unit tests."""
    firing, silent = set(), set()
    for group in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    return firing, silent


def test_every_alert_has_a_firing_and_a_silent_case(tmp_path):
    rules = yaml.safe_load(render_rule_file(tmp_path).read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    firing, silent = expected_alerts()
    assert len(alerts) == 7
    assert alerts - firing == set(), "alerts without a firing case"
    assert alerts - silent == set(), "alerts without a silent case"
    assert firing | silent <= alerts, "cases for alerts the chart no longer has"
