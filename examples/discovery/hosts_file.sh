#!/bin/sh
# Discovery from a hosts file that an operator (or examples/demo.py) edits:
# one `host` or `host:slots` per line; blank lines and `#` comments are ignored
# by elasticrun. Point HOSTS_FILE at it (default /etc/elastic/hosts).
#
# Edit it atomically so elasticrun never reads half a file:
#   printf 'node-1:4\nnode-2:4\n' > hosts.tmp && mv hosts.tmp "$HOSTS_FILE"
#
#   HOSTS_FILE=./hosts elasticrun -np 4 --host-discovery-script examples/discovery/hosts_file.sh python train.py
hosts_file=${HOSTS_FILE:-/etc/elastic/hosts}
if [ ! -r "$hosts_file" ] || [ -d "$hosts_file" ]; then
    echo "hosts_file.sh: cannot read hosts file $hosts_file (set HOSTS_FILE)" >&2
    exit 1
fi
exec cat "$hosts_file"
