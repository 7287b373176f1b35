"""Alias at the old path of the benchmark harness `hybrid_cache.tools.bench` and of its command line
`hybrid_cache.tools.cli.bench` (`main`, `build_parser`); ``python -m hybrid_cache.bench`` runs that command line.
The harness's modules are attributes here (``hybrid_cache.bench.machine``, ...). New code imports the tools paths."""

from ..tools.bench import *  # noqa: F403
from ..tools.bench import compiled, decode, instrument, machine, prefill, profiling, report, workload  # noqa: F401
from ..tools.cli import bench as cli  # noqa: F401
from ..tools.cli.bench import build_parser, main  # noqa: F401
