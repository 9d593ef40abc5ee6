"""What the tests share and do not test: real jobs to start and read (jobs, join_cluster,
ckpt_jobs, holder_loss), the driver's part played in-process (harness) or without
processes (decide_world), fakes of the collectives (optimizer_fakes), waits on a
condition (waits), sharded commits written as ranks would (shard_commits), /proc and
socket probes (procs, listening), a throwaway sshd and network namespaces (sshd,
netlab), attackers (adversary, impostor_store), and the soak (``make soak`` runs
soak.py).

Tests import these as ``support.<module>``; pytest puts tests/ on sys.path, and the
scripts here that run alone (soak.py, impostor_store.py) or the benchmarks that reuse
them add it themselves. Nothing here or in a test imports a test module: what two test
files share lives here (tests/test_structure.py checks both).
"""
