"""bench.common.Procs: a failed job's error says why it failed (real child processes)."""

import sys
from pathlib import Path

import pytest

from bench.common import BenchError, Procs


def test_a_failed_job_quotes_the_error_that_scrolled_out_of_its_tail(tmp_path: Path) -> None:
    # As under torchrun: the rank's error, then a long summary that fills the tail.
    script = (
        "import sys; print('terminate called after throwing gloo::IoException'); "
        "[print('summary line', i) for i in range(40)]; sys.exit(1)"
    )
    with Procs(tmp_path) as procs, pytest.raises(BenchError) as err:
        procs.start("job", [sys.executable, "-c", script])
        procs.wait(["job"], timeout=60)
    text = str(err.value)
    assert "job exited 1" in text
    assert "  ! terminate called after throwing gloo::IoException" in text
    assert "  | summary line 39" in text and "summary line 20" not in text


def test_a_job_killed_by_abort_leaves_its_python_stack_in_the_error(tmp_path: Path) -> None:
    script = "import os\ndef deep_in_teardown():\n    os.abort()\ndeep_in_teardown()\n"
    with Procs(tmp_path) as procs, pytest.raises(BenchError) as err:
        procs.start("job", [sys.executable, "-c", script])
        procs.wait(["job"], timeout=60)
    text = str(err.value)
    assert "exited -6" in text  # SIGABRT
    assert "Fatal Python error: Aborted" in text and "deep_in_teardown" in text
