#!/bin/sh
# Discovery for spot (preemptible) instances on AWS EC2: the job's running
# instances, minus those marked for reclaim, printed as `privateIP:slots`.
# Dropping a host as soon as its reclaim notice arrives lets elasticrun move
# training off it at the next commit, within the two-minute warning, instead of
# losing the worker mid-step when the machine disappears.
#
# Convention:
#   * every instance of the job carries the tag  elastic-job=<job name>;
#   * an instance that got a reclaim notice carries the tag  spot-reclaim  (any
#     value, e.g. the notice time). Something must set it: an EventBridge rule on
#     "EC2 Spot Instance Interruption Warning" (and, to leave even earlier,
#     "EC2 Instance Rebalance Recommendation") with a small function that tags the
#     instance, or a loop on each instance that polls its own metadata:
#
#       while sleep 5; do
#         if curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" \
#             http://169.254.169.254/latest/meta-data/spot/instance-action >/dev/null; then
#           aws ec2 create-tags --resources "$INSTANCE_ID" --tags Key=spot-reclaim,Value="$(date +%s)"
#           break
#         fi
#       done
#
#   ELASTIC_SPOT_JOB=run-42 SLOTS=8 \
#   elasticrun -np 16 --min-np 8 --host-discovery-script examples/discovery/spot.sh python train.py
#
# Settings (environment):
#   ELASTIC_SPOT_JOB     value of the elastic-job tag, required
#   ELASTIC_SPOT_TAG     tag key that names the job (default elastic-job)
#   ELASTIC_SPOT_RECLAIM tag key of the reclaim mark (default spot-reclaim)
#   SLOTS                slots per instance (default 1)
#   the usual AWS_PROFILE / AWS_REGION / credentials of the aws CLI
set -u
me=spot.sh
fail() { echo "$me: $*" >&2; exit 1; }
oneline() { tr '\n\t' '  ' < "$1" | sed 's/  */ /g; s/^ //; s/ $//' | cut -c1-200; }

job=${ELASTIC_SPOT_JOB:-}
[ -n "$job" ] || fail "set ELASTIC_SPOT_JOB to the value of the instances' elastic-job tag"
job_tag=${ELASTIC_SPOT_TAG:-elastic-job}
reclaim_tag=${ELASTIC_SPOT_RECLAIM:-spot-reclaim}
slots=${SLOTS:-1}
case $slots in
    ''|*[!0-9]*|0*) fail "SLOTS must be a positive integer, got '$slots'" ;;
esac
command -v aws >/dev/null 2>&1 || fail "aws CLI not found on PATH"

out=$(mktemp) || fail "cannot create a temporary file"
err=$(mktemp) || { rm -f "$out"; fail "cannot create a temporary file"; }
trap 'rm -f "$out" "$err"' EXIT
# One line per instance: private IP, then the reclaim tag's value (None when absent).
aws ec2 describe-instances \
    --filters "Name=tag:$job_tag,Values=$job" "Name=instance-state-name,Values=running" \
    --query "Reservations[].Instances[].[PrivateIpAddress, Tags[?Key=='$reclaim_tag'].Value | [0]]" \
    --output text >"$out" 2>"$err"
rc=$?
[ "$rc" -eq 0 ] || fail "aws ec2 describe-instances failed (exit $rc): $(oneline "$err")"

# Keep an instance only when it has an IP and no reclaim mark.
awk -v slots="$slots" '
    NF == 0 { next }
    $1 == "None" { next }
    NF >= 2 && $2 != "None" { next }
    { print $1 ":" slots }
' "$out"
