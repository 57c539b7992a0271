"""Init container of the multi-node llm pods (templates/leaderworkerset.yaml):
python3 prepare_multinode_repository.py SOURCE DEST MODEL PARAMETERS_JSON

Makes DEST/MODEL a copy of SOURCE/MODEL whose config.pbtxt carries the multi-node parameters
(each replaces a parameter of the same key); the other entries (version folders) are symlinks to
the source, which stays read-only.
"""

import json
import os
import re
import sys


def with_parameters(text: str, parameters: dict) -> str:
    for key in parameters:
        same_key = (
            r"parameters\s*:?\s*\{\s*key:\s*\""
            + re.escape(key)
            + r"\"\s*value:\s*\{[^{}]*\}\s*\}\s*"
        )
        text = re.sub(same_key, "", text)
    added = "".join(
        f'parameters {{\n  key: "{key}"\n'
        f"  value: {{ string_value: {json.dumps(str(value), ensure_ascii=False)} }}\n}}\n"
        for key, value in parameters.items()
    )
    return text.rstrip("\n") + "\n" + added


def main(source: str, dest: str, model: str, parameters_json: str) -> None:
    with open(parameters_json) as f:
        parameters = json.load(f)
    src, out = os.path.join(source, model), os.path.join(dest, model)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name == "config.pbtxt":
            continue
        link = os.path.join(out, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.join(src, name), link)
    with open(os.path.join(src, "config.pbtxt")) as f:
        text = with_parameters(f.read(), parameters)
    with open(os.path.join(out, "config.pbtxt"), "w") as f:
        f.write(text)
    print(f"{out}/config.pbtxt: " + ", ".join(f"{k}={v}" for k, v in parameters.items()))


if __name__ == "__main__":
    main(*sys.argv[1:])
