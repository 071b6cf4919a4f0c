"""An engine in a process of its own (for the engine-death test): attaches
to the agent, registers a pool filled with a pattern, prints one JSON line
{"session", "engine_id", "pool", "pid"} and waits to be killed.

usage: engine_proc.py SOCKET ENGINE_ID ROLE LAYOUT_JSON [SEED]"""

import json
import os
import sys
import time

import numpy as np

import kvfabric


def main() -> None:
    sock, engine_id, role, layout_json = sys.argv[1:5]
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    layout = kvfabric.Layout(**json.loads(layout_json))
    pool = kvfabric.ShmPool.for_layout(layout)
    view = pool.numpy()
    view[:] = np.random.default_rng(seed).integers(1, 256, view.shape, dtype=np.uint8)
    client = kvfabric.Client(sock)
    session = client.attach(engine_id, "uid-" + engine_id, role, layout, auto_reattach=False)
    session.register_shm(pool)
    print(json.dumps({"session": session.id, "engine_id": engine_id, "pool": pool.name, "pid": os.getpid()}), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
