"""Device names (issue 31, PROTOCOL.md 10.2/10.4): zl-phone refuses a name its mDNS stack would
put on the wire broken, and --devices compares names case-insensitively, refusing a shared one."""
from __future__ import annotations

import subprocess
import sys

import pytest

from host.devices.discovery import DeviceLookupError, Reachable, pick


@pytest.mark.parametrize("name", ["phone.", ".phone", "a..b", "...", ".", "x._sub", "x._SUB"])
def test_zl_phone_refuses_a_name_that_cannot_be_one_label_on_the_wire(name, tmp_path):
    r = subprocess.run([sys.executable, "-m", "zl_mobile.phone", "--name", name, "--workdir", str(tmp_path / "w"),
                        "--mdns", "none"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zl-phone: error: --name: device name {name!r}"), r.stderr
    assert "cannot advertise" in lines[0] and "advertised as" not in r.stdout
    assert not (tmp_path / "w").exists()  # refused before anything was written


def test_a_name_with_dots_inside_is_still_one_label():
    from zl_mobile.mdns import check_instance_name

    for name in ("Dr. Who's phone", "a.b.c", "x._suba", "_sub"):
        assert check_instance_name(name) == name


def _phone(name: str, port: int, instance: str | None = None) -> Reachable:
    return Reachable(name, "mdns", f"127.0.0.1:{port}", 1, "fake", 1, instance=instance or name)


def test_devices_compare_names_case_insensitively_and_refuse_a_shared_one():
    phones = [_phone("Alpha", 1), _phone("alpha", 2, "alpha (2)"), _phone("beta", 3)]
    with pytest.raises(DeviceLookupError) as e:
        pick("alpha", phones)
    assert "2 devices are named 'alpha'" in str(e.value) and "127.0.0.1:1" in str(e.value)
    with pytest.raises(DeviceLookupError):
        pick("ALPHA", phones)
    assert pick("BETA", phones).endpoint == "127.0.0.1:3"
    assert pick("Alpha (2)", phones).endpoint == "127.0.0.1:2"  # the instance name, unique
    assert pick("127.0.0.1:1", phones).name == "Alpha"
    assert pick("Ä", [_phone("ä", 4)]) is None  # DNS folds ASCII case only
