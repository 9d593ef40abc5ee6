"""A process that takes a lost driver's port without the job secret (issue 27, trust).

Usage: python impostor_store.py PORT DUMP.json. It listens where the driver did
and fills its store with everything an outsider recorded from the real store
before the driver died (every value, hello included, replayed byte for byte),
plus forged values that would steer the job if they were obeyed: a newer round,
a stop, and an answer to every agent registration. It never reads the secret.
"""

import json
import sys
import time
from datetime import timedelta

import torch.distributed as dist

FAKE_MAC = b"0" * 64


def forged(payload):
    return FAKE_MAC + b"." + str(time.time_ns() * 2).encode() + b"." + json.dumps(payload).encode()


def main():
    port, dump = int(sys.argv[1]), json.load(open(sys.argv[2]))
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30), use_libuv=True)
    for key, blob in dump.items():
        store.set(key, bytes.fromhex(blob))
    namespace = next(k.split("/round/latest")[0] for k in dump if k.endswith("/round/latest"))
    store.set(f"{namespace}/round/latest", forged({"round": 1000}))
    store.set(f"{namespace}/job/stop", forged({"signal": 15}))
    print("listening", flush=True)
    while True:        # answer every registration as a driver would, with forged seals
        for key in store.list_keys():
            if key.endswith("/info"):          # sealed, not encrypted: the nonce is readable
                nonce = json.loads(bytes(store.get(key)).split(b".", 2)[2]).get("nonce")
                store.set(key.replace("/info", "/accepted"), forged({"ok": True, "nonce": nonce}))
        time.sleep(0.2)


if __name__ == "__main__":
    main()
