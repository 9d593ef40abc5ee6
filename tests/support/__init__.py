"""What the tests share and do not test: real jobs to start and read (jobs, join_cluster),
the driver's part played in-process (harness), /proc and socket probes (procs, listening),
throwaway sshd and network namespaces (sshd, netlab), attackers (adversary,
impostor_store), and the soak (``make soak`` runs soak.py).

Tests import these as ``support.<module>``; pytest puts tests/ on sys.path, and the
scripts here that run alone (soak.py, impostor_store.py) or the benchmarks that reuse
them add it themselves. Nothing here imports a test module (tests/test_structure.py).
"""
