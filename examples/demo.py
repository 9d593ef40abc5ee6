"""`make demo`: a real elastic job on this machine that goes 2 -> 4 -> 2 workers.

localhost and 127.0.0.1 play two hosts with two slots each. The demo edits
the hosts file that the discovery script reads, waiting for each round to
start before the next change, and the job trains to the end.
"""

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


ROUND_LINE = re.compile(r"^elasticrun: (?:\S+ \S+ )?round \d+: (\d+) workers")


def main():
    workdir = tempfile.mkdtemp(prefix="elastic-demo-")
    hosts_file = os.path.join(workdir, "hosts")

    def set_hosts(*hosts):
        with open(hosts_file + ".tmp", "w") as f:
            f.write("\n".join(hosts) + "\n")
        os.replace(hosts_file + ".tmp", hosts_file)
        print(f"demo: hosts file now lists {', '.join(hosts)}", flush=True)

    set_hosts("localhost:2")
    env = dict(os.environ, HOSTS_FILE=hosts_file, OMP_NUM_THREADS="1",
               DEMO_STEP_SLEEP=os.environ.get("DEMO_STEP_SLEEP", "0.05"),
               DEMO_EPOCHS=os.environ.get("DEMO_EPOCHS", "10"))
    cmd = [sys.executable, "-m", "elastic.runner", "-np", "2", "--min-np", "2", "--max-np", "4",
           "--host-discovery-script", os.path.join(HERE, "discovery", "hosts_file.sh"),
           "--discovery-interval", "0.5",
           "--event-log", os.environ.get("DEMO_EVENT_LOG", os.path.join(workdir, "events.jsonl")),
           sys.executable, os.path.join(HERE, "train_mlp.py")]
    print("demo: " + " ".join(cmd[2:]), flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rounds = []

    def pump():
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            print(line, flush=True)
            found = ROUND_LINE.search(line)
            if found:
                rounds.append(found.group(1))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()

    def wait_rounds(n, timeout=300):
        deadline = time.monotonic() + timeout
        while len(rounds) < n and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return len(rounds) >= n

    if wait_rounds(1):
        time.sleep(3)
        set_hosts("localhost:2", "127.0.0.1:2")
    if wait_rounds(2):
        time.sleep(3)
        set_hosts("127.0.0.1:2")
    code = proc.wait(timeout=600)
    reader.join(5)
    sizes = rounds
    print(f"demo: elasticrun exited {code}; world sizes by round: {' -> '.join(sizes)}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
