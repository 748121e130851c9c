"""The application on top of tierstore: the ``tierstore`` command line (:mod:`.cli`), its demo
training run (:mod:`.demo`), the throughput measurements behind ``tierstore probe``, ``tierstore
bench`` and the benchmarks (:mod:`.bench`), ``tierstore inspect``'s listing (:mod:`.inspection`),
and the configuration reference generator (:mod:`.reference`).

Nothing in the storage core or the workloads imports this package.
"""
