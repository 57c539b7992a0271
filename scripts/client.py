#!/usr/bin/env python3
"""Stream a completion from the `llm` model over gRPC and print the text as it arrives.

python scripts/client.py "ROMEO:" --max-tokens 80 --temperature 0.8
python scripts/client.py "To be, or not to be" --url localhost:8001 --seed 7
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def stream_completion(url: str, model: str, prompt: str, params: dict) -> str:
    """Send one streaming request; print and return the generated text."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []
    for name, value, datatype in (
        ("text_input", prompt.encode(), "BYTES"),
        ("stream", True, "BOOL"),
        ("sampling_parameters", json.dumps(params).encode(), "BYTES"),
    ):
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        inputs.append(tensor)
    pieces = []
    try:
        client.async_stream_infer(model, inputs)
        while True:
            result, error = responses.get()
            if error is not None:
                raise RuntimeError(str(error))
            piece = result.as_numpy("text_output")
            if piece is not None:
                text = b"".join(piece).decode()
                pieces.append(text)
                print(text, end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    print()
    return "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        params["seed"] = args.seed
    print(args.prompt, end="", flush=True)
    try:
        stream_completion(args.url, args.model, args.prompt, params)
    except RuntimeError as exc:
        sys.exit(f"\nerror: {exc}")


if __name__ == "__main__":
    main()
