"""The NCCL decision rules and their precedence, against fake node facts: no GPU needed."""

import re

import pytest

from ddp_project.config.error import ConfigError
from ddp_project.config.schema import NcclConfig
from ddp_project.nccl import decision as nccl
from ddp_project.nccl.probe import active_ib_ports, nvlink_pairs_from_topo


def facts(
    gpus=2, nvlink=((0, 1),), ib=0, world=2, local_world=2, shm=2**30, tests=None
) -> nccl.NodeFacts:
    return nccl.NodeFacts(gpus, frozenset(nvlink), ib, world, local_world, shm, tests or {})


AUTO = NcclConfig(auto=True)


def auto_env(node: nccl.NodeFacts) -> dict[str, str]:
    return nccl.decide(AUTO, node, inherited={}).env


def test_auto_keeps_p2p_between_nvlink_gpus():
    decision = nccl.decide(AUTO, facts(), inherited={})
    assert decision.env == {"NCCL_IB_DISABLE": "1"}
    assert "NVLink between GPU0-GPU1" in decision.settings["NCCL_P2P_DISABLE"].source


def test_auto_keeps_p2p_on_a_pcie_pair_whose_copy_works():
    node = facts(nvlink=(), tests={(0, 1): "ok"})
    decision = nccl.decide(AUTO, node, inherited={})
    assert decision.env == {"NCCL_IB_DISABLE": "1"}
    assert (
        "PCIe P2P copy verified between GPU0-GPU1" in decision.settings["NCCL_P2P_DISABLE"].source
    )


@pytest.mark.parametrize("outcome", ["hang", "failed"])
def test_auto_disables_p2p_on_a_pcie_pair_whose_copy_hangs_or_fails(outcome):
    decision = nccl.decide(AUTO, facts(nvlink=(), tests={(0, 1): outcome}), inherited={})
    assert decision.env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert f"GPU0-GPU1 {outcome}" in decision.settings["NCCL_P2P_DISABLE"].source


def test_auto_leaves_p2p_alone_where_one_process_uses_one_gpu_of_the_node():
    """No peer traffic inside the node: a broken pair there is no reason to change P2P."""
    node = facts(nvlink=(), world=2, local_world=1, tests={(0, 1): "hang"})
    decision = nccl.decide(AUTO, node, inherited={})
    assert decision.env == {"NCCL_IB_DISABLE": "1"}
    assert "NCCL_P2P_DISABLE" not in decision.settings


def test_auto_on_mixed_links_keeps_nvlink_and_drops_only_broken_pcie():
    node = facts(
        gpus=4,
        nvlink=((0, 1), (2, 3)),
        world=4,
        local_world=4,
        tests={(0, 2): "ok", (0, 3): "hang", (1, 2): "ok", (1, 3): "ok"},
    )
    decision = nccl.decide(AUTO, node, inherited={})
    assert decision.env == {"NCCL_P2P_LEVEL": "NVL", "NCCL_IB_DISABLE": "1"}
    assert "NCCL_P2P_DISABLE" not in decision.env
    assert "GPU0-GPU3 hang" in decision.settings["NCCL_P2P_LEVEL"].source


def test_auto_on_mixed_links_with_working_pcie_changes_nothing():
    node = facts(
        gpus=3, nvlink=((0, 1),), world=3, local_world=3, tests={(0, 2): "ok", (1, 2): "ok"}
    )
    assert auto_env(node) == {"NCCL_IB_DISABLE": "1"}


def test_auto_single_gpu_sets_only_ib():
    assert auto_env(facts(gpus=1, nvlink=(), world=1, local_world=1)) == {"NCCL_IB_DISABLE": "1"}


@pytest.mark.parametrize(("ib_ports", "expected"), [(0, {"NCCL_IB_DISABLE": "1"}), (2, {})])
def test_auto_several_nodes_keeps_ib_only_when_active(ib_ports, expected):
    assert auto_env(facts(ib=ib_ports, world=8, local_world=2)) == expected


def test_infiniband_profile_forces_ib_on_and_keeps_the_probes_p2p_choices(compose_train):
    from omegaconf import OmegaConf

    profile = OmegaConf.to_object(
        compose_train("nccl=infiniband", "nccl.ib_hca='mlx5_0,mlx5_1'", "nccl.ib_gid_index=3")
    ).nccl
    # No active port seen (e.g. /sys/class/infiniband not mounted): auto alone would turn IB off.
    node = facts(nvlink=(), ib=0, world=8, local_world=2, tests={(0, 1): "hang"})
    decision = nccl.decide(profile, node, inherited={})
    assert decision.env == {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_P2P_DISABLE": "1",  # the broken PCIe pair, from the probe
    }
    assert decision.settings["NCCL_IB_DISABLE"].source == "config nccl.ib_disable"


def test_small_dev_shm_stops_with_the_kubernetes_fix_when_shm_will_carry_traffic():
    node = facts(nvlink=(), shm=64 * 2**20, tests={(0, 1): "hang"})
    message = nccl.shm_error(node, auto_env(node))
    assert "/dev/shm is 64 MiB" in message and "needs about 256 MiB" in message
    assert "emptyDir with medium: Memory at /dev/shm" in message


def test_small_dev_shm_is_fine_where_p2p_or_no_shm_carries_traffic():
    small = 64 * 2**20
    assert nccl.shm_error(facts(shm=small), auto_env(facts(shm=small))) is None  # NVLink P2P
    assert (
        nccl.shm_error(facts(shm=small), {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}) is None
    )
    assert nccl.shm_error(facts(shm=small, local_world=1), {"NCCL_P2P_DISABLE": "1"}) is None
    assert nccl.shm_error(facts(shm=2**30), {"NCCL_P2P_DISABLE": "1"}) is None


def test_shm_need_follows_nccl_buffsize():
    assert nccl.shm_needed_bytes(2, {"NCCL_BUFFSIZE": str(2**20)}) == 2 * 16 * 2 * 2**20


def test_facts_survive_the_trip_between_local_ranks():
    node = facts(gpus=3, nvlink=((0, 1),), tests={(0, 2): "hang", (1, 2): "ok"})
    assert nccl.NodeFacts.from_json(node.to_json()) == node


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
        p2p_disable=False,
        p2p_level="PIX",
        ib_disable=True,
        shm_disable=False,
        socket_ifname="^lo,docker",
        debug="INFO",
        debug_subsys="INIT,NET",
        env={"NCCL_ALGO": "Ring"},
    )
    assert nccl.decide(cfg, None, inherited={}).env == {
        "NCCL_P2P_DISABLE": "0",
        "NCCL_P2P_LEVEL": "PIX",
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
    shared = facts(gpus=4, nvlink=(), world=4, local_world=4, tests={(0, 1): "hang"}).to_json()
    envs = [
        nccl.decide(AUTO, nccl.NodeFacts.from_json(shared), {"NCCL_DEBUG": "WARN"}).env
        for _ in range(4)
    ]
    assert all(env == envs[0] for env in envs)
    assert envs[0]["NCCL_P2P_DISABLE"] == "1"


@pytest.mark.parametrize(
    ("torch_version", "buffer_var"),
    [
        ("2.11.0+cu130", "TORCH_FR_BUFFER_SIZE"),
        ("2.13.0", "TORCH_FR_BUFFER_SIZE"),
        ("2.10.1", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
        ("2.9.0a0+git1234", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    ],
)
def test_the_flight_recorders_buffer_goes_by_the_name_the_torch_version_reads(
    torch_version, buffer_var
):
    assert nccl.flight_recorder_env("/t_", torch_version)[buffer_var] == "2000"


def test_flight_recorder_defaults_yield_to_the_environment():
    defaults = nccl.flight_recorder_env("/run/nccl/trace_rank_", "2.11.0")
    decision = nccl.decide(
        NcclConfig(), None, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, defaults=defaults
    )
    assert decision.env == {**defaults, "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def test_explicit_async_error_handling_beats_torchruns_default_quietly():
    assert nccl.explicit_settings(None) == {}
    explicit = nccl.explicit_settings(2)
    quiet = nccl.decide(
        NcclConfig(), None, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, explicit=explicit
    )
    assert quiet.env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"} and quiet.warnings == ()
    assert "over torchrun's default 1" in quiet.settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"].source
    loud = nccl.decide(
        NcclConfig(), None, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, explicit=explicit
    )
    assert "overrides TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in loud.warnings[0]


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


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"env": {"NCCL_ALGO": "Ring\nTree"}}, "nccl.env.NCCL_ALGO='Ring\\nTree': holds a control"),
        ({"socket_ifname": "eth0 "}, "nccl.socket_ifname='eth0 ': spaces at its ends"),
        ({"ib_hca": "x" * 4097}, "nccl.ib_hca: 4097 characters;"),
        ({"env": {"NCCL_ALGO": True}}, "nccl.env.NCCL_ALGO=True: NCCL reads a number here"),
        ({"ib_gid_index": -2}, "nccl.ib_gid_index=-2: must be -1 (NCCL picks) to 255"),
        ({"p2p_level": "nvl"}, "nccl.p2p_level=nvl: must be one of LOC, NVL,"),
    ],
)
def test_values_no_environment_variable_can_hold_are_refused(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        NcclConfig(**fields)


def test_a_null_env_entry_sets_nothing():
    cfg = NcclConfig(env={"NCCL_ALGO": None, "NCCL_PROTO": "LL"})
    assert nccl.decide(cfg, None, inherited={"NCCL_ALGO": "Tree"}).env == {
        "NCCL_ALGO": "Tree",
        "NCCL_PROTO": "LL",
    }


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
