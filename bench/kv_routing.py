"""Cache-aware routing on KV events, simulated on one machine: 3 engine replicas, a router that
sends each request to the replica whose published events show the longest prefix of its prompt,
against round robin, on the same workload.

The workload: 6 agents, each with its own long system prompt, run 4 conversations each; every
conversation takes 3 turns (a message appended, a short answer that joins the history). Requests
run as a closed loop, 6 in flight, conversations in turn order. Each replica's KV pool holds about
a third of the working set, so a replica that keeps seeing the same agents keeps their prompts.

Each replica publishes its prefix cache's stores and evictions with `kv_events_config` over a
ZeroMQ PUB socket (vLLM's wire format). The router subscribes to all three, decodes the batches
with its own msgspec structs (written from vLLM's schema), and keeps per replica the blocks it
holds, keyed by (parent hash, the block's token ids): a prompt's blocks are looked up by their
tokens, so the router needs no hash function of its own. Ties (no replica holds any block) go to
the replica with the fewest requests in flight; load is otherwise not weighed (llm-d's profile
weighs it, and KV usage, beside the prefix). This harness exists to measure; the product's
router is llm-d's endpoint picker, which the Helm chart renders (docs/deployment.md).

The replicas step in turn in one process, so each one's time to first token is counted on its own
clock: the time its own steps took between the request's arrival and its first token (what it
would be on hardware of its own). The hit ratio is the replicas' prefix-cache hit tokens over
looked-up tokens. Greedy outputs must be identical under both policies.

    python -m bench.kv_routing [--quick] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import zmq

from backend_lib.llm.serving.kv_event_publisher import KVEventStream
from bench import cli
from bench.kv_offload import model_sizes
from bench.llm import check_same, greedy, new_engine
from bench.output import progress
from bench.skeleton import Benchmark
from bench.timing import p50_p99_ms
from tooling.checkpoints import Sizes, build_random_llama

NAME = "kv_routing"
HEADING = "Cache-aware routing on KV events: 3 replicas, longest prefix vs round robin"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=3)
POLICIES = ("round_robin", "longest_prefix")
BLOCK_SIZE = 16
REPLICAS = 3


@dataclass(frozen=True)
class Preset:
    sizes: Sizes
    agents: int
    conversations_per_agent: int
    system_len: int
    turns: int
    message_len: int
    answer_len: int
    in_flight: int


PRESETS = {
    "quick": Preset(model_sizes(128, 2, 1024), 3, 2, 96, 2, 32, 4, 3),
    "cpu": Preset(model_sizes(256, 6, 8192), 6, 4, 384, 3, 64, 8, 6),
    "cuda": Preset(model_sizes(1024, 12, 32000), 6, 8, 1024, 4, 128, 16, 12),
}


# --- the router's own reading of the events (vLLM's schema) ---------------------------------------


class _Event(msgspec.Struct, array_like=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class ReplicaBlocks:
    """The blocks one replica holds, by (parent hash, token ids), as its events tell."""

    def __init__(self) -> None:
        self.by_content: dict[tuple, bytes | int] = {}
        self.content_of: dict[bytes | int, tuple] = {}

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent, size = event.parent_block_hash, event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    key = (parent, tuple(event.token_ids[i * size : (i + 1) * size]))
                    self.by_content[key], self.content_of[block_hash] = block_hash, key
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    key = self.content_of.pop(block_hash, None)
                    if key is not None:
                        self.by_content.pop(key, None)
            else:
                self.by_content.clear()
                self.content_of.clear()

    def matched_blocks(self, prompt: list[int]) -> int:
        """Leading full blocks of `prompt` this replica holds."""
        parent, count = None, 0
        for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
            block_hash = self.by_content.get((parent, tuple(prompt[start : start + BLOCK_SIZE])))
            if block_hash is None:
                break
            parent, count = block_hash, count + 1
        return count


class EventRouter:
    """Subscribes to every replica's events; picks the replica with the longest held prefix."""

    def __init__(self, endpoints: list[str]) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        for endpoint in endpoints:
            self.socket.connect(endpoint)
        self.replicas = {f"kv@replica{i}@llm".encode(): ReplicaBlocks() for i in range(REPLICAS)}
        self.views = list(self.replicas.values())
        self.decoder = msgspec.msgpack.Decoder(EventBatch)

    def drain(self) -> None:
        while self.socket.poll(0):
            topic, _seq, payload = self.socket.recv_multipart()
            self.replicas[topic].apply(self.decoder.decode(payload))

    def pick(self, prompt: list[int], load: list[int]) -> int:
        """The replica holding the most leading blocks of `prompt`; ties to the least loaded."""
        self.drain()
        scores = [view.matched_blocks(prompt) for view in self.views]
        return max(range(REPLICAS), key=lambda r: (scores[r], -load[r]))

    def close(self) -> None:
        self.socket.close(linger=0)


# --- the workload and its replicas -------------------------------------------------------------


def workload(preset: Preset, seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Per conversation: its agent's system prompt and its turns' messages."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, preset.sizes.vocab) for _ in range(n)]

    systems = [tokens(preset.system_len) for _ in range(preset.agents)]
    starts, messages = [], []
    for agent in range(preset.agents):
        for _ in range(preset.conversations_per_agent):
            starts.append(systems[agent])
            messages.append([tokens(preset.message_len) for _ in range(preset.turns)])
    return starts, messages


class Replica:
    """An engine, its event stream, and its own clock (the seconds its steps took)."""

    def __init__(self, index: int, model_dir: Path, device, dtype, settings: dict, ipc: Path):
        self.endpoint = f"ipc://{ipc}/replica{index}"
        events = {
            "enable_kv_cache_events": True,
            "endpoint": self.endpoint,
            "topic": f"kv@replica{index}@llm",
        }
        self.engine = new_engine(
            model_dir, device, dtype, kv_events_config=json.dumps(events), **settings
        )
        self.events = KVEventStream(
            self.engine.config.kv_events, self.engine.scheduler.kv_cache_manager, "GPU"
        )
        self.busy = 0.0
        self.arrived: dict[str, float] = {}

    def step(self) -> list:
        start = time.perf_counter()
        outputs = self.engine.step()
        self.busy += time.perf_counter() - start
        self.events.flush()
        return outputs

    def close(self) -> None:
        self.events.close()
        self.engine.close()


def run_policy(policy: str, preset: Preset, model_dir: Path, device, dtype, settings: dict, seed):
    """The closed loop under one routing policy on fresh replicas: outputs, TTFTs, hit ratio."""
    starts, messages = workload(preset, seed)
    histories = [list(s) for s in starts]
    order = [(c, t) for t in range(preset.turns) for c in range(len(starts))]
    outputs, ttfts, in_flight = {}, [], {}
    load = [0] * REPLICAS
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as ipc:
        replicas = [
            Replica(i, model_dir, device, dtype, settings, Path(ipc)) for i in range(REPLICAS)
        ]
        router = EventRouter([r.endpoint for r in replicas])
        time.sleep(0.2)  # the subscriptions reach the publishers
        turn = 0
        try:
            while order or in_flight:
                while order and len(in_flight) < preset.in_flight:
                    conversation, t = order.pop(0)
                    prompt = histories[conversation] + messages[conversation][t]
                    if policy == "round_robin":
                        target = turn % REPLICAS
                    else:
                        target = router.pick(prompt, load)
                    turn += 1
                    replica = replicas[target]
                    request_id = f"c{conversation}-t{t}"
                    replica.engine.add_request(
                        request_id, None, greedy(preset.answer_len), prompt_token_ids=prompt
                    )
                    replica.arrived[request_id] = replica.busy
                    in_flight[request_id] = (conversation, t, prompt, target)
                    load[target] += 1
                for replica in replicas:
                    if not replica.engine.has_unfinished_requests():
                        continue
                    for output in replica.step():
                        first = output.outputs[0].token_ids
                        if first and output.request_id in replica.arrived:
                            ttfts.append(replica.busy - replica.arrived.pop(output.request_id))
                        if output.finished:
                            conversation, t, prompt, target = in_flight.pop(output.request_id)
                            histories[conversation] = prompt + output.outputs[0].token_ids
                            outputs[conversation, t] = output.outputs[0].token_ids
                            load[target] -= 1
            hits = sum(r.engine.stats().counters.prefix_cache_hits for r in replicas)
            queries = sum(r.engine.stats().counters.prefix_cache_queries for r in replicas)
        finally:
            router.close()
            for replica in replicas:
                replica.close()
    return {
        "outputs": [outputs[key] for key in sorted(outputs)],
        "ttft": ttfts,
        "hit_ratio": hits / queries if queries else 0.0,
    }


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    longest = preset.system_len + preset.turns * (preset.message_len + preset.answer_len)
    num_params = build_random_llama(preset.sizes, model_dir, args.seed, max_positions=longest)
    conversations = preset.agents * preset.conversations_per_agent
    per_conversation = -(-(longest - preset.system_len) // BLOCK_SIZE)
    working_set = preset.agents * -(-preset.system_len // BLOCK_SIZE) + conversations * (
        per_conversation
    )
    pool = max(working_set // REPLICAS, 2 * -(-longest // BLOCK_SIZE))
    settings = {
        "max_model_len": longest,
        "block_size": BLOCK_SIZE,
        "num_blocks": pool,
        "max_num_seqs": preset.in_flight,
        "max_num_batched_tokens": 2048,
    }
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}; {preset.agents} agents "
        f"x {preset.conversations_per_agent} conversations x {preset.turns} turns; working set "
        f"{working_set} blocks, {REPLICAS} replicas of {pool}"
    )
    runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
    fidelity = {}
    for rep in range(args.repeats):
        for name in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
            runs[name].append(
                run_policy(name, preset, model_dir, device, dtype, settings, args.seed)
            )
            last = runs[name][-1]
            progress(
                f"repeat {rep + 1}/{args.repeats} {name}: TTFT p50 "
                f"{statistics.median(last['ttft']) * 1e3:.1f} ms, hit ratio {last['hit_ratio']:.3f}"
            )
        fidelity[f"repeat_{rep + 1}"] = check_same(
            "round_robin",
            runs["round_robin"][-1]["outputs"],
            {"longest_prefix": runs["longest_prefix"][-1]["outputs"]},
            dtype,
        )
    ttft = {name: [t for r in runs[name] for t in r["ttft"]] for name in POLICIES}
    hit_ratio = {name: statistics.median(r["hit_ratio"] for r in runs[name]) for name in POLICIES}
    ttft_ms = {name: p50_p99_ms(v) for name, v in ttft.items()}
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(preset.sizes), "parameters": num_params},
        "workload": {
            **{k: v for k, v in asdict(preset).items() if k != "sizes"},
            "replicas": REPLICAS,
            "working_set_blocks": working_set,
            "pool_blocks_per_replica": pool,
            "seed": args.seed,
        },
        "settings": {"engine": settings, "torch_threads": args.threads},
        "repeats": args.repeats,
        "ttft_seconds": ttft,
        "ttft_ms": ttft_ms,
        "hit_ratio": hit_ratio,
        "fidelity": fidelity,
        "summary": {
            "kv_routing_ttft_p50_ratio": ttft_ms["round_robin"]["p50"]
            / ttft_ms["longest_prefix"]["p50"],
            "kv_routing_hit_ratio": hit_ratio["longest_prefix"],
            "kv_routing_round_robin_hit_ratio": hit_ratio["round_robin"],
        },
    }


def report(result: dict) -> list[str]:
    w, ms, hits = result["workload"], result["ttft_ms"], result["hit_ratio"]
    lines = [
        f"{w['agents']} agents (each its own {w['system_len']}-token system prompt) x "
        f"{w['conversations_per_agent']} conversations x {w['turns']} turns ({w['message_len']} "
        f"tokens appended, {w['answer_len']}-token answers), {w['in_flight']} in flight; "
        f"{w['replicas']} replicas of {w['pool_blocks_per_replica']} blocks (working set "
        f"{w['working_set_blocks']}). TTFT on each replica's own clock. {result['repeats']} "
        f"repeat(s), {result['dtype']} on {result['device']}; greedy outputs identical under both "
        "policies.",
        "",
        "| routing | TTFT p50 (ms) | TTFT p99 (ms) | prefix-cache hit ratio |",
        "|---|---|---|---|",
    ]
    for name in POLICIES:
        lines.append(
            f"| {name.replace('_', ' ')} | {ms[name]['p50']:.1f} | {ms[name]['p99']:.1f} | "
            f"{hits[name]:.3f} |"
        )
    ratio = result["summary"]["kv_routing_ttft_p50_ratio"]
    lines += ["", f"TTFT p50, round robin over longest prefix: {ratio:.2f}x."]
    return lines


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report)

if __name__ == "__main__":
    BENCHMARK.main()
