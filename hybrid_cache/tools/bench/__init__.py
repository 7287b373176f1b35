"""Benchmarks of `HybridRingCache` against transformers' `DynamicCache` and `StaticCache`.

Run ``python -m hybrid_cache.tools.cli.bench --help`` (or the ``hybrid-cache-bench`` console script). See
``docs/benchmarks.md`` for the exact commands, the meaning of every column and measured results.

What is measured (modules of this package):

- ``decode`` (the default): ms per decode step after a synthesized prefill of ``context`` tokens and ``warmup``
  untimed steps, median and min over all timed steps of all repetitions, steps interleaved across caches (per rep:
  every cache prefilled, then their steps timed round-robin, one step of each cache in turn, so that a drift of the
  machine's speed reaches them alike); the time spent in cache operations (``instrument``: ``cache.update`` +
  mask creation); the bytes written inside ``cache.update`` per step (a ``TorchDispatchMode``); the K/V bytes held
  after the prefill and after every decode step, against an exactly sized cache for the same tokens; a roofline
  (bytes a step must read / step time, against the copy bandwidth measured in the same run, ``machine``).
- ``compiled`` (``--compile``): the same through ``torch.compile(model.forward, fullgraph=True)``, graphs counted,
  the first compiled steps checked against eager ones.
- ``prefill`` (``--prefill``): a chunked prefill of a ``context``-token prompt, chunk by chunk as ``generate``'s
  ``prefill_chunk_size`` does, per cache: total time, tokens/s and the peak K/V bytes held; and
  (``--prefill-chunk-check``) ``generate``'s bound on what a ring's sliding layer returns.
- ``profiling`` (``--profile``): torch.profiler tables of decode steps or of a prefill.
- ``machine``: what the machine is, and whether other work competed for its CPUs while a row was measured (rows
  are flagged; a busy machine is reported before the run with what to do).
- ``workload``: the models (embedded Gemma 3 270M, random models with a real model's K/V geometry) and inputs;
  ``report``: tables and plots. The command line is `hybrid_cache.tools.cli.bench`.

Every cache name in `hybrid_cache.tools.compare.CACHE_NAMES` can be benchmarked (``--caches``).
"""
