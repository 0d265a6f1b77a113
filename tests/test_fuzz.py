"""A property-based fuzzer (schemathesis) against the real service's own OpenAPI description: requests generated
from every route's schema, valid and invalid, must never get a 5xx, and every answer must be one the description
documents (status, media type, body shape). Bounded: a small context keeps generation short on the CPU, and few
examples per route keep the whole run near a minute."""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import CHECKS
from server import serve

CHECK_NAMES = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_schema_conformance", "negative_data_rejection"]
EXAMPLES = 40


@pytest.fixture(scope="module")
def api():
    # max_model_len 64: a generated request generates at most 63 tokens; 3 jobs at most, so fuzzed fine-tuning
    # requests stop at the limit rather than keep the engine training.
    with serve(max_model_len=64, finetune_max_jobs=3, finetune_max_files=20) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_the_description_covers_every_route_with_a_body(api):
    documented = {(op.path, op.method.lower()) for op in operations(api) if op.body}
    assert {("/generate", "post"), ("/generate_stream", "post"), ("/v1/completions", "post"),
            ("/v1/chat/completions", "post"), ("/v1/fine_tuning/jobs", "post"), ("/v1/files", "post")} <= documented


def test_no_route_fails_or_answers_outside_its_description(api):
    checks = CHECKS.get_by_names(CHECK_NAMES)
    failures = []
    for operation in operations(api):
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def fuzz(case):
            case.call_and_validate(checks=checks, timeout=60)

        try:
            fuzz()
        except Exception as e:  # collect every route's failure, then report them all
            failures.append(f"{operation.method.upper()} {operation.path}: {e}"[:2000])
    assert not failures, "\n\n".join(failures)
