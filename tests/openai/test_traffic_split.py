"""Traffic splits between model versions (openai_frontend/traffic.py): weighted and sticky
assignment, pinned ids, the version named in every response, versions that are not ready, the
admin endpoint and the split file, and per-version metrics. Against a stand-in for tritonserver
(tests/e2e has the same through real servers)."""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter

import pytest

from backend_lib import contract
from openai_frontend.errors import APIError
from openai_frontend.traffic import (
    SplitError,
    VersionSplit,
    assign,
    parse_split_flag,
    read_split_file,
)
from tests.openai.fake_triton_helpers import FakeTriton, fake_app, llm_spec
from tooling.repository import write_model

ADMIN_KEY = "admin-secret"
BODY = {"model": "llm", "prompt": "ROMEO:", "max_tokens": 1}


def _split(**weights: int) -> VersionSplit:
    return VersionSplit.parse("llm", {v.lstrip("v"): w for v, w in weights.items()})


# --- assignment -------------------------------------------------------------------------------


def test_keyed_assignment_lands_on_the_weights_and_sticks():
    split = _split(v1=90, v2=10)
    rng = random.Random(0)
    keys = [f"user-{i}" for i in range(2000)]
    chosen = {k: assign(split, ["1", "2"], k, rng).version for k in keys}
    share = Counter(chosen.values())["2"] / len(keys)
    assert abs(share - 0.10) <= 0.03, share
    assert all(assign(split, ["1", "2"], k, rng).version == chosen[k] for k in keys[:300])


def test_unkeyed_assignment_is_random_by_weight():
    rng = random.Random(1)
    drawn = Counter(
        assign(_split(v1=90, v2=10), ["1", "2"], None, rng).version for _ in range(2000)
    )
    assert abs(drawn["2"] / 2000 - 0.10) <= 0.03, drawn
    assert {assign(_split(v1=100, v2=0), ["1", "2"], None, rng).version for _ in range(50)} == {"1"}


def test_a_weight_change_moves_only_the_keys_it_must():
    """90/10 -> 70/30: keys move from 1 to 2 only, about a fifth of them (rendezvous hashing)."""
    rng = random.Random(0)
    keys = [f"k{i}" for i in range(2000)]
    before = {k: assign(_split(v1=90, v2=10), ["1", "2"], k, rng).version for k in keys}
    after = {k: assign(_split(v1=70, v2=30), ["1", "2"], k, rng).version for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "1" and after[k] == "2" for k in moved)
    assert abs(len(moved) / len(keys) - 0.20) <= 0.03


def test_a_version_not_ready_gives_its_share_to_the_others():
    rng = random.Random(0)
    split = _split(v1=50, v2=30, v3=20)
    for key in [f"k{i}" for i in range(300)]:
        full = assign(split, ["1", "2", "3"], key, rng)
        partial = assign(split, ["1", "3"], key, rng)
        assert partial.version in ("1", "3")
        if full.version != "2":
            assert partial == full  # the others keep their keys
        else:
            assert partial.rerouted_from == "2"
    assert assign(split, ["4"], "k", rng) is None  # none of the split's versions is ready


@pytest.mark.parametrize(
    "weights, fragment",
    [
        ({"1": 90, "2": 20}, "sum to 110"),
        ({"1": 101, "2": -1}, "0..100"),
        ({"one": 100}, "not a Triton version"),
        ({"1": 50.5, "2": 49.5}, "integer percent"),
        ({"1": True}, "integer percent"),
        ([("1", 50), ("1", 50)], "twice"),
        ("90/10", "expected"),
    ],
)
def test_bad_splits_are_refused_naming_the_problem(weights, fragment):
    with pytest.raises(SplitError, match=fragment):
        VersionSplit.parse("llm", weights)


def test_the_flag_and_the_file_spell_the_same_split(tmp_path):
    model, split = parse_split_flag("llm=1:90, 2:10")
    assert (model, split.as_dict()) == ("llm", {"1": 90, "2": 10})
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"splits": {"llm": {"1": 90, "2": 10}}}))
    assert read_split_file(path) == {"llm": split}
    for bad in ("llm", "llm=1-90", "=1:100"):
        with pytest.raises(SplitError):
            parse_split_flag(bad)


# --- through the frontend ---------------------------------------------------------------------


@pytest.fixture
def two_versions(tmp_path):
    write_model(llm_spec(versions=(1, 2)), tmp_path)
    facts = {("llm", v): contract.ModelFacts(max_model_len=1024) for v in ("1", "2")}
    return tmp_path, FakeTriton([llm_spec(versions=(1, 2))], facts)


def _serve(two_versions, **settings):
    repository, fake = two_versions
    settings.setdefault("triton_admin_key", ADMIN_KEY)
    return fake_app(repository, fake, index_ttl_s=0.0, **settings), fake


def _metric(client, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no series {name}{{{wanted}}}")


def test_pinned_ids_are_listed_and_reach_their_version(two_versions):
    client, fake = _serve(two_versions)
    with client:
        listed = {m["id"] for m in client.get("/v1/models").json()["data"]}
        assert {"llm", "llm:1", "llm:2"} <= listed
        assert client.get("/v1/models/llm:1").json()["id"] == "llm:1"
        for version in ("1", "2", "1"):
            reply = client.post("/v1/completions", json={**BODY, "model": f"llm:{version}"})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == f"llm:{version}"
            assert reply.headers["x-model-version"] == version
            assert fake.versions_asked[-1] == ("llm", version)
        # Without a split the plain name is the newest version, and says so.
        plain = client.post("/v1/completions", json=BODY)
        assert plain.json()["model"] == "llm:2" and plain.headers["x-model-version"] == "2"
        missing = client.post("/v1/completions", json={**BODY, "model": "llm:3"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_a_split_from_the_flags_is_weighted_and_sticky(two_versions):
    client, fake = _serve(two_versions, traffic_splits=("llm=1:90,2:10",))
    with client:
        served = Counter()
        for i in range(300):
            reply = client.post("/v1/completions", json=BODY, headers={"x-ab-key": f"user-{i}"})
            assert reply.status_code == 200
            served[reply.headers["x-model-version"]] += 1
            assert reply.json()["model"] == f"llm:{reply.headers['x-model-version']}"
        assert 0.04 <= served["2"] / 300 <= 0.18, served
        for key in ("alice", "bob", "carol"):  # the header or the body's `user`, stuck
            by_header = {
                client.post("/v1/completions", json=BODY, headers={"x-ab-key": key}).headers[
                    "x-model-version"
                ]
                for _ in range(10)
            }
            by_user = {
                client.post("/v1/completions", json={**BODY, "user": key}).headers[
                    "x-model-version"
                ]
                for _ in range(10)
            }
            assert len(by_header) == 1 and by_header == by_user
        share = served["2"]
        assert (
            _metric(client, "openai_frontend_model_requests_total", version="2", status="200")
            >= share
        )
        assert _metric(client, "openai_frontend_split_weight", model="llm", version="1") == 90


def test_a_version_not_ready_takes_no_traffic_and_the_metric_says_so(two_versions):
    client, fake = _serve(two_versions, traffic_splits=("llm=1:50,2:50",))
    with client:
        fake.ready.discard(("llm", "2"))
        replies = [client.post("/v1/completions", json=BODY) for _ in range(40)]
        assert {r.status_code for r in replies} == {200}
        assert {r.headers["x-model-version"] for r in replies} == {"1"}
        rerouted = _metric(client, "openai_frontend_split_rerouted_total", model="llm", version="2")
        assert 5 <= rerouted <= 35  # about half were assigned to 2
        assert client.post("/v1/completions", json={**BODY, "model": "llm:2"}).status_code == 404


def test_the_admin_endpoint_changes_splits_and_refuses_bad_ones(two_versions):
    client, _ = _serve(two_versions)
    auth = {"x-admin-key": ADMIN_KEY}
    url = "/admin/traffic-splits/llm"
    with client:
        assert client.get("/admin/traffic-splits").status_code == 401
        wrong = client.put(url, json={"weights": {"1": 100}}, headers={"x-admin-key": "nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        for weights, status in [
            ({"1": 60, "2": 30}, 400),  # sums to 90
            ({"1": 50, "3": 50}, 400),  # version 3 is not served
        ]:
            reply = client.put(url, json={"weights": weights}, headers=auth)
            assert reply.status_code == status, reply.text
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
        ghost = client.put(
            "/admin/traffic-splits/ghost", json={"weights": {"1": 100}}, headers=auth
        )
        assert ghost.status_code == 404
        ok = client.put(url, json={"weights": {"1": 0, "2": 100}}, headers=auth)
        assert ok.status_code == 200 and ok.json()["weights"] == {"1": 0, "2": 100}
        assert client.get("/admin/traffic-splits", headers=auth).json() == {
            "splits": {"llm": {"1": 0, "2": 100}}
        }
        assert (
            client.put(url, json={"weights": {"1": 100, "2": 0}}, headers=auth).status_code == 200
        )
        versions = {
            client.post("/v1/completions", json=BODY).headers["x-model-version"] for _ in range(10)
        }
        assert versions == {"1"}
        assert client.delete(url, headers=auth).status_code == 200
        assert client.delete(url, headers=auth).status_code == 404
        assert client.post("/v1/completions", json=BODY).headers["x-model-version"] == "2"


def test_without_an_admin_key_the_admin_endpoint_is_off(two_versions):
    client, _ = _serve(two_versions, triton_admin_key=None)
    with client:
        reply = client.get("/admin/traffic-splits", headers={"x-admin-key": ""})
        assert reply.status_code == 403 and "disabled" in reply.json()["error"]["message"]


def test_the_split_file_is_read_again_when_it_changes(two_versions, tmp_path):
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"splits": {"llm": {"1": 100, "2": 0}}}))
    client, _ = _serve(two_versions, traffic_split_file=path)
    with client:
        assert client.post("/v1/completions", json=BODY).headers["x-model-version"] == "1"
        time.sleep(0.01)  # a new modification time
        path.write_text(json.dumps({"splits": {"llm": {"1": 0, "2": 100}}}))
        assert client.post("/v1/completions", json=BODY).headers["x-model-version"] == "2"
        path.write_text("{broken")  # kept: the splits in force stay
        assert client.post("/v1/completions", json=BODY).headers["x-model-version"] == "2"


def test_the_admin_view_follows_the_split_file_without_a_request(two_versions, tmp_path):
    """`GET /admin/traffic-splits` re-reads a changed split file itself: no inference request
    needs to come first (it showed the old split until one did)."""
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"splits": {"llm": {"1": 100, "2": 0}}}))
    client, _ = _serve(two_versions, traffic_split_file=path)
    with client:
        headers = {"x-admin-key": ADMIN_KEY}
        assert client.get("/admin/traffic-splits", headers=headers).json() == {
            "splits": {"llm": {"1": 100, "2": 0}}
        }
        path.write_text(json.dumps({"splits": {"llm": {"1": 30, "2": 70}}}))
        stat = path.stat()  # a new modification time, however coarse the file system's clock
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert client.get("/admin/traffic-splits", headers=headers).json() == {
            "splits": {"llm": {"1": 30, "2": 70}}
        }


class UnloadingTriton(FakeTriton):
    """Version 2 is unloaded just as a request reaches it (Triton's refusal, then the index)."""

    async def generate(
        self, model, prompt, sampling_parameters, *, stream, logprobs=False, version="", images=None
    ):
        if version == "2":
            self.ready.discard(("llm", "2"))
            raise APIError(
                500,
                "Request for unknown model: 'llm' version 2 is not at ready state",
                "internal_server_error",
            )
        async for response in super().generate(
            model, prompt, sampling_parameters, stream=stream, logprobs=logprobs, version=version
        ):
            yield response


def test_a_version_gone_under_a_request_is_replaced_before_anything_is_answered(tmp_path):
    write_model(llm_spec(versions=(1, 2)), tmp_path)
    facts = {("llm", v): contract.ModelFacts(max_model_len=1024) for v in ("1", "2")}
    fake = UnloadingTriton([llm_spec(versions=(1, 2))], facts)
    client = fake_app(tmp_path, fake, index_ttl_s=60.0, traffic_splits=("llm=1:0,2:100",))
    with client:
        reply = client.post("/v1/completions", json=BODY)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-model-version"] == "1" and reply.json()["model"] == "llm:1"
        assert fake.versions_asked == [("llm", "1")]
        fake.ready.add(("llm", "2"))
        pinned = client.post("/v1/completions", json={**BODY, "model": "llm:2"})
        assert pinned.status_code == 500  # a pinned version is that version or an error


def test_bad_split_settings_fail_at_start_naming_the_field(tmp_path):
    from openai_frontend.config import FrontendConfig, FrontendConfigError

    with pytest.raises(FrontendConfigError, match="traffic_splits.*sum to 95"):
        FrontendConfig(traffic_splits=("llm=1:90,2:5",))
    broken = tmp_path / "splits.json"
    broken.write_text("{broken")
    with pytest.raises(FrontendConfigError, match="traffic_split_file.*not valid JSON"):
        FrontendConfig(traffic_split_file=broken)
