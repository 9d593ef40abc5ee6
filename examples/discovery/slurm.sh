#!/bin/sh
# Discovery inside a Slurm allocation: every node of the job, one line each,
# with ${SLURM_NTASKS_PER_NODE:-1} slots.
#
#   salloc -N 4 --ntasks-per-node 2
#   elasticrun -np 8 --min-np 2 --host-discovery-script examples/discovery/slurm.sh python train.py
#
# The node list is expanded with `scontrol show hostnames "$SLURM_JOB_NODELIST"`.
# A node that fails is blacklisted by elasticrun, and training goes on with the
# others as long as --min-np slots remain.
set -u
me=slurm.sh
fail() { echo "$me: $*" >&2; exit 1; }
oneline() { tr '\n\t' '  ' < "$1" | sed 's/  */ /g; s/^ //; s/ $//' | cut -c1-200; }

nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
[ -n "$nodelist" ] || fail "SLURM_JOB_NODELIST is not set (run inside a Slurm allocation)"

slots=${SLURM_NTASKS_PER_NODE:-1}
case $slots in
    ''|*[!0-9]*|0*) fail "SLURM_NTASKS_PER_NODE must be a positive integer, got '$slots'" ;;
esac

command -v scontrol >/dev/null 2>&1 || fail "scontrol not found on PATH"
err=$(mktemp) || fail "cannot create a temporary file"
trap 'rm -f "$err"' EXIT
hosts=$(scontrol show hostnames "$nodelist" 2>"$err")
rc=$?
[ "$rc" -eq 0 ] || fail "scontrol show hostnames failed (exit $rc): $(oneline "$err")"
printf '%s\n' "$hosts" | while IFS= read -r host; do
    [ -n "$host" ] && printf '%s:%s\n' "$host" "$slots"
done
exit 0
