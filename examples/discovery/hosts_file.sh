#!/bin/sh
# Discovery from a hosts file that an operator (or demo.py) edits:
# one `host` or `host:slots` per line. Point HOSTS_FILE at it.
exec cat "${HOSTS_FILE:-/etc/elastic/hosts}"
