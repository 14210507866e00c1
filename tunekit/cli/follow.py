"""``tunekit follow``: this node's part of a study coordinated by another node."""

from __future__ import annotations

from pathlib import Path

import click

from tunekit.cli.common import DURATION, STORE_OPTION, console, ensure_writable, stops_on_sigterm


def node_options(command):
    """--nnodes, --node-rank and --rdzv-endpoint: where this node sits in a job across machines."""
    for option in reversed(
        (
            click.option(
                "--nnodes",
                type=click.IntRange(min=1),
                default=None,
                help="Nodes (default: 1, or $NNODES / $SLURM_STEP_NUM_NODES).",
            ),
            click.option(
                "--node-rank",
                type=click.IntRange(min=0),
                default=None,
                help="This node's rank: 0 coordinates, the others follow (default: $NODE_RANK / "
                "$SLURM_NODEID, else 0).",
            ),
            click.option(
                "--rdzv-endpoint",
                default=None,
                metavar="HOST:PORT",
                help="Where node 0 hosts the coordinator (default: MASTER_ADDR:MASTER_PORT, or "
                "SLURM's first node).",
            ),
        )
    ):
        command = option(command)
    return command


TOKEN_FILE_OPTION = click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The node token (default: $TUNEKIT_NODE_TOKEN; the coordinator makes one in its --store as node-token).",
)
JOIN_TIMEOUT_OPTION = click.option(
    "--join-timeout",
    "join_timeout_s",
    type=DURATION,
    default=300.0,
    help="How long nodes wait for each other before giving up [default: 5m].",
)


@click.command("follow")
@click.option(
    "--coordinator",
    "--rdzv-endpoint",
    "endpoint",
    default=None,
    metavar="HOST:PORT",
    help="The coordinator's rendezvous endpoint (default: MASTER_ADDR:MASTER_PORT, or SLURM's first node).",
)
@click.option(
    "--node-rank",
    type=click.IntRange(min=1),
    default=None,
    help="This node's rank, 1 or more (default: $NODE_RANK or $SLURM_NODEID).",
)
@TOKEN_FILE_OPTION
@STORE_OPTION
@JOIN_TIMEOUT_OPTION
@stops_on_sigterm
def follow_cmd(endpoint, node_rank, token_file, store_dir, join_timeout_s):
    """Follow the coordinator at HOST:PORT: run this node's torchrun agent for every trial it announces."""
    from tunekit.trials.nodes import node_place

    place = node_place(None, node_rank, endpoint, follower=True)
    run_follower(place.endpoint, place.node_rank, token_file, store_dir, join_timeout_s)


def run_follower(
    endpoint: str | None,
    node_rank: int,
    token_file: Path | None,
    store_dir: Path,
    join_timeout_s: float,
) -> None:
    """Follow until the coordinator ends the study; a NodesError (one line) when it is gone."""
    from tunekit.trials.nodes import Follower, NodesError, parse_endpoint, read_token

    if not endpoint:
        raise NodesError(
            "a follower needs the coordinator's address: --coordinator HOST:PORT "
            "(or MASTER_ADDR/MASTER_PORT, or run inside a SLURM allocation)"
        )
    if node_rank < 1:
        raise NodesError(
            "node 0 is the coordinator: run `tunekit auto` there, and follow on nodes 1 and up"
        )
    token = read_token(token_file)
    if token is None:
        raise NodesError(
            "no node token: pass --token-file (the coordinator wrote one to its store folder as "
            "node-token) or set $TUNEKIT_NODE_TOKEN"
        )
    work_dir = ensure_writable(
        Path(store_dir) / "nodes" / f"node{node_rank}", "the follower's folder (--store)"
    )
    Follower(
        parse_endpoint(endpoint),
        node_rank,
        token,
        work_dir,
        join_timeout_s=join_timeout_s,
        say=lambda line: console.print(line),
    ).run()
