"""Speculative decoding: n-gram prompt lookup and the shipped draft model vs plain decoding, one
request at a time and 16 at once.

The default LLM (models/shakespeare-llama), float32 on CPU. The workload's answers repeat their
context: each prompt is a passage followed by its first line again, so the model's continuation
may quote it (what prompt lookup drafts from). Three engines on the same checkpoint: plain;
`speculative_config` ngram (k = 6 drafts, 2- to 3-gram lookup); draft_model with the shipped
one-layer draft (models/shakespeare-draft, k = 4, its weights int8: `quantization`); each k is
the best of 2-8 in interleaved runs on this workload. Both speculate only up to 4 running
sequences (`speculative_disable_by_batch_size`). c1: the prompts one after another, each alone; c16: all 16
added at once (speculation switched off by the batch-size limit). Greedy token ids must be
identical before timing; the systems then run interleaved. Acceptance rate (accepted / draft
tokens) and mean accepted length (1 + accepted per drafted run) are each engine's own counters
over one c1 run.

The peer: OpenVINO GenAI's prompt-lookup pipeline (`LLMPipeline(prompt_lookup=True)`, the same k
as `num_assistant_tokens` and the same longest n-gram as `max_ngram_size`; it tries every shorter
n-gram down to 1) on the checkpoint exported to OpenVINO IR in float32, in a worker of
`.venv-peers` (bench.peers) with the same thread count, given the same prompt token ids, one at a
time; beside it the same pipeline without prompt lookup, to show what speculation adds there.
Their greedy tokens must equal plain decoding's before they are timed, in the c1 rotation. They
are skipped in --quick mode (the report says why) unless --peers.

    python -m bench.spec_decode [--quick] [--peers] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench import cli
from bench.llm import agreement, check_same, greedy, new_engine
from bench.output import progress
from bench.peers import plan
from bench.peers.client import PeerError, PeerWorker
from bench.skeleton import Benchmark
from bench.summary import summary_line, target
from bench.timing import spread, time_interleaved, timed
from tooling.repository import REPO_ROOT

NAME = "spec_decode"
HEADING = "Speculative decoding: n-gram prompt lookup and a draft model vs plain decoding"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=3)
CHECKPOINT = REPO_ROOT / "models" / "shakespeare-llama"
DRAFT_CHECKPOINT = REPO_ROOT / "models" / "shakespeare-draft"
OFF_ABOVE = {"speculative_disable_by_batch_size": 4}
SPECULATIVE = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 3,
        **OFF_ABOVE,
    },
    "draft": {
        "method": "draft_model",
        "model": str(DRAFT_CHECKPOINT.relative_to(REPO_ROOT)),
        "num_speculative_tokens": 4,
        "quantization": "int8",
        **OFF_ABOVE,
    },
}
"""Each speculating system's speculative_config (the draft's path relative to the repository)."""
SYSTEMS = ("plain", *SPECULATIVE)
PEER = "openvino_genai_prompt_lookup"
PEER_PLAIN = "openvino_genai_pipeline"
"""The same OpenVINO GenAI pipeline without prompt lookup: where the peer's speed comes from."""
PEER_KEY = "spec_ngram_vs_openvino_genai_prompt_lookup_c1"
CONVERSIONS = {PEER: "openvino-llm", PEER_PLAIN: "openvino-llm"}
KEYS = ("spec_ngram_vs_plain_c1", "spec_ngram_vs_plain_c16", "spec_draft_vs_plain_c1")
"""The figures of our own systems (PEER_KEY comes with the peer, or is missing with a reason)."""
WORKLOAD_SYSTEMS = {"c1": SYSTEMS, "c16": ("plain", "ngram")}
"""Who runs each timed workload: the draft model's key is c1 only (the peer joins c1 when run)."""

# Public-domain passages (Shakespeare's sonnets and plays), in the training text's form.
PASSAGES = (
    "The little Love-god lying once asleep,\nLaid by his side his heart-inflaming brand,\n"
    "Whilst many nymphs that vow'd chaste life to keep\nCame tripping by; but in her maiden hand\n"
    "The fairest votary took up that fire\nWhich many legions of true hearts had warm'd;\n",
    "CAPULET:\nO brother Montague, give me thy hand:\nThis is my daughter's jointure, for no more\n"
    "Can I demand.\n\nMONTAGUE:\nBut I can give thee more:\nFor I will raise her statue in pure "
    "gold;\n",
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
    "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n",
    "PRINCE:\nA glooming peace this morning with it brings;\nThe sun for sorrow will not show his "
    "head.\nGo hence, to have more talk of these sad things;\nSome shall be pardon'd, and some "
    "punished;\n",
)


def quote_prompts(count: int) -> list[str]:
    """`count` prompts: a passage, a blank line, then the passage's first line again."""
    prompts = []
    for i in range(count):
        passage = PASSAGES[i % len(PASSAGES)]
        prompts.append(passage + "\n" + passage.split("\n")[0] + "\n")
    return prompts


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=None, help="prompts (default 16)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (96)")
    parser.set_defaults(peers=cli.ByMode(quick=False, cpu=True))
    parser.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        help="run OpenVINO GenAI's prompt lookup (builds .venv-peers on first use; default: "
        "%(default)s)",
    )


def run(args: argparse.Namespace, scratch: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    count = args.requests or (4 if args.quick else 16)
    max_tokens = args.max_tokens or (16 if args.quick else 96)
    settings = {"max_model_len": 1024, "num_blocks": 320, "max_num_seqs": 16}
    engines = {"plain": new_engine(CHECKPOINT, device, dtype, **settings)}
    for name, speculative in SPECULATIVE.items():
        engines[name] = new_engine(
            CHECKPOINT,
            device,
            dtype,
            speculative_config=json.dumps(speculative),
            base_dir=REPO_ROOT,
            **settings,
        )
    tokenizer = engines["plain"].tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in quote_prompts(count)]
    progress(f"{NAME}: {count} quoting prompts, {max_tokens} tokens each, {dtype} on {device}")

    def one_by_one(engine) -> list[list[int]]:
        return [engine.generate([p], greedy(max_tokens))[0].outputs[0].token_ids for p in prompts]

    def all_at_once(engine) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in engine.generate(prompts, greedy(max_tokens))]

    before = {name: engines[name].stats().counters for name in SPECULATIVE}
    checked = {name: one_by_one(engine) for name, engine in engines.items()}  # also a warm-up
    counters = {name: engines[name].stats().counters - before[name] for name in SPECULATIVE}
    others = {name: checked[name] for name in SPECULATIVE}
    fidelity = {"c1": check_same("plain", checked["plain"], others, dtype)}
    batched = {name: all_at_once(engines[name]) for name in WORKLOAD_SYSTEMS["c16"]}
    fidelity["c16"] = check_same("plain", batched["plain"], {"ngram": batched["ngram"]}, dtype)

    peer = Peer(args, device, dtype)
    try:
        peer.check(prompts, max_tokens, checked["plain"])
        seconds = {}
        for workload, serve in (("c1", one_by_one), ("c16", all_at_once)):
            systems = {name: _timed(serve, engines[name]) for name in WORKLOAD_SYSTEMS[workload]}
            if workload == "c1" and peer.ready:
                systems.update(peer.timed(prompts, max_tokens))
            seconds[workload], _ = time_interleaved(systems, args.repeats)
    finally:
        peer.close()
    tokens = count * max_tokens
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {"checkpoint": CHECKPOINT.name, "draft_checkpoint": DRAFT_CHECKPOINT.name},
        "workload": {
            "requests": count,
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": tokens,
            "prompt": "a passage, a blank line, its first line again",
            "greedy": True,
            "ignore_eos": True,
        },
        "settings": {
            "engine": settings,
            "speculative_config": SPECULATIVE,
            "threads": args.threads,
        },
        "repeats": args.repeats,
        "seconds": seconds,
        "output_tokens_per_second": {
            w: {name: tokens / statistics.median(times) for name, times in s.items()}
            for w, s in seconds.items()
        },
        "ratio_spread": {
            w: {
                name: spread([p / x for p, x in zip(s["plain"], s[name], strict=True)])
                for name in s
                if name != "plain"
            }
            for w, s in seconds.items()
        },
        "speculation": {name: _acceptance(c, tokens) for name, c in counters.items()},
        "fidelity": {**fidelity, **peer.fidelity},
        "peer": peer.record(),
        "summary": _summary(seconds),
        "missing": {} if peer.ready else {PEER_KEY: peer.why_not},
    }


def _summary(seconds: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Each speculating system against plain decoding, and the peer against our n-gram engine."""
    median = {w: {name: statistics.median(t) for name, t in s.items()} for w, s in seconds.items()}
    summary = {
        f"spec_{name}_vs_plain_{w}": m["plain"] / m[name]
        for w, m in median.items()
        for name in m
        if name in SPECULATIVE
    }
    if PEER in median["c1"]:
        summary[PEER_KEY] = median["c1"][PEER] / median["c1"]["ngram"]
        summary["openvino_genai_prompt_lookup_vs_its_plain_c1"] = (
            median["c1"][PEER_PLAIN] / median["c1"][PEER]
        )
    return summary


class Peer:
    """OpenVINO GenAI's prompt lookup in a `.venv-peers` worker, or why it does not run."""

    def __init__(self, args: argparse.Namespace, device, dtype: str):
        self.dtype, self.threads = dtype, args.threads
        self.why_not = plan.why_no_peers(args, device)
        self.paths: dict[str, str] = {}
        self.settings: dict = {}
        self.fidelity: dict = {}
        self.worker: PeerWorker | None = None
        if self.why_not is None:
            self.paths, reasons = plan.converted_models(CONVERSIONS, CHECKPOINT)
            self.why_not = reasons.get(PEER)

    @property
    def ready(self) -> bool:
        return self.why_not is None and self.worker is not None

    def check(self, prompts: list[list[int]], max_tokens: int, reference: list[list[int]]) -> None:
        """Load both pipelines and require plain decoding's greedy tokens of each (else neither is
        timed, saying why)."""
        if self.why_not is not None:
            return
        ngram = SPECULATIVE["ngram"]
        lookup = {
            "num_assistant_tokens": ngram["num_speculative_tokens"],
            "max_ngram_size": ngram["prompt_lookup_max"],
        }
        self.worker = PeerWorker(self.threads)
        for system, settings in ((PEER, {"prompt_lookup": True, **lookup}), (PEER_PLAIN, {})):
            try:
                path = self.paths[system]
                self.settings[system] = self.worker.load(system, path, self.dtype, **settings)
                outputs, _ = self.worker.generate(system, prompts, [max_tokens] * len(prompts))
            except PeerError as exc:
                self.why_not = f"{system} failed: {exc}"
                return
            same = agreement(reference, outputs)
            self.fidelity[f"c1_{system}_vs_plain"] = same
            progress(f"{system}: greedy agreement with plain decoding {same}")
            if same["requests"] < 1.0:
                self.why_not = f"{system}'s float32 greedy tokens differ from ours ({same})"
                return

    def timed(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Both pipelines as systems timing themselves."""
        assert self.worker is not None
        worker, lens = self.worker, [max_tokens] * len(prompts)
        return {
            system: (lambda s=system: worker.generate(s, prompts, lens, outputs=False))
            for system in (PEER, PEER_PLAIN)
        }

    def record(self) -> dict:
        return {"run": self.ready, "reason": self.why_not, "settings": self.settings}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _acceptance(counters, tokens: int) -> dict:
    """A speculating engine's counters over the c1 check run, as acceptance figures."""
    drafts, accepted = counters.spec_decode_num_drafts, counters.spec_decode_num_accepted_tokens
    return {
        "drafts": drafts,
        "draft_tokens": counters.spec_decode_num_draft_tokens,
        "accepted_tokens": accepted,
        "accepted_per_position": list(counters.spec_decode_num_accepted_tokens_per_pos),
        "acceptance_rate": _share(accepted, counters.spec_decode_num_draft_tokens),
        "mean_accepted_length": 1 + _share(accepted, drafts),
        "steps_saved": _share(accepted, tokens),
    }


def _timed(serve, engine):
    return timed(lambda: serve(engine))


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def report(result: dict) -> list[str]:
    w, tps = result["workload"], result["output_tokens_per_second"]
    configs = result["settings"]["speculative_config"]
    lines = [
        f"{w['requests']} prompts ({w['prompt']}), {w['output_tokens'] // w['requests']} greedy "
        f"tokens each, {result['dtype']} on {result['device']}, {result['repeats']} interleaved "
        "repeat(s); greedy token ids identical with and without speculation (c1: both methods; "
        "c16: ngram). speculative_config: "
        + "; ".join(f"{name} `{json.dumps(c)}`" for name, c in configs.items())
        + ".",
        "",
        "| workload | system | tokens/s | / plain |",
        "|---|---|---|---|",
    ]
    for workload, rates in tps.items():
        for name, rate in rates.items():
            ratio = result["summary"].get(f"spec_{name}_vs_plain_{workload}")
            shown = "" if ratio is None else f"{ratio:.3f}"
            lines.append(f"| {workload} | {name} | {rate:.1f} | {shown} |")
    lines.append("")
    for name, spec in result["speculation"].items():
        lines.append(
            f"{name}, over one c1 run: {spec['drafts']} drafted runs, {spec['draft_tokens']} draft "
            f"tokens, {spec['accepted_tokens']} accepted (acceptance rate "
            f"{spec['acceptance_rate']:.3f}, mean accepted length "
            f"{spec['mean_accepted_length']:.2f} tokens per drafted step; accepted by position "
            f"{spec['accepted_per_position']}); {spec['steps_saved']:.1%} of the decode steps "
            "saved."
        )
    own = result["summary"].get("openvino_genai_prompt_lookup_vs_its_plain_c1")
    if own is not None:
        c1 = tps["c1"]
        lines.append(
            f"OpenVINO GenAI at c1: prompt lookup {c1[PEER]:.1f} tokens/s, its own pipeline without "
            f"it {c1[PEER_PLAIN]:.1f} ({own:.3f}x from speculation); our plain decoding "
            f"{c1['plain']:.1f}."
        )
    for key in (*KEYS, PEER_KEY):
        value = result["summary"].get(key)
        if value is not None:
            lines.append(summary_line(key, value, f">= {target(key):g}", value >= target(key)))
    lines += [f"Not measured: `{key}`: {why}." for key, why in result["missing"].items()]
    return lines


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
