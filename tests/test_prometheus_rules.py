"""Prometheus rules as code: promtool validates them and runs their unit
tests (alert fires after 5 minutes below 70 %, not after 4.5; short dips
never fire; it resolves; one series per class).  A deliberately wrong
expectation must make promtool fail, so the tests can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parent.parent / "dashboards" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("SPECTUNE_REQUIRE_PROMTOOL"):
            pytest.fail("promtool not found but SPECTUNE_REQUIRE_PROMTOOL is set")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return found


def test_rules_are_valid(promtool):
    out = subprocess.run([promtool, "check", "rules", str(RULES / "rules.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_unit_tests_pass(promtool):
    out = subprocess.run(
        [promtool, "test", "rules", "acceptance_test.yml"], cwd=RULES / "tests", capture_output=True, text=True
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_a_wrong_expectation_fails(promtool, tmp_path):
    text = (RULES / "tests" / "acceptance_test.yml").read_text()
    wrong = text.replace("eval_time: 19m          # 5m30s below: firing", "eval_time: 18m          # 4m30s: wrong")
    assert wrong != text
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "wrong_test.yml").write_text(wrong)
    shutil.copy(RULES / "rules.yml", tmp_path / "rules.yml")
    out = subprocess.run(
        [promtool, "test", "rules", "wrong_test.yml"], cwd=tmp_path / "tests", capture_output=True, text=True
    )
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr
