"""The ``tierstore`` command line: verbs ``demo``, ``serve``, ``bench``, ``stats``, ``verify``, ``gc``, ``crashtest``
and ``keygen``.

Each verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only wires them up, importing a verb's module when it runs. An error from a verb's inputs (a config that
cannot be read, a directory another process holds, a file that exists) is one line on stderr,
``tierstore <verb>: <message>``, and exit status 2; ``-v`` (before or after the verb) shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn

from . import __version__
from .cliargs import one_line
from .errors import TierstoreError

DESCRIPTION = ("tierstore: a tensor store over GPU, host, disk and remote (S3) tiers, for KV caches and model "
               "weights. Run `tierstore VERB --help` for a verb's options.")
#: errors from a verb's inputs that are reported in one line (everything else keeps its traceback)
USER_ERRORS = (TierstoreError, OSError, ValueError)
#: a verb's module that lives in an adapter package, and how to install it
_ADAPTERS = {"tierstore_vllm": "pip install ./adapters/vllm (and vLLM)",
             "tierstore_sglang": "pip install ./adapters/sglang (and SGLang)"}

VERBS = {
    "demo": ("tierstore.demo", "multi-round chat with a small transformer, KV served from the store"),
    "stats": ("tierstore.admin", "print what each disk and remote tier holds (read-only; fine beside an engine)"),
    "verify": ("tierstore.admin", "re-check every stored object's checksum (read-only unless --repair)"),
    "gc": ("tierstore.admin", "remove stale temp files and corrupt objects; keep a shared prefix within a budget "
                              "(--max-size, --older-than); --tier remote runs beside a live engine"),
    "crashtest": ("tierstore.crashtest", "SIGKILL a writer at random moments and check every acknowledged chunk"),
    "serve": ("tierstore.serve.command", "one store per node, shared by its engine processes over a Unix socket"),
    "keygen": ("tierstore.keyring", "make a key for sealed shared tiers, or derive a tenant's keys (auth: keys_file)"),
}
BENCHES = {
    "tiers": ("tierstore.bench.tiers", "put/get throughput of each tier vs plain copies and I/O"),
    "kv": ("tierstore.bench.kv", "multi-round-chat TTFT with and without the store"),
    "kvcopy": ("tierstore.bench.kvcopy", "KV load_into/save_from vs the bare scatter/gather of the same bytes"),
    "weights": ("tierstore.bench.weights", "checkpoint loading vs safetensors and peers"),
    "peers": ("tierstore.bench.peers", "LMCache's bench l2 (fs_native, fs) next to the disk tier"),
    "control": ("tierstore.bench.control", "lookup cost and index memory per key from 10k to 1M keys"),
    "promotion": ("tierstore.bench.promotion", "what promotion and write-back cost a reader (S3 shim)"),
    "mount": ("tierstore.bench.mount", "a load from a shared mount while stores run: remote tier vs vLLM's fs tier"),
    "writeback": ("tierstore.bench.writeback", "remote write-back throughput vs plain PUTs at the same concurrency"),
    "hit": ("tierstore.bench.hit", "one host-tier hit, with the per-read job bookkeeping as it is and as it was"),
    "metrics": ("tierstore.bench.metrics", "the put/get path with Prometheus metrics on vs off"),
    "serve": ("tierstore.bench.serve", "multi-round QA TTFT per round and QPS against an OpenAI-compatible endpoint"),
    "server": ("tierstore.bench.server", "a get through a node server (tierstore serve) vs the same get in process"),
    "trust": ("tierstore.bench.trust", "what sealing a shared tier (auth) costs a reader: file:// and S3"),
    "gc": ("tierstore.bench.gc", "gc of a shared prefix: requests vs object count (S3 and file://)"),
    "fleet": ("tierstore.bench.fleet", "8-64 instances on one S3 prefix with a gc sidecar: lookup cost vs N"),
    "gpu": ("tierstore.bench.gpu", "what reaches the GPU: H2D limits, store gets, KV load_into, weights (CUDA)"),
    "all": ("tierstore.bench.all", "every bench in one run: BENCHMARKS.md and PNG plots in --out"),
    "vllm": ("tierstore_vllm.bench", "multi-round-chat TTFT of real vLLM engines (needs tierstore_vllm + vLLM)"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``tierstore gc: argument --watch: must be at least 1 s, got '0'``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _add(sub: argparse._SubParsersAction[_Parser], name: str, module: str, help_: str,
         argv: list[str]) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(_module=module, _verb=name)
    # import only the module being run: a broken or heavy verb never slows the others down
    if name in argv:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            package = module.partition(".")[0]
            if package not in _ADAPTERS or exc.name != package:
                raise
            raise SystemExit(f"tierstore {_label(p.prog)}: needs the {package} adapter: "
                             f"{_ADAPTERS[package]}") from None
        adder = getattr(mod, f"add_{name}_arguments", None) or mod.add_arguments
        adder(p)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="tierstore", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level and show tracebacks (also accepted after the verb)")
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in VERBS.items():
        _add(sub, name, module, help_, argv)
    bench = sub.add_parser("bench", help="benchmarks against physical limits and peers")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in BENCHES.items():
        _add(bsub, name, module, help_, argv)
    return parser


def _label(prog: str) -> str:
    """``"tierstore bench tiers"`` -> ``"bench tiers"``: the verb as the user typed it."""
    return prog.removeprefix("tierstore").strip()


def _verbose(argv: list[str]) -> tuple[list[str], bool]:
    """``-v``/``--verbose`` anywhere before a ``--``, so ``tierstore demo -v`` works like ``tierstore -v demo``."""
    end = argv.index("--") if "--" in argv else len(argv)
    rest = [a for a in argv[:end] if a not in ("-v", "--verbose")] + argv[end:]
    return rest, len(rest) != len(argv)


def main(argv: list[str] | None = None) -> int:
    argv, verbose = _verbose(sys.argv[1:] if argv is None else list(argv))
    args = build_parser(argv).parse_args(argv)
    verbose = verbose or args.verbose
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    verb = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
    try:
        mod = importlib.import_module(args._module)
        runner = getattr(mod, f"run_{args._verb}", None) or mod.run
        return int(runner(args) or 0)
    except USER_ERRORS as exc:
        if verbose:
            raise
        print(f"tierstore {verb}: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C ends a verb (gc --watch, a bench) without a traceback
        if verbose:
            raise
        print(f"tierstore {verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
