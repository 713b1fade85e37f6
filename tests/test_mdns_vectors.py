"""docs/PROTOCOL.md section 10 (discovery) on the Python side: tests/vectors/mdns/mdns.json, which
the Kotlin core passes too (kotlin_app/core/src/test/kotlin/org/zerolock/core/DiscoveryVectorsTest.kt).
zl_mobile.mdns.check_txt gets the TXT record as zeroconf hands it over (bytes keys and values,
None for a key without '=')."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zl_mobile.mdns import (
    MAX_LABEL_BYTES,
    PROTO,
    SERVICE_TYPE,
    InstanceNameError,
    check_instance_name,
    check_txt,
    escape_instance,
    instance_name_problem,
    unescape_instance,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "mdns" / "mdns.json").read_text())


def as_zeroconf_props(case: dict) -> dict:
    props = {k.encode(): (None if v is None else v.encode()) for k, v in case["txt"].items()}
    props.update({k.encode(): bytes.fromhex(v) for k, v in case.get("txt_hex", {}).items()})
    return props


def test_constants_match_the_vectors():
    assert (VECTORS["service_type"], VECTORS["proto"], VECTORS["max_instance_bytes"]) == (SERVICE_TYPE, PROTO, MAX_LABEL_BYTES)


@pytest.mark.parametrize("case", VECTORS["txt"], ids=[c["name"] for c in VECTORS["txt"]])
def test_txt_vector(case):
    got = check_txt(as_zeroconf_props(case))
    assert got.status == case["status"], got
    assert sorted(got.problems) == case["problems"], got.problems
    for k, msg in got.problems.items():  # one line each, naming the key's value where there is one
        assert msg and "\n" not in msg
    fields = case.get("fields")
    if fields is not None:
        have = {"name": got.name, "proto": got.proto, "runtime": got.runtime, "mem": got.memory_bytes,
                "cpu_share": got.cpu_share}
        assert {k: have[k] for k in fields} == fields


@pytest.mark.parametrize("case", VECTORS["instance_names"], ids=range(len(VECTORS["instance_names"])))
def test_instance_name_vector(case):
    label = case["label"]
    assert (instance_name_problem(label) is None) == case["valid"]
    if case["valid"]:
        assert check_instance_name(label) == label
        assert escape_instance(label) == case["escaped"]
        assert unescape_instance(case["escaped"]) == label
    else:
        with pytest.raises(InstanceNameError) as e:
            check_instance_name(label)
        assert "\n" not in str(e.value) and "use a shorter name" in str(e.value)


def test_vectors_file_is_current():
    import importlib.util

    path = Path(__file__).parent / "vectors" / "mdns" / "make_vectors.py"
    spec = importlib.util.spec_from_file_location("zl_make_mdns_vectors", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.render() == path.with_name("mdns.json").read_text(encoding="utf-8"), \
        "tests/vectors/mdns/mdns.json is stale: run python tests/vectors/mdns/make_vectors.py"
