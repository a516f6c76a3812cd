"""Property-based API test: schemathesis generates requests from the live
OpenAPI schema (bounded examples); no 5xx, responses match the schema."""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from spectune.api.auth import Role, TokenSpec
from spectune.app import create_app
from spectune.store.db import make_engine, upgrade

OPERATOR = {"Authorization": "Bearer operator-token"}


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('st')}/cp.db"
    upgrade(url)
    app = create_app(None, make_engine(url), {"ola": TokenSpec(token="operator-token", role=Role.OPERATOR)})
    with TestClient(app):  # run the lifespan once: the policy row exists
        pass
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_api_conforms(api_schema):
    # schemathesis' pytest plugin does not run under pytest 9; drive its
    # strategies with hypothesis directly, one operation at a time.
    from hypothesis import given

    failures, operations = [], 0
    for result in api_schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            # Schema-valid but cross-field-invalid policies (n_min > n_max, unknown
            # classes) are rightly refused, so positive_data_acceptance does not apply.
            case.call_and_validate(headers=OPERATOR, excluded_checks=[positive_data_acceptance])

        try:
            run()
        except Exception as exc:
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    assert operations >= 12
    assert not failures, "\n\n".join(failures)
