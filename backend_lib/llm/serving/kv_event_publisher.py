"""Publishing the engine's KV cache events (core/kv_events.py) over ZeroMQ, framed as vLLM does,
so that vLLM's subscribers and routers read them unchanged.

- PUB socket (`endpoint`): each batch is a 3-frame message `[topic, seq, payload]`: the topic as
  UTF-8, the batch's sequence number as 8 bytes big-endian (0, 1, 2, ... from the engine's start),
  the msgpack-encoded batch, its block hashes as vLLM's default 64-bit integers
  (`use_int_block_hashes`) or the engine's 32-byte digests.
- ROUTER socket (`replay_endpoint`): a subscriber that sees a gap in the sequence numbers sends the
  first one it missed (8 bytes big-endian) and gets every buffered batch from there as
  `[seq, payload]` messages, then `[-1 as 8 signed bytes, b""]` to end. Ask from a DEALER socket
  (send `[b"", seq]`, read `[b"", seq, payload]`): a REQ socket takes only the first reply.

The engine loop hands a batch over after each step (`publish`, never blocking: a full queue drops
the batch and counts it); one thread owns both sockets, encodes, sends and answers replays.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from itertools import count

import msgspec
import zmq

from backend_lib.config import ConfigError
from backend_lib.llm.core.kv_cache_manager import KVCacheManager
from backend_lib.llm.core.kv_events import BlockRemoved, BlockStored, KVEventBatch, KVEventLog
from backend_lib.llm.kv_events_config import PARAMETER, KVEventsConfig

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_LOW_64_BITS = (1 << 64) - 1
POLL_SECONDS = 0.05


class ZmqKVEventPublisher:
    """The sockets and the thread of one engine's event stream."""

    def __init__(self, config: KVEventsConfig) -> None:
        """Open the sockets (ConfigError naming the endpoint when one cannot be bound)."""
        self.config = config
        self.dropped = 0
        """Batches dropped because the queue was full."""
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            _open(self._pub, config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                _open(self._replay, config.replay_endpoint, "replay_endpoint", bind=True)
        except ConfigError:
            self._close_sockets()
            raise
        # The sockets are handed to the thread, which alone uses them from now on.
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch for sending; dropped (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            logger.warning("KV event queue full: a batch was dropped (%d so far)", self.dropped)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                if self.config.use_int_block_hashes:
                    batch = with_int_hashes(batch)
                seq, payload = next(self._seq), encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        except Exception:
            logger.exception("the KV event publisher stopped")
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("a malformed KV event replay request was ignored")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def int_hash(block_hash: bytes) -> int:
    """vLLM's 64-bit form of a block hash: the big-endian integer of its bytes, low 64 bits."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


def with_int_hashes(batch: KVEventBatch) -> KVEventBatch:
    """The batch with every block hash in vLLM's default wire form (`int_hash`)."""
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            event = msgspec.structs.replace(
                event,
                block_hashes=[int_hash(h) for h in event.block_hashes],
                parent_block_hash=None if parent is None else int_hash(parent),
            )
        elif isinstance(event, BlockRemoved):
            event = msgspec.structs.replace(
                event, block_hashes=[int_hash(h) for h in event.block_hashes]
            )
        events.append(event)
    return KVEventBatch(batch.ts, events)


class KVEventStream:
    """One engine's events, from its KV cache manager to the publisher: `flush` after each step."""

    def __init__(self, config: KVEventsConfig, kv: KVCacheManager, medium: str) -> None:
        self.publisher = ZmqKVEventPublisher(config)
        self.log = KVEventLog(kv.block_size, medium)
        kv.record_events(self.log)

    def flush(self) -> None:
        batch = self.log.take()
        if batch is not None:
            self.publisher.publish(batch)

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def _open(socket: zmq.Socket, endpoint: str, field: str, bind: bool = False) -> None:
    """Bind when asked or when the endpoint is local or a wildcard (as vLLM), else connect."""
    wildcard = "*" in endpoint or "::" in endpoint
    try:
        if bind or wildcard or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"{PARAMETER}.{field}", endpoint, f"cannot open it: {exc}") from None
