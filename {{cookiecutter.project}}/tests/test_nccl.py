"""The NCCL decision rules and their precedence, against fake node facts: no GPU needed."""

import pytest

from {{ cookiecutter.package }} import nccl
from {{ cookiecutter.package }}.config import ConfigError, NcclConfig
from {{ cookiecutter.package }}.probe import active_ib_ports, nvlink_pairs_from_topo


def facts(gpus=2, nvlink=((0, 1),), ib=0, world=2, local_world=2) -> nccl.NodeFacts:
    return nccl.NodeFacts(gpus, frozenset(nvlink), ib, world, local_world)


AUTO = NcclConfig(auto=True)


def test_auto_keeps_p2p_between_nvlink_gpus():
    decision = nccl.decide(AUTO, facts(), inherited={})
    assert "NCCL_P2P_DISABLE" not in decision.env
    assert "NVLink between GPU0-GPU1" in decision.settings["NCCL_P2P_DISABLE"].source


def test_auto_on_mixed_links_never_disables_p2p():
    node = facts(gpus=4, nvlink=((0, 1), (2, 3)), world=4, local_world=4)
    decision = nccl.decide(AUTO, node, inherited={})
    assert "NCCL_P2P_DISABLE" not in decision.env
    source = decision.settings["NCCL_P2P_DISABLE"].source
    assert "GPU0-GPU1, GPU2-GPU3" in source and "PCIe between GPU0-GPU2" in source


def test_auto_single_node_disables_ib():
    assert nccl.decide(AUTO, facts(), inherited={}).env == {"NCCL_IB_DISABLE": "1"}


@pytest.mark.parametrize(("ib_ports", "expected"), [(0, {"NCCL_IB_DISABLE": "1"}), (2, {})])
def test_auto_several_nodes_keeps_ib_only_when_active(ib_ports, expected):
    node = facts(ib=ib_ports, world=8, local_world=2)
    assert nccl.decide(AUTO, node, inherited={}).env == expected


def test_auto_single_gpu_sets_only_ib():
    node = facts(gpus=1, nvlink=(), world=1, local_world=1)
    assert nccl.decide(AUTO, node, inherited={}).env == {"NCCL_IB_DISABLE": "1"}


def test_nccl_default_sets_nothing_even_with_facts():
    assert nccl.decide(NcclConfig(), facts(), inherited={}).env == {}


def test_pcie_safe_fields_map_one_to_one():
    cfg = NcclConfig(p2p_disable=True, ib_disable=True)
    assert nccl.decide(cfg, None, inherited={}).env == {
        "NCCL_P2P_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
    }


def test_every_field_and_env_map_reach_the_environment():
    cfg = NcclConfig(
        p2p_disable=False, ib_disable=True, shm_disable=False, socket_ifname="^lo,docker",
        debug="INFO", debug_subsys="INIT,NET", env={"NCCL_ALGO": "Ring"},
    )  # fmt: skip
    assert nccl.decide(cfg, None, inherited={}).env == {
        "NCCL_P2P_DISABLE": "0",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SHM_DISABLE": "0",
        "NCCL_SOCKET_IFNAME": "^lo,docker",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_ALGO": "Ring",
    }


def test_inherited_env_beats_auto_choice():
    decision = nccl.decide(AUTO, facts(), inherited={"NCCL_IB_DISABLE": "0"})
    assert decision.env["NCCL_IB_DISABLE"] == "0"
    assert decision.settings["NCCL_IB_DISABLE"].source.startswith("environment (over auto")
    assert decision.warnings == ()


def test_explicit_field_beats_inherited_env_and_warns_with_both_values():
    cfg = NcclConfig(p2p_disable=True)
    decision = nccl.decide(cfg, None, inherited={"NCCL_P2P_DISABLE": "0", "PATH": "/bin"})
    assert decision.env == {"NCCL_P2P_DISABLE": "1"}
    (warning,) = decision.warnings
    assert "nccl.p2p_disable=1" in warning and "NCCL_P2P_DISABLE=0" in warning


def test_agreeing_inherited_value_gives_no_warning():
    decision = nccl.decide(NcclConfig(ib_disable=True), None, {"NCCL_IB_DISABLE": "1"})
    assert decision.warnings == ()


def test_every_rank_gets_the_same_env():
    inherited = {"NCCL_DEBUG": "WARN"}
    envs = {
        rank: nccl.decide(AUTO, facts(world=4, local_world=4), dict(inherited)).env
        for rank in range(4)
    }
    assert len({tuple(sorted(env.items())) for env in envs.values()}) == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NCCL_P2P_DISABLE": "1"}, "nccl.env.NCCL_P2P_DISABLE: set it with nccl.p2p_disable"),
        ({"CUDA_VISIBLE_DEVICES": "0"}, "nccl.env.CUDA_VISIBLE_DEVICES: keys must be NCCL_*"),
    ],
)
def test_env_map_refuses_non_nccl_and_shadowed_keys(env, message):
    with pytest.raises(ConfigError, match=message):
        NcclConfig(env=env)


TOPO_NV18 = """\
        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NV18    0-31    0               N/A
GPU1    NV18     X      0-31    0               N/A
"""
TOPO_PCIE = """\
        GPU0    GPU1    GPU2    CPU Affinity
GPU0     X      PHB     NV4     0-15
GPU1    PHB      X      SYS     0-15
GPU2    NV4     SYS      X      0-15
"""


def test_topology_parser_finds_nvlink_pairs_only():
    assert nvlink_pairs_from_topo(TOPO_NV18) == {(0, 1)}
    assert nvlink_pairs_from_topo(TOPO_PCIE) == {(0, 2)}
    assert nvlink_pairs_from_topo("") == frozenset()


def test_active_ib_ports_reads_sysfs(tmp_path):
    for device, state in [("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")]:
        port = tmp_path / device / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
    assert active_ib_ports(tmp_path) == 1
    assert active_ib_ports(tmp_path / "missing") == 0
