"""Tools on top of the compiler: the ``fusion-compiler`` command line and what it runs (the
dump, the numerics check, the benchmark, the reports)."""
