"""``elasticrun --dry-run``: the plan of a job, printed instead of run.

It runs discovery once and says which hosts and slots it found, how each host
is reached, the first round that those slots give (ranks, hosts, slots), where
the control store would listen and why, and the settings that shape the job.
Nothing is started and no port is opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.runner import binding, launcher
from elastic.runner.planner import Candidate, plan_round

if TYPE_CHECKING:
    from elastic.runner.job_config import JobConfig


def plan_lines(config: JobConfig) -> list[str]:
    """The lines of the plan for ``config`` (a driver.JobConfig)."""
    names = launcher.local_names()
    serving = config.backend is not None
    lines = [f"command: {' '.join(config.command) if config.command else '(none: --serve)'}"]
    if serving:
        hosts = {}
        lines.append("hosts: the agents that join (elasticrun --join); none yet")
    else:
        hosts = config.discovery.discover()
        lines.append(f"hosts: {len(hosts)} with {sum(hosts.values())} slots")
        for host, slots in hosts.items():
            how = "local" if launcher.is_local(host, names) else "ssh"
            lines.append(f"  {host}: {slots} slot{'s' if slots != 1 else ''} ({how})")
    limits = f"-np {config.np}, --min-np {config.min_np}, --max-np " + (
        str(config.max_np) if config.max_np is not None else "none")
    lines.append(f"workers: {limits}")
    candidates = [Candidate(f"{host}/{slot}", host, slot)
                  for host, slots in hosts.items() for slot in range(slots)]
    members = plan_round(candidates, [], config.max_np)
    if len(members) >= config.np:
        lines.append(f"first round: {len(members)} workers")
        for m in members:
            lines.append(f"  rank {m.rank}: {m.host} slot {m.worker_id.rsplit('/', 1)[1]}"
                         f" (local rank {m.local_rank})")
    else:
        lines.append(f"first round: waits up to --elastic-timeout {config.elastic_timeout:g} s "
                     f"for {config.np} slots ({len(members)} found)")
    where = binding.choose(list(hosts), names, config.network_interface, serving)
    port = config.port or "any free one"
    lines.append(f"control store: listens on {where.address}, port {port} ({where.reason})")
    lines.append(f"timeouts: --worker-timeout {config.worker_timeout:g} s, --stall-timeout "
                 f"{config.stall_timeout:g} s, --stop-timeout {config.stop_timeout:g} s, "
                 f"--elastic-timeout {config.elastic_timeout:g} s")
    for name, value in (("--output-filename", config.output_dir),
                        ("--event-log", config.event_log)):
        if value:
            lines.append(f"{name}: {value}")
    for key, value in sorted(config.extra_env.items()):
        lines.append(f"worker environment: {key}={value}")
    return lines
