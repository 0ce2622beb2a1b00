"""What the benchmarks record of the machine under a measurement: the share of CPU time a shared
host's hypervisor took while it ran (the steal meter, /proc/stat) and the CPU's model name
(/proc/cpuinfo), both read here from files written to look like the kernel's."""

import pytest

from graphrt.bench.common import cpu_model
from graphrt.bench.steal import StealMeter, cpu_times, steal_fraction, steal_note


def write_stat(path, user, steal, idle=1000, guest=0):
    # user nice system idle iowait irq softirq steal guest guest_nice, then the per-CPU lines
    path.write_text(f"cpu  {user} 0 50 {idle} 5 0 3 {steal} {guest} 0\ncpu0 1 0 0 1 0 0 0 0 0 0\nintr 7\n")


def test_steal_is_the_stolen_share_of_the_ticks_between_two_readings(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, user=100, steal=20, guest=40)
    before = cpu_times(str(stat))
    assert before == (20, 100 + 50 + 1000 + 5 + 3 + 20)  # guest ticks are inside user's: not added twice
    write_stat(stat, user=160, steal=50, idle=1010, guest=90)
    after = cpu_times(str(stat))
    assert steal_fraction(before, after) == pytest.approx(30 / (60 + 10 + 30))


def test_the_meter_measures_the_block_it_wraps(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, user=0, steal=0)
    with StealMeter(str(stat)) as meter:
        write_stat(stat, user=75, steal=25)  # the block "ran" for 100 ticks, 25 of them stolen
    assert meter.fraction == pytest.approx(0.25) and meter.seconds >= 0
    with StealMeter(str(stat)) as idle:
        pass  # no tick passed: no fraction, rather than 0/0 or a made-up zero
    assert idle.fraction is None


def test_no_steal_is_reported_where_the_kernel_reports_none(tmp_path):
    assert cpu_times(str(tmp_path / "missing")) is None
    old = tmp_path / "old"
    old.write_text("cpu  1 2 3 4 5 6 7\n")  # a kernel before steal accounting: seven columns
    assert cpu_times(str(old)) is None
    assert steal_fraction(None, (1, 2)) is None and steal_fraction((1, 2), None) is None
    with StealMeter(str(tmp_path / "missing")) as meter:
        pass
    assert meter.fraction is None


def test_a_benchmark_line_names_the_steal_only_when_it_counts():
    assert steal_note(None) == "" and steal_note(0.004) == ""
    assert steal_note(0.123) == "  steal 12%"


def test_the_machine_facts_name_the_cpu_model(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R45\nflags\t: fpu\n")
    assert cpu_model(str(info)) == "AMD EPYC 9R45"
    assert cpu_model(str(tmp_path / "missing"))  # the architecture, where there is no cpuinfo
