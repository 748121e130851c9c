"""The application on top of tierstore: the ``tierstore`` command line (`cli`), its demo training
run (`demo`), the throughput measurements behind ``tierstore probe``, ``tierstore bench`` and the
benchmarks (`bench`), ``tierstore inspect``'s listing (`inspection`), and the configuration
reference generator (`reference`).

Nothing in the storage core or the workloads imports this package.
"""
