"""SLURM host lists and task counts, expanded by hand (no scontrol on the machine)."""

from __future__ import annotations

import pytest

from distrun import UsageError
from distrun_cluster_env.nodelist import expand_nodelist, expand_tasks_per_node, first_host


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("cpu[098-101],gpu-[1,3]", ["cpu098", "cpu099", "cpu100", "cpu101", "gpu-1", "gpu-3"]),
    ("10.0.0.5,10.0.0.6", ["10.0.0.5", "10.0.0.6"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


def test_first_host_does_not_expand_the_whole_list():
    # A 100k-node range would be slow to expand in full; the first host is immediate.
    assert first_host("n[00000-99999],x1") == "n00000"


@pytest.mark.parametrize("bad", ["node[01-02", "node01]", "node[a-b]", "node[5-2]", ""])
def test_bad_nodelists_are_usage_errors(bad):
    with pytest.raises(UsageError):
        first_host(bad) if bad else first_host(",")


@pytest.mark.parametrize("value, counts", [
    ("2", [2]), ("2(x3)", [2, 2, 2]), ("2(x2),1", [2, 2, 1]), ("4,3(x2)", [4, 3, 3]),
])
def test_tasks_per_node(value, counts):
    assert expand_tasks_per_node(value) == counts
