"""bench/guidellm.py's summary of a guidellm report (the run itself is `make guidellm-bench`)."""

from __future__ import annotations

from bench.guidellm import summarise


def test_summary_counts_requests_by_status_and_outputs_of_the_asked_length() -> None:
    report = {
        "benchmarks": [
            {
                "requests": {
                    "successful": [{"output_tokens": 48}, {"output_tokens": 48}, {"output_tokens": 12}],
                    "errored": [{"output_tokens": 0}],
                    "incomplete": [],
                }
            },
            {"requests": {"successful": [{"output_tokens": 48}]}},
        ]
    }
    assert summarise(report, 48) == {
        "successful": 4,
        "errored": 1,
        "incomplete": 0,
        "outputs_of_the_asked_length": 3,
    }
    assert summarise({}, 48)["successful"] == 0
