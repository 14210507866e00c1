"""Where a node is (flags, torchrun's and SLURM's variables), the node token, signed values on
the coordinator's store, and a node's files packed for it (tunekit.trials.nodes)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from tunekit.runtime.dist import free_port
from tunekit.trials.nodes import (
    Channel,
    Endpoint,
    NodesError,
    first_host,
    make_token,
    node_place,
    pack_files,
    parse_endpoint,
    read_token,
    unpack_files,
)

SRUN = {
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NODELIST": "gpu[07-09]",
    "SLURM_NODEID": "2",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
}


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("gpu[03-05,07],cpu1", "gpu03"),
        ("a,b[1-2]", "a"),
        ("n1", "n1"),
        ("rack1-n[0012,0040]", "rack1-n0012"),
        ("10.0.0.5", "10.0.0.5"),
    ],
)
def test_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_endpoints_parse_or_fail_in_one_line():
    assert parse_endpoint("node0:1234") == Endpoint("node0", 1234)
    assert parse_endpoint("node0") == Endpoint("node0", 29400)
    assert parse_endpoint("[::1]:80") == Endpoint("::1", 80)
    for bad in ("", ":12", "h:port", "h:70000"):
        with pytest.raises(NodesError, match="HOST:PORT"):
            parse_endpoint(bad)


def test_a_srun_task_takes_its_place_from_slurm():
    place = node_place(None, None, None, env=SRUN)
    assert (place.nnodes, place.node_rank, place.endpoint) == (3, 2, "gpu07:29400")
    place = node_place(None, None, None, env={**SRUN, "MASTER_PORT": "4000"})
    assert place.endpoint == "gpu07:4000"


def test_flags_win_over_the_environment_and_torchrun_variables_count():
    place = node_place(2, 0, "head:5000", env=SRUN)
    assert (place.nnodes, place.node_rank, place.endpoint) == (2, 0, "head:5000")
    env = {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "6000", "NODE_RANK": "1", "NNODES": "2"}
    place = node_place(None, None, None, env=env)
    assert (place.nnodes, place.node_rank, place.endpoint) == (2, 1, "10.1.1.1:6000")


def test_a_batch_scripts_own_shell_is_one_node():
    """Outside an srun step the allocation's node count does not make tunekit wait for followers."""
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    place = node_place(None, None, None, env=batch)
    assert (place.nnodes, place.node_rank, place.endpoint) == (1, 0, None)


def test_a_bad_place_is_one_line():
    with pytest.raises(NodesError, match="not below the node count"):
        node_place(2, 2, "h:1", env={})
    with pytest.raises(NodesError, match="coordinator's address"):
        node_place(2, 0, None, env={})
    with pytest.raises(NodesError, match=r"\$NODE_RANK must be a whole number"):
        node_place(None, None, None, env={"NODE_RANK": "one"})
    follower = node_place(None, 3, "h:1", env={}, follower=True)  # a follower needs no node count
    assert (follower.node_rank, follower.endpoint) == (3, "h:1")


def test_the_token_is_private_and_read_from_a_file_or_the_environment(tmp_path):
    path = make_token(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    token = path.read_text()
    assert len(token) == 64
    assert read_token(path, env={}) == token
    assert read_token(None, env={"TUNEKIT_NODE_TOKEN": " abc "}) == "abc"
    assert read_token(None, env={}) is None
    with pytest.raises(NodesError, match="cannot read the node token"):
        read_token(tmp_path / "missing", env={})
    assert make_token(tmp_path).read_text() != token  # a fresh one each time


@pytest.fixture
def store():
    port = free_port()
    return TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def test_signed_values_round_trip_and_forgeries_are_refused(store):
    ours = Channel(store, "secret-1")
    ours.put("job/0", {"kind": "trial", "spec": {"workload": "example:cnn"}})
    assert Channel(store, "secret-1").get("job/0") == {
        "kind": "trial",
        "spec": {"workload": "example:cnn"},
    }
    assert ours.get("job/1") is None  # nothing there yet: no wait
    # Another token sees other keys: it cannot find ours...
    assert Channel(store, "secret-2").get("job/0") is None
    # ...and a value written at our key without our token is refused, not run.
    body = json.dumps({"kind": "trial", "spec": {"workload": "evil.py:fn"}})
    store.set(ours.prefix + "job/1", json.dumps({"body": body, "mac": "0" * 64}))
    with pytest.raises(NodesError, match="not signed with this study's node token"):
        ours.get("job/1")
    # A value moved to another key does not verify there either (the key is signed too).
    store.set(ours.prefix + "job/2", store.get(ours.prefix + "job/0"))
    with pytest.raises(NodesError, match="not signed"):
        ours.get("job/2")
    store.set(ours.prefix + "job/3", "not json")
    with pytest.raises(NodesError, match="not tunekit's"):
        ours.get("job/3")
    assert ours.bump("beat") == 1 and ours.bump("beat") == 2 and ours.count("beat") == 2


def test_a_nodes_files_travel_packed_and_cannot_leave_the_trial_folder(tmp_path):
    sent, got = tmp_path / "node1" / "job000", tmp_path / "coordinator" / "000-baseline"
    (sent / "traces").mkdir(parents=True)
    (sent / "faults").mkdir()
    (sent / "rank1.json").write_text('{"rank": 1, "status": "ok"}')
    (sent / "agent0.json").write_text('{"failures": []}')
    (sent / "agent0.log").write_bytes(b"log line\n" * 1000)
    (sent / "traces" / "rank1.json").write_text("{}")
    (sent / "faults" / "rank1.txt").write_text("Fatal Python error")
    (sent / "spec.json").write_text("{}")  # not shipped: the coordinator wrote its own
    packed = pack_files(sent, node_rank=1, returncode=0)
    assert packed["returncode"] == 0
    assert sorted(packed["files"]) == [
        "agent1.json",
        "agent1.log",
        "faults/rank1.txt",
        "rank1.json",
        "traces/rank1.json",
    ]
    got.mkdir(parents=True)
    unpack_files(json.loads(json.dumps(packed)), got, 1)
    assert (got / "rank1.json").read_text() == '{"rank": 1, "status": "ok"}'
    assert (got / "agent1.log").read_bytes() == b"log line\n" * 1000
    assert not (got / "spec.json").exists()
    evil = {"files": {"../../outside.txt": packed["files"]["rank1.json"]}}
    with pytest.raises(NodesError, match="outside its trial folder"):
        unpack_files(evil, got, 1)
    assert not (tmp_path / "outside.txt").exists()


def test_the_slowest_node_is_named_from_its_ranks_compute():
    from tunekit.trials.nodes import describe_slowest, node_summary

    hellos = {
        0: {"host": "a", "cores": 8, "gpus": ["H100"]},
        1: {"host": "b", "cores": 8, "gpus": ["H100"]},
        2: {"host": "c", "cores": 8, "gpus": []},
    }
    compute = {
        0: 0.10,
        1: 0.12,
        2: 0.14,
        3: 0.16,
        4: 0.10,
    }  # 2 ranks a node; node 2's second rank untimed
    summary = node_summary(
        hellos, 2, compute, {0: {"host": {"system_cpu_pct_mean": 55.0}}, 1: None}
    )
    assert [row["compute_s"] for row in summary["rows"]] == pytest.approx([0.11, 0.15, 0.10])
    assert [row["cpu_pct_mean"] for row in summary["rows"]] == [55.0, None, None]
    assert summary["slowest"] == {"node": 1, "host": "b", "ratio": pytest.approx(1.5), "fastest": 2}
    assert describe_slowest(summary).startswith(
        "slowest node: node 1 (b), whose ranks compute 1.50x"
    )
    assert describe_slowest(node_summary({0: hellos[0]}, 2, compute, {})) == ""
    alike = node_summary(hellos, 2, {0: 0.100, 1: 0.100, 2: 0.103, 3: 0.103}, {})
    assert "computed alike" in describe_slowest(alike)
