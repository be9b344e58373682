"""worker/supervisor.py, the one supervisor of `psar launch` and bench/: real child
processes throughout (no mocks), and no wall-clock assertions."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from psar.worker.supervisor import ProcessError, Supervisor, descendants
from tests.test_launch import alive

PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def gone_soon(pid: int) -> bool:
    for _ in range(200):  # killed at once; reaped by whoever adopted it
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_failed_job_quotes_the_error_that_scrolled_out_of_its_tail(tmp_path: Path) -> None:
    # As under torchrun: the rank's error, then a long summary that fills the tail.
    script = (
        "import sys; print('terminate called after throwing gloo::IoException'); "
        "[print('summary line', i) for i in range(40)]; sys.exit(1)"
    )
    with Supervisor(tmp_path, env=ENV) as sup, pytest.raises(ProcessError) as err:
        sup.start("job", [PY, "-c", script])
        sup.wait(["job"], timeout=60)
    text = str(err.value)
    assert "job exited 1" in text
    assert "  ! terminate called after throwing gloo::IoException" in text
    assert "  | summary line 39" in text and "summary line 20" not in text


def test_a_job_killed_by_abort_leaves_its_python_stack_in_the_error(tmp_path: Path) -> None:
    script = "import os\ndef deep_in_teardown():\n    os.abort()\ndeep_in_teardown()\n"
    with Supervisor(tmp_path, env=ENV) as sup, pytest.raises(ProcessError) as err:
        sup.start("job", [PY, "-c", script])
        sup.wait(["job"], timeout=60)
    text = str(err.value)
    assert "exited -6" in text  # SIGABRT
    assert "Fatal Python error: Aborted" in text and "deep_in_teardown" in text


def test_a_server_that_exits_fails_the_job_even_with_code_0(tmp_path: Path) -> None:
    with Supervisor(tmp_path, env=ENV) as sup:
        sup.start("server", [PY, "-c", "print('bye')"], persistent=True)
        sup.start("worker", [PY, "-c", "import time; time.sleep(60)"])
        with pytest.raises(ProcessError, match="server exited 0 before it was stopped"):
            sup.wait(["worker"], timeout=60)
        child, rc = sup.failure()
        assert (child.name, rc) == ("server", 0)


def test_finished_workers_leave_the_running_server_alone(tmp_path: Path) -> None:
    with Supervisor(tmp_path, env=ENV) as sup:
        server = sup.start("server", [PY, "-c", "import time; time.sleep(60)"], persistent=True)
        sup.start("worker", [PY, "-c", "print('done')"])
        sup.wait(["worker"], timeout=60)
        assert sup.finished(["worker"]) and sup.failure() is None
        assert server.poll() is None
    assert not alive(server.pid)


def test_wait_line_reads_the_log_and_says_when_the_child_died_first(tmp_path: Path) -> None:
    listen = re.compile(r"listening on (\S+):(\d+)")
    with Supervisor(tmp_path, env=ENV) as sup:
        sup.start("s", [PY, "-c", "print('x listening on 127.0.0.1:4711'); import time; "
                        "time.sleep(60)"], persistent=True)  # fmt: skip
        assert sup.wait_line("s", listen, timeout=60).group(2) == "4711"
        sup.start("quiet", [PY, "-c", "import sys; print('no port today'); sys.exit(2)"])
        with pytest.raises(ProcessError, match="quiet exited 2") as err:
            sup.wait_line("quiet", listen, timeout=60)
        assert "  | no port today" in str(err.value)
    with Supervisor(tmp_path / "t", env=ENV) as sup:
        sup.start("mute", [PY, "-c", "import time; time.sleep(60)"])
        with pytest.raises(ProcessError, match="printed no"):
            sup.wait_line("mute", listen, timeout=0.5)


def test_a_wait_that_times_out_names_who_it_waited_for(tmp_path: Path) -> None:
    with Supervisor(tmp_path, env=ENV) as sup:
        sup.start("slow", [PY, "-c", "print('working'); import time; time.sleep(60)"])
        with pytest.raises(ProcessError, match=r"timeout 0.5s waiting for \['slow'\]"):
            sup.wait(["slow"], timeout=0.5)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)")  # fmt: skip
    notes: list[str] = []
    sup = Supervisor(tmp_path, env=ENV, grace=0.5, note=notes.append)
    p = sup.start("stubborn", [PY, "-c", stubborn])
    sup.wait_line("stubborn", re.compile("ready"), timeout=60)
    sup.stop()
    assert p.returncode == -signal.SIGKILL
    assert notes == ["stubborn still running 0.5s after SIGTERM; SIGKILL"]
    sup.stop()  # again: nothing left to do


def test_descendants_in_sessions_of_their_own_are_stopped(tmp_path: Path) -> None:
    """As torchrun starts its ranks: new sessions, so the parent's group never has them."""
    parent = (
        "import subprocess, sys, time\n"
        "k = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        "print('rank', k.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    pids: list[int] = []
    with Supervisor(tmp_path, env=ENV, pids=pids) as sup:
        p = sup.start("launcher", [PY, "-c", parent])
        rank = int(sup.wait_line("launcher", re.compile(r"rank (\d+)"), timeout=60).group(1))
        assert rank in descendants([p.pid]) and os.getpgid(rank) != p.pid
        sup.scan(force=True)
        assert rank in pids and p.pid in pids  # every process seen is recorded
    assert gone_soon(rank) and not alive(p.pid)


def test_what_a_failed_child_left_in_its_group_goes_with_it(tmp_path: Path) -> None:
    """The parent exits before anyone could see its child: the group still holds it."""
    parent = (
        "import subprocess, sys; "
        "k = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print('child', k.pid, flush=True); sys.exit(3)"
    )
    with Supervisor(tmp_path, env=ENV) as sup, pytest.raises(ProcessError, match="exited 3") as e:
        sup.start("job", [PY, "-c", parent])
        sup.wait(["job"], timeout=60)
    kid = int(re.search(r"child (\d+)", str(e.value)).group(1))
    assert gone_soon(kid)


def test_pumped_output_is_prefixed_and_relabelled(tmp_path: Path) -> None:
    out = io.StringIO()
    relabel = lambda name, line: ("rank7", line[3:]) if line.startswith("r7:") else (name, line)  # noqa: E731
    with Supervisor(out=out, env=ENV, relabel=relabel) as sup:
        sup.start("job", [PY, "-c", "print('hello'); print('r7:from the rank')"])
        sup.wait(["job"], timeout=60)
        assert sup.lines("job", drain=5.0) == ["hello", "r7:from the rank"]
    assert out.getvalue().splitlines() == ["[job] hello", "[rank7] from the rank"]


def test_a_pinned_child_runs_on_the_cpus_it_was_given(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    with Supervisor(tmp_path, env=ENV) as sup:
        sup.start("pinned", [PY, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                  cpus={cpu})  # fmt: skip
        sup.wait(["pinned"], timeout=60)
        assert sup.lines("pinned") == [str([cpu])]


def test_names_are_unique_and_the_environment_is_the_one_given(tmp_path: Path) -> None:
    with Supervisor(tmp_path, env={**ENV, "PSAR_TEST_MARK": "sup"}) as sup:
        sup.start("a", [PY, "-c", "import os; print(os.environ['PSAR_TEST_MARK'])"])
        sup.start("b", [PY, "-c", "import os; print(os.environ['PSAR_TEST_MARK'])"],
                  env={**ENV, "PSAR_TEST_MARK": "own"})  # fmt: skip
        sup.wait(["a", "b"], timeout=60)
        assert (sup.lines("a"), sup.lines("b")) == (["sup"], ["own"])
        with pytest.raises(ValueError, match="'a' was started already"):
            sup.start("a", [PY, "-c", "pass"])
