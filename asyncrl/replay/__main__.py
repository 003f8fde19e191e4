"""`python -m asyncrl.replay serve --config X.yaml [key.sub=value ...]`: a standalone buffer server.

Prints `address: tcp://...` once bound (and writes it to --address-file if given), then serves until
SIGINT/SIGTERM. Uses `cfg.buffer` and B = `cfg.data.rollout_batch_size` (or --batch-size).
`--restore PATH` loads a snapshot before serving; `--snapshot-on-exit PATH` writes one at shutdown.
`--log PATH` keeps the durable log there (`buffer.durable`); `--recover` rebuilds the state from it
(a restart after the previous server died; pass the same `buffer.port`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from asyncrl.cli import add_config_args, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a replay buffer server")
    add_config_args(serve)
    serve.add_argument("--batch-size", type=int, default=None, help="B of the admission rule (groups per step)")
    serve.add_argument("--address-file", default=None, help="write the bound address to this file")
    serve.add_argument("--restore", default=None, help="snapshot to load before serving")
    serve.add_argument("--snapshot-on-exit", default=None, help="snapshot to write at shutdown")
    serve.add_argument("--log", default=None, help="durable log file (acknowledged groups survive a crash)")
    serve.add_argument("--recover", action="store_true", help="rebuild the state from --log before serving")
    serve.add_argument("--secret-file", default=None, help="write the buffer's secret (clients sign requests with it) to "
                       "this new file, readable by this user only; ASYNCRL_BUFFER_SECRET sets the secret instead")
    args = parser.parse_args(argv)
    cfg = config_from_args(args, require_files=False)

    from asyncrl.replay.server import ReplayBufferServer

    secret = os.environ.get("ASYNCRL_BUFFER_SECRET")  # the environment: never on a command line others can read
    if secret:
        cfg.buffer.secret = secret
    if args.secret_file:  # created readable by this user only
        fd = os.open(args.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cfg.buffer.secret)
    server = ReplayBufferServer(cfg.buffer, batch_size=args.batch_size or cfg.data.rollout_batch_size,
                                log_path=args.log, recover=args.recover)
    if args.restore:
        server.restore(args.restore)
    address = server.start()
    if args.address_file:
        tmp = Path(args.address_file + ".tmp")
        tmp.write_text(address)
        tmp.replace(args.address_file)
    print(f"address: {address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    server.stop()
    if args.snapshot_on_exit:
        server.snapshot(args.snapshot_on_exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
