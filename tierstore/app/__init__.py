"""The application on top of tierstore: the ``tierstore`` command line (:mod:`.cli`), its demo
training run (:mod:`.demo`), the throughput measurements behind ``tierstore bench`` and the
benchmarks (:mod:`.bench`), and the configuration reference generator (:mod:`.reference`).

Nothing in the storage core or the workloads imports this package.
"""
