"""A pytest plugin that appends each test phase's duration and outcome to a file as the phase ends, so a run
that is cut off (a time limit, a lost machine) still says where its time went and what failed so far; pytest's
own --durations prints only at the end.

    PYTHONPATH=benchmarks:$PYTHONPATH TEST_TIMINGS=/tmp/timings.txt python -m pytest -q tests -p pytest_timings
    sort -rn /tmp/timings.txt | head -30          # the slowest phases

A line: seconds, phase (setup, call, teardown), outcome, test id. Calls are always written; setups and
teardowns when they took over a second or did not pass. Under pytest-xdist (`-n auto`) only the controller
writes (it receives every worker's reports), each line once.
"""
import os

PATH = os.environ.get("TEST_TIMINGS", "test_timings.txt")


def pytest_runtest_logreport(report) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or report.duration > 1.0 or report.outcome != "passed":
        with open(PATH, "a") as f:
            f.write(f"{report.duration:8.2f} {report.when:8s} {report.outcome:7s} {report.nodeid}\n")
