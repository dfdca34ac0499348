"""A service's default thread count: its CPU affinity, bounded by its cgroup's quota."""

from __future__ import annotations

from serving.cpus import available_cpus, cgroup_quota


def test_cgroup_v2_quota(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert cgroup_quota(cpu_max, (tmp_path / "none", tmp_path / "none")) == 1.5
    cpu_max.write_text("max 100000\n")
    assert cgroup_quota(cpu_max, (tmp_path / "none", tmp_path / "none")) is None


def test_cgroup_v1_quota_and_no_cgroup(tmp_path):
    quota, period = tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    quota.write_text("200000\n")
    period.write_text("100000\n")
    assert cgroup_quota(tmp_path / "absent", (quota, period)) == 2.0
    quota.write_text("-1\n")  # no limit
    assert cgroup_quota(tmp_path / "absent", (quota, period)) is None
    assert cgroup_quota(tmp_path / "absent", (tmp_path / "a", tmp_path / "b")) is None


def test_the_quota_bounds_the_affinity_rounded_up():
    assert available_cpus(quota=1.5, affinity=64) == 2  # a pod limited to 1.5 CPUs on a 64-core node
    assert available_cpus(quota=8.0, affinity=4) == 4  # pinned to fewer cores than the quota
    assert available_cpus(quota=0.2, affinity=4) == 1
