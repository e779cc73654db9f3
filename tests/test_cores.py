"""The cores this process may use (lit_grpo.runtime.validation): its CPU affinity, or fewer where a cgroup CPU quota
(a container's) grants fewer. No test reads this machine's cgroups: they are given as texts or a fake root folder."""

from __future__ import annotations

import os

import pytest

import lit_grpo.runtime.validation as validation
from lit_grpo.runtime.validation import (CgroupMount, CoreLimit, available_cores, cgroup_cpu_quotas, cgroup_mounts,
                                         check_thread_count, core_limit, core_share, cpu_quota_texts,
                                         default_threads, quota_cpus)


@pytest.mark.parametrize("quotas, cpus", [
    (["400000 100000"], 4),                   # docker --cpus 4
    (["150000 100000"], 1.5),                 # a Kubernetes limit of 1500m
    (["max 100000"], None),                   # cgroup v2: no quota
    (["-1 100000"], None),                    # cgroup v1: no quota
    (["max 100000", "800000 100000", "300000 100000"], 3),  # the tightest of the cgroup and those above it
    ([], None),
    (["", "max", "12 x"], None),              # a text the kernel would not write is passed over
])
def test_a_quota_grants_its_cpu_time_in_cpus(quotas, cpus):
    assert quota_cpus(quotas) == cpus


def _write(root, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake_cgroups(tmp_path, monkeypatch, proc_self_cgroup: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    root.mkdir()
    for relative, text in files.items():
        _write(root, relative, text)
    _write(tmp_path, "proc_self_cgroup", proc_self_cgroup)
    monkeypatch.setattr(validation, "_CGROUP_ROOT", str(root))
    monkeypatch.setattr(validation, "_PROC_SELF_CGROUP", str(tmp_path / "proc_self_cgroup"))
    # no mount table: the cgroups are looked for under the root, as where /proc/self/mountinfo lists none
    monkeypatch.setattr(validation, "_PROC_SELF_MOUNTINFO", str(tmp_path / "missing"))
    return root


def test_cgroup_v2_reads_the_processs_cgroup_and_those_above_it(tmp_path, monkeypatch):
    """A Kubernetes pod's limit may sit on the pod's cgroup and the container's on its own: the tightest counts."""
    _fake_cgroups(tmp_path, monkeypatch, "0::/kubepods/pod1/ctr\n", {
        "kubepods/pod1/ctr/cpu.max": "800000 100000\n", "kubepods/pod1/cpu.max": "200000 100000\n",
        "kubepods/cpu.max": "max 100000\n", "other/cpu.max": "100000 100000\n"})  # another cgroup's: not ours
    assert sorted(cgroup_cpu_quotas()) == ["200000 100000", "800000 100000", "max 100000"]
    assert quota_cpus(cgroup_cpu_quotas()) == 2


def test_a_container_reads_its_own_cgroup_at_the_root_whatever_path_proc_names(tmp_path, monkeypatch):
    """Without a cgroup namespace /proc/self/cgroup names the host's path, which the container's mount has not."""
    _fake_cgroups(tmp_path, monkeypatch, "0::/system.slice/docker-abc.scope\n", {"cpu.max": "400000 100000\n"})
    assert cgroup_cpu_quotas() == ["400000 100000"]


def test_cgroup_v1_reads_the_cfs_quota_and_period(tmp_path, monkeypatch):
    _fake_cgroups(tmp_path, monkeypatch, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "memory/docker/abc/cpu.cfs_quota_us": "100000\n", "memory/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert sorted(cgroup_cpu_quotas()) == ["-1 100000", "300000 100000"]


def test_no_cgroups_no_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(validation, "_PROC_SELF_CGROUP", str(tmp_path / "missing"))  # not Linux
    assert cgroup_cpu_quotas() == []
    _fake_cgroups(tmp_path, monkeypatch, "garbage\n0::/\n", {})  # a root cgroup has no cpu.max
    assert cgroup_cpu_quotas() == []


def test_a_quota_below_the_affinity_sets_the_cores(tmp_path, monkeypatch):
    """A 4-CPU pod on a 64-core host: the affinity shows 64 cores, the kernel grants 4 CPUs' time."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    _fake_cgroups(tmp_path, monkeypatch, "0::/\n", {"cpu.max": "400000 100000\n"})
    assert core_limit() == CoreLimit(cores=4, quota_cpus=4.0) and available_cores() == 4
    with pytest.raises(ValueError, match=r"torch_num_threads=17 must be in \[1, 16\] \(4 a core of the 4 this "
                                         r"process's cgroup CPU quota of 4 CPUs grants\)"):
        check_thread_count("torch_num_threads", 17)
    _write(tmp_path, "cgroup/cpu.max", "12800000 100000\n")  # a quota of 128 CPUs: the affinity's 64 cores decide
    assert core_limit() == CoreLimit(cores=64)
    # a share counts as a core; 63.5 CPUs are the affinity's 64 cores, and a quota that throttles them
    for quota, limit in (("150000", CoreLimit(2, 1.5)), ("50000", CoreLimit(1, 0.5)), ("6350000", CoreLimit(64, 63.5))):
        _write(tmp_path, "cgroup/cpu.max", f"{quota} 100000\n")
        assert core_limit() == limit
    _write(tmp_path, "cgroup/cpu.max", "12800000 100000\n")
    with pytest.raises(ValueError, match=r"\(4 a core of the 64 this process may run on\)"):
        check_thread_count("torch_num_threads", 257)


def test_a_cgroup_path_that_is_not_utf8_is_read_not_raised(tmp_path, monkeypatch):
    """A cgroup's name is any bytes: the CLI and every fit step read them, so they must not raise."""
    root = _fake_cgroups(tmp_path, monkeypatch, "", {})
    (tmp_path / "proc_self_cgroup").write_bytes(b"0::/job-\xff\n")
    (root / os.fsdecode(b"job-\xff")).mkdir()
    (root / os.fsdecode(b"job-\xff") / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_quotas() == ["200000 100000"]


def test_a_cgroup_outside_the_namespaces_root_reads_no_quota(tmp_path, monkeypatch):
    """The kernel names a cgroup outside the reader's cgroup namespace "/../x": the root seen is not above it, so
    its quota (here a sibling's single CPU) is not this process's."""
    _fake_cgroups(tmp_path, monkeypatch, "0::/../job\n", {"cpu.max": "100000 100000\n"})
    assert cgroup_cpu_quotas() == []


def test_each_process_on_a_node_takes_its_share_of_the_cores(monkeypatch):
    """The CLI's default threads and the fit summary's advice divide the cores by this one rule."""
    assert (core_share(8, 2), core_share(7, 2), core_share(2, 4), core_share(5)) == (4, 3, 1, 5)
    with pytest.raises(ValueError, match=r"local_processes=0 must be an integer >= 1"):
        core_share(8, 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(validation, "available_cores", lambda: 8)
    assert (default_threads(), default_threads(3)) == (8, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # torch took it when it started
    assert default_threads(3) is None


#: A hybrid layout (systemd's): v1 controllers each under a folder of its own, cgroup v2 at unified/.
HYBRID = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:29 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 31 0:30 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
36 31 0:33 / /sys/fs/cgroup/cpu rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,cpu,cpuacct
37 31 0:34 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,memory
"""


def _quota_files(files: dict[str, str]):
    """A reader of the files given (their stripped text; "" for any other), as ``cpu_quota_texts`` reads."""
    return lambda path: files.get(path, "").strip()


def test_the_cgroup_mounts_are_read_from_mountinfo():
    mounts = cgroup_mounts(HYBRID + "40 31 0:40 /docker/abc /mnt/my\\040cgroups rw - cgroup2 cgroup2 rw\n"
                           "not a mount line\n41 31 0:41 / /x rw - cgroup\n")  # the last: no fields after FSTYPE
    assert mounts == [CgroupMount("/", "/sys/fs/cgroup/unified", None),
                      CgroupMount("/", "/sys/fs/cgroup/systemd", frozenset({"rw", "xattr", "name=systemd"})),
                      CgroupMount("/", "/sys/fs/cgroup/cpu", frozenset({"rw", "cpu", "cpuacct"})),
                      CgroupMount("/", "/sys/fs/cgroup/memory", frozenset({"rw", "memory"})),
                      CgroupMount("/docker/abc", "/mnt/my cgroups", None),
                      CgroupMount("/", "/x", frozenset({"cgroup"}))]
    # a mount over another at the same mount point hides it
    assert cgroup_mounts("1 0 0:1 / /c rw - cgroup2 cgroup2 rw\n2 0 0:2 /job /c rw - cgroup2 cgroup2 rw\n") == [
        CgroupMount("/job", "/c", None)]


def test_a_v1_cpu_controller_is_read_where_it_is_mounted_whatever_its_folders_name():
    """Under /sys/fs/cgroup/cpu, not the cpu,cpuacct that /proc/self/cgroup lists; v2's under unified/."""
    files = {"/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "150000\n",
             "/sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000",
             "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
             "/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "50000",  # no such folder on this layout
             "/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000",
             "/sys/fs/cgroup/unified/job/cpu.max": "300000 100000", "/sys/fs/cgroup/job/cpu.max": "100000 100000"}
    cgroups = "12:memory:/job\n4:cpu,cpuacct:/job\n1:name=systemd:/job\n0::/job\n"
    assert sorted(cpu_quota_texts(cgroups, HYBRID, _quota_files(files))) == ["-1 100000", "150000 100000",
                                                                              "300000 100000"]
    assert quota_cpus(cpu_quota_texts(cgroups, HYBRID, _quota_files(files))) == 1.5


def test_a_mount_shows_its_root_cgroup_and_those_below_it_only():
    """A container's mount (Docker's, without a cgroup namespace) has its own cgroup as the mount's root, at the
    mount point; /proc/self/cgroup names it by the host's path. A path outside the root is not seen there."""
    mountinfo = "900 800 0:33 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    files = {"/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us":
             "100000", "/sys/fs/cgroup/cpu,cpuacct/sub/cpu.cfs_quota_us": "100000",
             "/sys/fs/cgroup/cpu,cpuacct/sub/cpu.cfs_period_us": "100000",
             # the host's path under the mount point is another cgroup's, if any
             "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000",
             "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"}
    read = _quota_files(files)
    assert cpu_quota_texts("4:cpu,cpuacct:/docker/abc\n", mountinfo, read) == ["200000 100000"]
    assert cpu_quota_texts("4:cpu,cpuacct:/docker/abc/sub\n", mountinfo, read) == ["200000 100000", "100000 100000"]
    for outside in ("/docker/abcd", "/docker", "/"):
        assert cpu_quota_texts(f"4:cpu,cpuacct:{outside}\n", mountinfo, read) == []
    # of two mounts of the hierarchy that show the cgroup, the one that shows most (the cgroups above it too)
    both = "1 0 0:33 / /host/cpu rw - cgroup cgroup rw,cpu\n" + mountinfo
    files = {"/host/cpu/cpu.cfs_quota_us": "-1", "/host/cpu/cpu.cfs_period_us": "100000",
             "/host/cpu/docker/cpu.cfs_quota_us": "400000", "/host/cpu/docker/cpu.cfs_period_us": "100000",
             "/host/cpu/docker/abc/cpu.cfs_quota_us": "200000", "/host/cpu/docker/abc/cpu.cfs_period_us": "100000"}
    assert cpu_quota_texts("4:cpu,cpuacct:/docker/abc\n", both, _quota_files(files)) == [
        "-1 100000", "400000 100000", "200000 100000"]


def test_without_a_cgroup_mount_in_mountinfo_the_cgroups_are_looked_for_under_sys_fs_cgroup():
    files = {"/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "300000",
             "/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000",
             "/sys/fs/cgroup/job/cpu.max": "200000 100000"}
    sysfs_only = "25 30 0:23 / /sys rw,nosuid - sysfs sysfs rw\n"
    for mountinfo in ("", sysfs_only):
        assert cpu_quota_texts("4:cpu,cpuacct:/job\n0::/job\n", mountinfo, _quota_files(files)) == [
            "300000 100000", "200000 100000"]
    # v2 mounted, v1's cpu hierarchy not: v1's looked for as before, v2's where it is mounted
    mountinfo = "32 31 0:29 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    assert cpu_quota_texts("4:cpu,cpuacct:/job\n0::/job\n", mountinfo, _quota_files(files)) == ["300000 100000"]
