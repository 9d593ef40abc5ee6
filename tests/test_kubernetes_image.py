"""The Kubernetes example's image and volumes (issue 30, part 6).

No image is built here (no registry or network in CI): hadolint checks the
Dockerfile when it is installed; either way every COPY source must exist in the
repository, the script it installs must be the one the manifests run, and
the checkpoint volume the workers mount must be defined.
"""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from elastic.runner import cli

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (make install adds it)")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "examples" / "kubernetes"
DOCKERFILE = K8S / "Dockerfile"


def instructions():
    """(KEYWORD, argument text) per Dockerfile instruction, continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def manifests():
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed")
def test_hadolint_passes():
    run = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_dockerfile_copies_files_that_exist_and_installs_the_package():
    steps = instructions()
    assert steps[0][0] == "FROM"
    known = {"FROM", "ENV", "RUN", "WORKDIR", "COPY"}
    assert {k for k, _ in steps} <= known, steps
    copied = []
    for keyword, rest in steps:
        if keyword == "COPY":
            *sources, dest = shlex.split(rest)
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            copied.append(dest)
    runs = [rest for keyword, rest in steps if keyword == "RUN"]
    install = next(i for i, (k, r) in enumerate(steps) if k == "RUN" and r.endswith("install "
                                                                                "--no-cache-dir ."))
    # the package is installed after setup.py and elastic/ are in the image
    assert [s for s in steps[:install] if s[0] == "COPY"] == [("COPY", "setup.py ./"),
                                                                ("COPY", "elastic ./elastic")]
    torch_pin = re.search(r"torch==(\S+)", (REPO / "Makefile").read_text()).group(1)
    assert any(f"torch=={torch_pin}" in r for r in runs), "the image's torch is not the tested one"
    assert "/app/train.py" in copied


def test_the_manifests_run_the_image_and_its_script():
    docs = manifests()
    build = re.search(r"docker build -f examples/kubernetes/Dockerfile -t (\S+) \.",
                      DOCKERFILE.read_text())
    assert build, "the Dockerfile says how to build it"
    for key in (("Job", "elastic-driver"), ("StatefulSet", "elastic-worker")):
        container = docs[key]["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == build.group(1), key
    worker = docs[("StatefulSet", "elastic-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["command"][-2:] == ["python", "/app/train.py"]


def test_the_checkpoint_volume_is_defined_and_mounted_where_the_driver_points():
    docs = manifests()
    driver = docs[("Job", "elastic-driver")]["spec"]["template"]["spec"]["containers"][0]
    checkpoint_dir = cli.build_parser().parse_args(driver["command"][1:]).checkpoint_dir
    pod = docs[("StatefulSet", "elastic-worker")]["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    claim = docs[("PersistentVolumeClaim", claims[mounts[checkpoint_dir]])]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]     # every worker pod writes it
    assert claim["spec"]["resources"]["requests"]["storage"]
