"""hvd_onebit_tools: the `hvd-onebit` command line and the measurements behind hvd_onebit.

The benchmarks (`bench`), the convergence zoo, the scale model (calibrate, predict) and the
bandwidth-limited cluster on one machine (`cluster`). They import the library, ``hvd_onebit``;
the library never imports them. Installed from a checkout with ``pip install "./hvd_onebit[tools]"``.
"""
