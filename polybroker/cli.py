"""The ``polybroker`` command line: one subcommand per process kind.

Each subcommand is registered by a small function below that adds its parser and names the
function that runs it; the running code lives with its layer and is imported only when used.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from polybroker import __version__

Runner = Callable[[argparse.Namespace], int]


def _add_bookie(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bookie", help="run a storage node (bookie)")
    p.add_argument("--data-dir", required=True, help="journal, entry logs and index live here")
    p.add_argument("--port", type=int, default=None, help="listen port (bookiePort; 0 = any)")
    p.add_argument("--bind", default=None, help="bind address (bindAddress)")
    p.add_argument("--metadata", default=None, help="metadata store URL to register with")
    p.add_argument(
        "--allow-address-change",
        action="store_true",
        default=None,
        help="serve this data dir under a new address (allowBookieAddressChange): ledgers that "
        "name the old address lose this copy and are re-replicated from their other copies",
    )
    p.add_argument("--config", default=None, help="broker.conf-style key=value file")

    def run(args: argparse.Namespace) -> int:
        from polybroker.ledger.bookie.main import run_bookie

        return run_bookie(args)

    p.set_defaults(run=run)


def _add_broker_flags(p: argparse.ArgumentParser) -> None:
    """The listener ports and the config file, as standalone and broker both take them."""
    for flag, key, default in (
        ("--pulsar-port", "brokerServicePort", 6650),
        ("--http-port", "webServicePort", 8080),
        ("--kafka-port", "kafkaListenerPort", 9092),
        ("--mqtt-port", "mqttListenerPort", 1883),
        ("--amqp-port", "amqpListenerPort", 5672),
    ):
        p.add_argument(flag, type=int, default=None, help=f"{key} ({default}; 0 = any free port)")
    p.add_argument("--config", default=None, help="broker.conf-style key=value file")


def _add_standalone(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("standalone", help="run metadata store, bookie and broker in one process")
    p.add_argument("--data-dir", default=None, help="where data lives (dataDir; ./data)")
    p.add_argument("--bind", default=None, help="bind address (bindAddress; 127.0.0.1)")
    _add_broker_flags(p)

    def run(args: argparse.Namespace) -> int:
        from polybroker.standalone import run_standalone

        return run_standalone(args)

    p.set_defaults(run=run)


def _add_broker(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("broker", help="run a stateless cluster broker (needs ZooKeeper)")
    p.add_argument("--metadata", default=None, help="zk://host:port[,host:port][/chroot]")
    p.add_argument("--bind", default=None, help="bind address (bindAddress; 127.0.0.1)")
    p.add_argument("--advertised-address", default=None, help="host clients are told to use")
    p.add_argument("--cluster", default=None, help="cluster name (clusterName)")
    _add_broker_flags(p)

    def run(args: argparse.Namespace) -> int:
        from polybroker.broker import run_broker

        return run_broker(args)

    p.set_defaults(run=run)


def _add_initialize(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "initialize-cluster-metadata",
        help="create a cluster, tenant public and namespace public/default in ZooKeeper",
    )
    p.add_argument("--cluster", required=True, help="cluster name")
    p.add_argument("--metadata-store", required=True, help="zk://host:port[/chroot]")
    p.add_argument("--web-service-url", default=None, help="http://host:port of the cluster")
    p.add_argument("--broker-service-url", default=None, help="pulsar://host:port of the cluster")
    p.add_argument("--bundles", type=int, default=4, help="bundles of public/default (4)")

    def run(args: argparse.Namespace) -> int:
        from polybroker.broker import initialize_cluster_metadata

        return initialize_cluster_metadata(args)

    p.set_defaults(run=run)


def _add_client(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from polybroker import cli_client

    p = sub.add_parser("client", help="produce and consume messages, as pulsar-client does")
    cli_client.configure(p)

    def run(args: argparse.Namespace) -> int:
        return cli_client.run(args)

    p.set_defaults(run=run)


def _add_admin(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from polybroker import cli_admin

    p = sub.add_parser("admin", help="manage tenants, namespaces and topics, as pulsar-admin does")
    cli_admin.configure(p)

    def run(args: argparse.Namespace) -> int:
        return cli_admin.run(args)

    p.set_defaults(run=run)


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [  # type: ignore[type-arg]
    _add_bookie,
    _add_standalone,
    _add_broker,
    _add_initialize,
    _add_client,
    _add_admin,
]


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="polybroker", description=__doc__)
    parser.add_argument("--version", action="version", version=f"polybroker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    args = build_parser().parse_args(argv)
    runner: Runner = args.run
    return runner(args)


if __name__ == "__main__":
    sys.exit(main())
