"""Interconnect benchmarks (node side: every rank runs them): collectives, point to point and node
pairs, with HDF5 results.

``bandwidth`` owns the bandwidth arithmetic, ``params`` the job kinds' parameters (light:
no torch), ``collectives``/``p2p``/``pairs``/``preflight`` the runners, ``torch_path`` and
``mpi_path`` the two ways to communicate, ``record`` the result file and ``report`` the table,
plots and comparison.
"""
