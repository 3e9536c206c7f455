"""Two-process KV transfer with kvxfer (pip install ./python numpy): this process is the
decode side and starts a prefill process; 32 pages of 4 layers move, checked byte for byte."""
import multiprocessing as mp
import time

import numpy as np

import kvxfer

LAYERS, PAGES, PAGE_BYTES, ROOM = 4, 64, 16384, 7


def wait(engine, room):
    while (state := engine.room_poll(room)) not in kvxfer.TERMINAL_STATES:
        time.sleep(0.001)
    return state


def prefill(conn):
    kv = [np.random.default_rng(i).integers(0, 256, (PAGES, PAGE_BYTES), np.uint8) for i in range(LAYERS)]
    with kvxfer.Engine(role="prefill") as engine:
        engine.register_kv([(a.ctypes.data, a.nbytes, PAGE_BYTES) for a in kv])  # integer addresses
        conn.send(engine.address)
        src = conn.recv()
        engine.room_create(ROOM)
        for i in range(0, len(src), 8):  # 8 pages per chunk; the last chunk closes the room
            engine.enqueue_chunk(ROOM, src[i:i + 8], is_last=i + 8 >= len(src))
        conn.send(wait(engine, ROOM).name)
        conn.recv()  # stay up until decode has it all: SUCCESS here means sent, not received


def main():
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(child,))
    proc.start()
    kv = [np.zeros((PAGES, PAGE_BYTES), np.uint8) for _ in range(LAYERS)]
    src, dst = np.arange(0, 32, dtype=np.uint32), np.arange(32, 64, dtype=np.uint32)
    with kvxfer.Engine(role="decode") as engine:
        engine.register_kv([kvxfer.Buffer.of(a, PAGE_BYTES) for a in kv])
        engine.room_create(ROOM, [conn.recv()])  # the prefill engine's address
        engine.room_set_destination(ROOM, dst)  # numpy uint32: passed without a copy
        conn.send(src)
        state = wait(engine, ROOM)
        conn.send("done")
        if state == kvxfer.RoomState.FAILED:
            raise SystemExit(f"transfer failed: {engine.room_failure(ROOM)}")
        want = [np.random.default_rng(i).integers(0, 256, (PAGES, PAGE_BYTES), np.uint8)[src] for i in range(LAYERS)]
        same = all(np.array_equal(kv[i][dst], want[i]) for i in range(LAYERS))
        print(f"decode {state.name}, prefill {conn.recv()}, {engine.metrics()['bytes_received']} bytes, "
              f"{'identical' if same else 'DIFFERENT'}")
    proc.join()
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
