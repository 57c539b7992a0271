"""KV events over ZeroMQ (serving/kv_event_publisher.py) as vLLM's subscribers read them: 3-frame
messages [topic, 8-byte big-endian sequence number, msgpack batch] on the PUB socket, replay of
the missed batches from a sequence number on the ROUTER socket ending with the -1 marker, a
malformed replay request ignored; a served llm's events let a subscriber rebuild its prefix cache;
a bad kv_events_config fails the load naming the field."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import zmq

from backend_lib.config import ConfigError
from backend_lib.llm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from backend_lib.llm.kv_events_config import KVEventsConfig
from backend_lib.llm.serving.kv_event_publisher import ZmqKVEventPublisher
from backend_lib.llm.serving.service import LLMService
from backend_lib.model_context import ModelContext
from tests.llm.engine_helpers import engine_checkpoint
from tests.llm.kv_event_schema import DECODER, ReplicaView
from tests.llm.service_helpers import service_parameters
from tooling.tritonserver import free_port

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def endpoints() -> tuple[dict, str, str]:
    """A config's endpoints on free ports, and the addresses a subscriber connects to."""
    pub, replay = free_port(), free_port()
    config = {"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    return config, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


def subscriber(address: str, topic: bytes) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(address)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    time.sleep(0.3)  # ZeroMQ's slow joiner: a subscription takes a moment to reach the PUB
    return sub


def replay(address: str, first: int) -> list[tuple[int, bytes]]:
    """What the replay socket sends for `first`, up to its end marker: asked from a DEALER, which
    (unlike a REQ) takes the several replies of one request."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(address)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    got = []
    while dealer.poll(5000):
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if not payload:
            assert int.from_bytes(seq, "big", signed=True) == -1
            break
        got.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    return got


def test_batches_are_framed_numbered_and_replayed_as_vllm_does():
    config, pub_address, replay_address = endpoints()
    publisher = ZmqKVEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv", **config)
    )
    try:
        sub = subscriber(pub_address, b"kv")
        for k in range(5):
            publisher.publish(KVEventBatch(float(k), [AllBlocksCleared()]))
        received = []
        while len(received) < 5 and sub.poll(5000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            received.append((int.from_bytes(seq, "big"), DECODER.decode(payload).ts))
        assert received == [(k, float(k)) for k in range(5)]
        # A malformed request is ignored; the socket still answers the next one.
        bad = zmq.Context.instance().socket(zmq.DEALER)
        bad.connect(replay_address)
        bad.send_multipart([b"", b"x"])
        missed = replay(replay_address, 2)
        assert [seq for seq, _ in missed] == [2, 3, 4]
        assert [DECODER.decode(payload).ts for _, payload in missed] == [2.0, 3.0, 4.0]
        bad.close(linger=0)
        sub.close(linger=0)
    finally:
        publisher.close()


@pytest.mark.parametrize("as_int", [True, False], ids=["int64", "bytes"])
def test_block_hashes_go_out_as_vllm_s_64_bit_integers_unless_asked_for_bytes(as_int):
    config, pub_address, _ = endpoints()
    publisher = ZmqKVEventPublisher(
        KVEventsConfig(True, "zmq", use_int_block_hashes=as_int, **config)
    )
    digest, parent = bytes(range(32)), bytes(range(32, 64))
    try:
        sub = subscriber(pub_address, b"")
        batch = KVEventBatch(
            1.0,
            [
                BlockStored([digest], parent, [5] * 16, 16, None, "CPU"),
                BlockRemoved([digest], "CPU"),
            ],
        )
        payload = None
        for _ in range(50):  # the subscription needs a moment to reach the publisher
            publisher.publish(batch)
            if sub.poll(100):
                payload = sub.recv_multipart()[2]
                break
        stored, removed = DECODER.decode(payload).events
        want = int.from_bytes(digest[24:], "big") if as_int else digest
        assert stored.block_hashes == [want] and removed.block_hashes == [want]
        assert stored.parent_block_hash == (
            int.from_bytes(parent[24:], "big") if as_int else parent
        )
        sub.close(linger=0)
    finally:
        publisher.close()


def test_a_served_llm_s_events_rebuild_its_prefix_cache():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    config, pub_address, replay_address = endpoints()
    events = json.dumps({"enable_kv_cache_events": True, **config})
    parameters = {**service_parameters(model_dir), "num_blocks": "24", "kv_events_config": events}
    context = ModelContext("llm", "1", model_dir, torch.device("cpu"), parameters, {})
    service = LLMService.from_context(context, None)
    view = ReplicaView()
    try:
        sub = subscriber(pub_address, b"")
        words = ["karo", "mite", "lusa", "ven", "tor", "al", "is", "qu", "bre"]
        for k in range(12):
            prompt = " ".join(words * 2 + words[: k % 5 + 1] + [str(k)] * (k % 4 + 3))
            params = json.dumps({"temperature": 0, "max_tokens": 6, "ignore_eos": True})
            job = service.submit(
                {
                    "text_input": np.array([prompt.encode()], dtype=object),
                    "sampling_parameters": np.array([params.encode()], dtype=object),
                }
            )
            assert not any(isinstance(r, Exception) for r, _ in service.responses(job))
        deadline = time.monotonic() + 10
        pool = service.engine.scheduler.kv_cache_manager.pool
        # vLLM's default wire form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the digest as a
        # big-endian integer, its low 64 bits.
        cached = {int.from_bytes(h, "big") & (2**64 - 1) for h in pool.cached_hashes()}
        # Every batch from the first: replayed, then what the live socket got past it.
        for _, payload in replay(replay_address, 0):
            view.apply(payload)
        while set(view.blocks) != cached and time.monotonic() < deadline and sub.poll(200):
            _, _, payload = sub.recv_multipart()
            view.apply(payload)
        assert set(view.blocks) == cached and cached
        sub.close(linger=0)
    finally:
        service.shutdown()


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("{not json", "kv_events_config"),
        ('["zmq"]', "kv_events_config"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kv_events_config.publisher"),
        ('{"enable_kv_cache_events": "yes"}', "kv_events_config.enable_kv_cache_events"),
        ('{"endpoint": "localhost:5557"}', "kv_events_config.endpoint"),
        ('{"buffer_steps": 0}', "kv_events_config.buffer_steps"),
        ('{"colour": "red"}', "kv_events_config.colour"),
        ('{"topic": "kv@${KV_TEST_UNSET_VARIABLE}@llm"}', "kv_events_config.topic"),
    ],
)
def test_a_bad_kv_events_config_names_its_field(value, field):
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_json(value)
    assert info.value.key == field


def test_endpoints_and_topic_take_environment_variables(monkeypatch):
    """One config.pbtxt for every pod: each publishes under its own topic (llm-d's form)."""
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    monkeypatch.setenv("KV_EVENTS_ENDPOINT", "tcp://epp.serving.svc:5557")
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "endpoint": "${KV_EVENTS_ENDPOINT}",'
        ' "topic": "kv@${POD_IP}@llm"}'
    )
    assert config.endpoint == "tcp://epp.serving.svc:5557"
    assert config.topic == "kv@10.1.2.3@llm"


def test_an_endpoint_in_use_fails_the_load_naming_it():
    config, _, _ = endpoints()
    first = ZmqKVEventPublisher(KVEventsConfig(True, "zmq", **config))
    try:
        with pytest.raises(ConfigError) as info:
            ZmqKVEventPublisher(KVEventsConfig(True, "zmq", **config))
        assert info.value.key == "kv_events_config.endpoint"
    finally:
        first.close()
