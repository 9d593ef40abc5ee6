#!/bin/sh
# Discovery on Kubernetes: the pods that match a label selector and are Ready,
# printed as `podIP:slots`. Pods that are pending, not Ready, or being deleted
# (a node drain, a preemption, a scale-down) are left out, so elasticrun moves
# training off them.
#
#   ELASTIC_K8S_SELECTOR=app=trainer,job=run-42 SLOTS=1 \
#   elasticrun -np 4 --min-np 2 --host-discovery-script examples/discovery/kubernetes.sh python train.py
#
# Settings (environment):
#   ELASTIC_K8S_SELECTOR   label selector, required (passed to `kubectl get pods -l`)
#   ELASTIC_K8S_NAMESPACE  namespace (default: kubectl's current one)
#   SLOTS                  slots per pod (default 1, e.g. the GPUs each pod requests)
# The driver pod needs RBAC permission to get/list pods in that namespace.
# Workers are started with ssh on the pod IPs, so the pods run sshd and share
# the job's code at the same path (or run the driver on the pods' network).
set -u
me=kubernetes.sh
fail() { echo "$me: $*" >&2; exit 1; }
oneline() { tr '\n\t' '  ' < "$1" | sed 's/  */ /g; s/^ //; s/ $//' | cut -c1-200; }

selector=${ELASTIC_K8S_SELECTOR:-}
[ -n "$selector" ] || fail "set ELASTIC_K8S_SELECTOR to a label selector, e.g. app=trainer"
slots=${SLOTS:-1}
case $slots in
    ''|*[!0-9]*|0*) fail "SLOTS must be a positive integer, got '$slots'" ;;
esac
command -v kubectl >/dev/null 2>&1 || fail "kubectl not found on PATH"
python=${PYTHON:-python3}
command -v "$python" >/dev/null 2>&1 || fail "$python not found on PATH (set PYTHON)"

set -- get pods -l "$selector" -o json
[ -n "${ELASTIC_K8S_NAMESPACE:-}" ] && set -- "$@" -n "$ELASTIC_K8S_NAMESPACE"

out=$(mktemp) || fail "cannot create a temporary file"
err=$(mktemp) || { rm -f "$out"; fail "cannot create a temporary file"; }
trap 'rm -f "$out" "$err"' EXIT
kubectl "$@" >"$out" 2>"$err"
rc=$?
[ "$rc" -eq 0 ] || fail "kubectl get pods failed (exit $rc): $(oneline "$err")"

# A pod counts when it is Running, its Ready condition is True, it has an IP
# and it is not terminating. IPv6 pod IPs are printed in brackets.
"$python" - "$out" "$slots" <<'PY'
import json
import sys

path, slots = sys.argv[1], sys.argv[2]
try:
    with open(path) as f:
        pods = json.load(f)
    items = pods["items"]
except (OSError, ValueError, KeyError, TypeError) as exc:
    sys.stderr.write(f"kubernetes.sh: cannot read kubectl's pod list: {type(exc).__name__}: {exc}\n")
    sys.exit(1)


def ready(pod):
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


for pod in items:
    ip = (pod.get("status") or {}).get("podIP")
    if isinstance(ip, str) and ip and ready(pod):
        print(f"[{ip}]:{slots}" if ":" in ip else f"{ip}:{slots}")
PY
