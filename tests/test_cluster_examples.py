"""The Kubernetes manifests and Slurm scripts run the commands the join tests run.

Nothing here needs a cluster: the YAML must parse, the scripts must pass
``bash -n``, and every ``elasticrun`` they start must use exactly the serve or
join flags of tests/support/join_cluster.py (plus job-policy flags that other tests
cover), parsed by elasticrun's own parser.
"""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from support.join_cluster import join_args, serve_args

from elastic.runner import cli, serve

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (make install adds it)")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
POLICY = {"-np", "--min-np", "--max-np", "--blacklist-cooldown-range", "--checkpoint-dir",
          "--state-dir"}


def options(argv):
    """(set of canonical options, the training command) of an elasticrun argv."""
    known = cli.build_parser().flags
    found, i = set(), 0
    while i < len(argv) and argv[i] in known:
        flag = known[argv[i]]
        found.add(flag.names[0] if flag.names[0] != "--num-proc" else "-np")
        i += 1 + (1 if flag.nargs is None else flag.nargs)
    return found, argv[i:]


SERVE_TESTED, _ = options(serve_args(1, "s"))
JOIN_TESTED, _ = options(join_args("h:1", "s", 1, "n"))


def check_serve(argv):
    found, command = options(argv)
    assert not command, f"--serve takes no training command: {command}"
    assert SERVE_TESTED <= found and found - SERVE_TESTED <= POLICY, found
    cli.build_parser().parse_args(argv)
    return cli.build_parser().parse_args(argv)


def check_join(argv):
    found, command = options(argv)
    assert command, "an agent needs the training command"
    assert found == JOIN_TESTED, found
    return cli.build_parser().parse_args(argv)


# -- Kubernetes ---------------------------------------------------------------------------
def _docs():
    docs = []
    for path in sorted((EXAMPLES / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _pod(doc):
    return doc["spec"]["template"]["spec"]


def _secret_path(pod, container, secret_name):
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret and secret["secretName"] == secret_name:
            assert secret.get("defaultMode") == 0o400
            return mount["mountPath"]
    raise AssertionError(f"{secret_name} is not mounted")


def test_kubernetes_manifests_run_the_tested_commands():
    docs = _docs()
    secret = docs[("Secret", "elastic-job-secret")]
    service = docs[("Service", "elastic-driver")]
    driver, workers = docs[("Job", "elastic-driver")], docs[("StatefulSet", "elastic-worker")]
    assert "secret" in secret["stringData"]
    port = service["spec"]["ports"][0]["port"]
    assert service["spec"]["selector"] == driver["spec"]["template"]["metadata"]["labels"]

    pod = _pod(driver)
    container = pod["containers"][0]
    assert container["command"][0] == "elasticrun"
    args = check_serve(container["command"][1:])
    assert args.port == port
    assert args.secret_file.startswith(_secret_path(pod, container, "elastic-job-secret") + "/")
    assert pod["terminationGracePeriodSeconds"] > args.stop_timeout
    # A lost driver is started again behind the same Service, and its --state-dir is on a
    # volume that outlives the pod (tests/test_driver_restart.py runs that restart).
    assert pod["restartPolicy"] == "OnFailure" and driver["spec"]["backoffLimit"] >= 3
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == args.state_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in docs

    pod = _pod(workers)
    container = pod["containers"][0]
    assert container["command"][0] == "elasticrun"
    args = check_join(container["command"][1:])
    assert serve.parse_address(args.join) == ("elastic-driver", port)
    assert args.secret_file.startswith(_secret_path(pod, container, "elastic-job-secret") + "/")
    assert pod["terminationGracePeriodSeconds"] > args.stop_timeout
    # Each pod joins under its own name (the downward API fills POD_NAME).
    assert args.host_name == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
        in container["env"]


# -- Slurm ----------------------------------------------------------------------------------
def _elasticrun_commands(script):
    """Every elasticrun argv in a bash script (inside ``bash -c '...'`` too), with shell
    variables replaced by sample values."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "elasticrun" not in line:
            continue
        tokens = shlex.split(line)
        for i, token in enumerate(tokens):
            if token.startswith("exec elasticrun"):
                tokens = shlex.split(token)[1:] + tokens[i + 1:]
                break
        start = tokens.index("elasticrun") + 1
        argv = []
        for token in tokens[start:]:
            if token in ("&", ";"):
                break
            argv.append(_sample(token))
        commands.append(argv)
    return commands


def _sample(token):
    token = token.replace('"$PORT"', "29400").replace("$PORT", "29400")
    token = re.sub(r"\$\(hostname\)", "node1", token)
    return {"$0": "node1:29400", "$1": "/shared/secret", "$2": "1"}.get(token, token)


@pytest.mark.parametrize("name", ["elastic.sbatch", "grow.sbatch"])
def test_slurm_scripts_parse_and_run_the_tested_commands(name):
    script = EXAMPLES / "slurm" / name
    subprocess.run(["bash", "-n", str(script)], check=True)
    commands = _elasticrun_commands(script)
    serving = [c for c in commands if "--serve" in c]
    joining = [c for c in commands if "--join" in c]
    assert len(serving) == (1 if name == "elastic.sbatch" else 0)
    assert len(joining) == 1 and len(commands) == len(serving) + len(joining), commands
    for argv in serving:
        assert check_serve(argv).port == 29400
    args = check_join(joining[0])
    assert args.join == "node1:29400" and args.host_name == "node1"
