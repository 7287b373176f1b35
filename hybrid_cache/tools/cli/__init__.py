"""The command lines of the tools, one module per command, each with `main(argv=None) -> int` (argument parsing,
printing, exit statuses) over the library functions of its tool; `build_parser()` where argparse builds it.

The console scripts `hybrid-cache-perplexity`, `hybrid-cache-bench`, `hybrid-cache-plan` and `hybrid-cache-prefix`
call `perplexity.main`, `bench.main`, `planner.main` and `prefix.main`; ``python -m hybrid_cache.tools.cli.perplexity`` (and
``bench``, ``planner``, ``prefix``, ``lm_eval_ring``) run the same through the modules at those paths.
"""
