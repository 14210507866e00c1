"""Where a node is (flags, torchrun's and SLURM's variables), the node token, sealed values on
the coordinator's store (read and written by a second client, as another local user would),
and a node's files packed for it (tunekit.trials.nodes)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from tunekit.runtime.dist import free_port
from tunekit.trials.nodes import (
    PREFIX,
    Channel,
    Coordinator,
    Endpoint,
    NodesError,
    Refusals,
    _Watch,
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


def other_client(store) -> TCPStore:
    """Another process's view of the port: a second client, no token."""
    return TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))


def plant(spy: TCPStore, key: str, value) -> None:
    """Write as another client, then read it back on that client: a set is not answered, so
    without the read another connection's next get may reach the server first."""
    spy.set(key, value)
    assert spy.get(key) == (value.encode() if isinstance(value, str) else value)


def test_a_reader_of_the_port_lists_the_keys_but_reads_no_value(store):
    said: list[str] = []
    ours = Channel(store, "secret-1", run="run-a", refusals=Refusals(said.append))
    ours.put("job/0", {"kind": "trial", "spec": {"workload": "private/train.py:fn"}})
    assert Channel(store, "secret-1", run="run-a").get("job/0") == {
        "kind": "trial",
        "spec": {"workload": "private/train.py:fn"},
    }
    assert ours.get("job/1") is None  # nothing there yet: no wait
    spy = other_client(store)
    assert spy.list_keys() == [PREFIX + "job/0"]  # the names are there to see ...
    raw = spy.get(PREFIX + "job/0")
    assert (
        b"private" not in raw and b"trial" not in raw and b"workload" not in raw
    )  # ... not what they hold
    assert not said


def test_forged_moved_replayed_and_foreign_values_are_ignored_counted_and_said(store):
    said: list[str] = []
    refusals = Refusals(said.append)
    ours = Channel(store, "secret-1", run="run-a", refusals=refusals)
    spy = other_client(store)
    ours.put("job/0", {"kind": "trial"})
    # Plain text where a sealed value belongs.
    plant(spy, PREFIX + "job/1", json.dumps({"kind": "trial", "spec": {"workload": "evil.py:fn"}}))
    assert ours.get("job/1") is None
    # A sealed value of ours moved to another key.
    plant(spy, PREFIX + "job/2", spy.get(PREFIX + "job/0"))
    assert ours.get("job/2") is None
    # Written with another token, or for another run of the study with ours.
    Channel(spy, "secret-2", run="run-a").put("job/3", {"kind": "end"})
    assert spy.get(PREFIX + "job/3")  # answered: the put reached the server
    assert ours.get("job/3") is None
    Channel(spy, "secret-1", run="run-b").put("job/4", {"kind": "end"})
    assert spy.get(PREFIX + "job/4")
    assert ours.get("job/4") is None
    # An earlier value of this very key and run, written again after a newer one was read.
    old = spy.get(PREFIX + "job/0")
    ours.put("job/0", {"kind": "end"})
    assert ours.get("job/0") == {"kind": "end"}
    plant(spy, PREFIX + "job/0", old)
    assert ours.get("job/0") is None
    assert refusals.count == 5 and len(said) == 5
    assert "not a tunekit value" in said[0] and "replay" in said[-1]
    assert all(s.startswith("ignored the value at job/") for s in said)
    # Read again and again (a follower polls the key it waits on), each is counted once.
    for _ in range(3):
        assert ours.get("job/1") is None
    assert refusals.count == 5
    assert "5 value(s)" in refusals.summary()
    # A deleted key reads as none, without waiting for it.
    spy.delete_key(PREFIX + "job/2")
    assert ours.get("job/2") is None


def test_a_heartbeat_written_again_by_another_process_does_not_keep_a_node_alive(store):
    beats = Channel(store, "secret-1", run="run-a")
    watcher = Channel(store, "secret-1", run="run-a")
    beats.put("node/1/beat", {})
    watch = _Watch(watcher, "node/1/beat")
    beats.put("node/1/beat", {})
    watch.silent_s()
    moved = watch.moved
    spy = other_client(store)
    last = spy.get(PREFIX + "node/1/beat")
    for _ in range(5):  # the node is gone; another process writes its last beat again and again
        plant(spy, PREFIX + "node/1/beat", last)
        watch.silent_s()
        plant(spy, PREFIX + "node/1/beat", b"1")
        watch.silent_s()
    assert watch.moved == moved  # it stood still since its last real beat
    beats.put("node/1/beat", {})
    watch.silent_s()
    assert watch.moved > moved


def test_a_new_run_of_the_coordinator_ignores_what_the_last_one_wrote():
    """Same token, same port, after --resume: a value of the earlier run is not this one's."""
    token, port = "0123456789abcdef" * 4, free_port()
    first = Coordinator(parse_endpoint(f"127.0.0.1:{port}"), 2, token)
    first.stop(0)
    spy = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    captured = {k: spy.get(k) for k in (PREFIX + "job/0/stop", PREFIX + "run")}
    del spy
    first.beat.stop()
    first.beat.thread.join()
    del first
    said: list[str] = []
    second = Coordinator(parse_endpoint(f"127.0.0.1:{free_port()}"), 2, token, say=said.append)
    spy = TCPStore(
        "127.0.0.1", second.endpoint.port, is_master=False, timeout=timedelta(seconds=10)
    )
    for key, value in captured.items():
        spy.set(key, value)
    follower_view = Channel(spy, token, run=second.run, refusals=second.refusals)
    assert follower_view.get("job/0/stop") is None
    assert said and "job/0/stop" in said[0]
    second.beat.stop()


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


def test_the_docs_give_every_follower_its_token_and_name_every_slurm_variable_read():
    """Issue 34, item 9: the live job's follower line had no token (it failed as written), and
    the SLURM section did not name SLURM_STEP_ID, without which each task studies alone."""
    import inspect
    import re
    from pathlib import Path

    from tunekit.trials import nodes

    doc = (Path(__file__).resolve().parents[2] / "docs" / "multinode.md").read_text()
    follows = [ln for ln in doc.splitlines() if ln.strip().startswith("tunekit follow ")]
    assert len(follows) >= 2 and all("--token-file" in ln for ln in follows), follows
    slurm = doc.split("\n## SLURM")[1].split("\n## ")[0]
    read = set(re.findall(r"SLURM_[A-Z_]+", inspect.getsource(nodes.node_place)))
    assert "SLURM_STEP_ID" in read and read <= set(re.findall(r"SLURM_[A-Z_]+", slurm))
    assert "TUNEKIT_NODE_TOKEN" in slurm
