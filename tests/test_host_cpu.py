"""ps/client/host_cpu.py: the host check before the overlap trial. Pure logic with given
/proc/stat readings, and the real /proc/stat where there is one."""

from __future__ import annotations

import os

import pytest

from psar.ps.client.host_cpu import MIN_TICKS, CoLocatedCPU, HostBusy, read_proc_stat


def readings(*values: tuple[int, int] | None):  # noqa: ANN201
    it = iter(values)
    return lambda: next(it)


def test_the_busy_share_is_the_busy_ticks_over_all_ticks_between_two_reads() -> None:
    b = HostBusy(readings((100, 1000), (190, 1100)))
    b.start()
    assert b.fraction() == pytest.approx(0.9)


@pytest.mark.parametrize(
    "values",
    [((0, 0), (5, MIN_TICKS - 1)), (None, (10, 100)), ((10, 100), None)],
    ids=["too-few-ticks", "no-first-reading", "no-second-reading"],
)
def test_no_share_without_enough_to_judge(values: tuple) -> None:
    b = HostBusy(readings(*values))
    b.start()
    assert b.fraction() is None


def test_proc_stat_is_read_as_busy_and_total_ticks(tmp_path) -> None:  # noqa: ANN001
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  10 1 5 80 4 0 2 3 7 0\ncpu0 1 2 3 4 5 6 7 8 9 0\n")
    assert read_proc_stat(str(stat)) == (21, 105)  # busy: all but idle and iowait
    stat.write_text("intr 1 2 3\n")
    assert read_proc_stat(str(stat)) is None
    assert read_proc_stat(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat (not Linux)")
def test_this_hosts_proc_stat_reads() -> None:
    busy, total = read_proc_stat()
    assert 0 <= busy <= total and total > 0


def check(threshold: float, share: float | None, *, cpu: bool = True, local: bool = True):  # noqa: ANN201
    busy = HostBusy(readings((0, 0), (None if share is None else (int(share * 1000), 1000))))
    asked = []

    def in_shared_memory() -> bool:
        asked.append(True)
        return local

    c = CoLocatedCPU(threshold, cpu_compute=cpu, in_shared_memory=in_shared_memory, busy=busy)
    c.start()
    return c.verdict(), c, asked


def test_a_busy_host_with_every_shard_on_it_says_why() -> None:
    why, c, asked = check(0.8, 0.88)
    assert why is not None and "88% busy" in why and "--overlap-host-busy 0.8" in why
    assert c.measured == pytest.approx(0.88) and asked == [True]


@pytest.mark.parametrize(
    ("threshold", "share", "cpu", "local"),
    [
        (0.8, 0.79, True, True),  # room left on the host
        (0.8, 0.95, True, False),  # a shard elsewhere: link time overlap may hide
        (0.8, 0.95, False, True),  # compute on a GPU: the CPU's load is not compute
        (0.0, 1.0, True, True),  # 0: always try
        (0.8, None, True, True),  # too little to judge
    ],
    ids=["room", "remote-shard", "gpu", "off", "unknown"],
)
def test_otherwise_no_verdict(
    threshold: float, share: float | None, cpu: bool, local: bool
) -> None:
    assert check(threshold, share, cpu=cpu, local=local)[0] is None
