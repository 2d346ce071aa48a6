"""Stand-ins for ``length_workers.trace_length`` in a process of its own (they go to it by name): one per way a
length's process can end."""
import os
import pickle
import time


def by_length(conn, spec_at, length: int, request, levers) -> None:
    """8: answers; 16: never does; 24: dies; 32: fails with an error."""
    if length == 8:
        conn.send_bytes(pickle.dumps(("record", f"record at {length}")))
    elif length == 16:
        time.sleep(3600)
    elif length == 24:
        os._exit(3)
    else:
        conn.send_bytes(pickle.dumps(("error", "ValueError: no such length")))
