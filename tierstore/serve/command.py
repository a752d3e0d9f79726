"""``tierstore serve --config node.yaml [--socket PATH]``: run a node server until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="node config: tiers (the first one host) and a serve: section")
    parser.add_argument("--socket", help="socket path (default: serve.socket, else /run/tierstore/tierstore.sock)")


def run(args: argparse.Namespace) -> int:
    from .server import NodeServer

    server = NodeServer(args.config, args.socket)
    if server.config.threads is not None:  # this process is the server's own (an embedded NodeServer leaves it)
        import torch

        torch.set_num_threads(server.config.threads)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    print(f"tierstore serve: {len(server.store.tiers)} tiers "
          f"({' > '.join(lv.name for lv in server.store.tiers)}) on unix://{server.config.socket}", flush=True)
    stop.wait()
    server.close()
    return 0
