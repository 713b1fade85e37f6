"""Writes tests/vectors/mdns/mdns.json (docs/PROTOCOL.md 10.5). The expectations below are written by
hand from docs/PROTOCOL.md section 10, not computed by either implementation: edit them here and
run `python tests/vectors/mdns/make_vectors.py`; tests/test_mdns_vectors.py checks the file is current."""
import json
from pathlib import Path

OUT = Path(__file__).with_name("mdns.json")
OK = {"name": "p0", "proto": "2", "runtime": "zl_mobile/executorch", "mem": "8589934592"}
def t(name, txt, status, problems=(), fields=None, txt_hex=None, note=None):
    d = {"name": name, "txt": txt}
    if txt_hex:
        d["txt_hex"] = txt_hex
    d["status"] = status
    d["problems"] = sorted(problems)
    if fields is not None:
        d["fields"] = fields
    if note:
        d["note"] = note
    return d
def w(**kw):
    x = dict(OK)
    x.update(kw)
    return {k: v for k, v in x.items() if v != "__drop__"}


def F(**kw):
    return {**{"name": "p0", "proto": 2, "runtime": "zl_mobile/executorch", "mem": 8589934592, "cpu_share": None}, **kw}


txt = [
    t("ok_minimal", OK, "ok", fields=F()),
    t("ok_cpu_share_half", w(cpu_share="0.5"), "ok", fields=F(cpu_share=0.5)),
    t("ok_cpu_share_whole", w(cpu_share="4"), "ok", fields=F(cpu_share=4.0)),
    t("ok_cpu_share_max", w(cpu_share="1024"), "ok", fields=F(cpu_share=1024.0)),
    t("ok_unknown_keys_ignored", w(color="blue", flag=None), "ok", fields=F(), note="unknown keys, with or without a value, are ignored"),
    t("ok_keys_any_case", {"NAME": "p0", "Proto": "2", "RunTime": "zl_mobile/executorch", "MEM": "8589934592"}, "ok", fields=F()),
    t("ok_dotted_name", w(name="Dr. Who's phone"), "ok", fields=F(name="Dr. Who's phone")),
    t("ok_unicode_name", w(name="\u00dcn\u00efc\u00f6d\u00e9 \u96fb\u8a71 \U0001F4F1"), "ok", fields=F(name="\u00dcn\u00efc\u00f6d\u00e9 \u96fb\u8a71 \U0001F4F1")),
    t("ok_name_63_bytes_multibyte", w(name="\u96fb" * 21), "ok", fields=F(name="\u96fb" * 21)),
    t("ok_mem_zero", w(mem="0"), "ok", fields=F(mem=0)),
    t("ok_mem_leading_zeros", w(mem="0010"), "ok", fields=F(mem=10)),
    t("ok_mem_largest", w(mem="9223372036854775807"), "ok", fields=F(mem=9223372036854775807)),
    t("mem_with_unit", w(mem="8GB"), "invalid", ["mem"], note="avahi-publish ... mem=8GB crashed zl-host devices (issue 21)"),
    t("mem_negative", w(mem="-1"), "invalid", ["mem"]),
    t("mem_plus_sign", w(mem="+5"), "invalid", ["mem"]),
    t("mem_float", w(mem="1.5e9"), "invalid", ["mem"]),
    t("mem_spaces", w(mem=" 42"), "invalid", ["mem"]),
    t("mem_empty", w(mem=""), "invalid", ["mem"]),
    t("mem_no_value", w(mem=None), "invalid", ["mem"], note="'mem' without '=' (a boolean attribute)"),
    t("mem_too_big", w(mem="9223372036854775808"), "invalid", ["mem"]),
    t("mem_twenty_digits", w(mem="99999999999999999999"), "invalid", ["mem"]),
    t("mem_non_ascii_digits", w(mem="\u0663\u0663"), "invalid", ["mem"], note="Arabic-Indic digits: only 0-9"),
    t("mem_not_utf8", w(mem="__hex__"), "invalid", ["mem"], txt_hex={"mem": "ff38"}),
    t("mem_missing", w(mem="__drop__"), "invalid", ["mem"]),
    t("everything_missing", {}, "invalid", ["name", "proto", "runtime", "mem"]),
    t("proto_word", w(proto="one"), "invalid", ["proto"]),
    t("proto_plus_sign", w(proto="+1"), "invalid", ["proto"]),
    t("proto_ten_digits", w(proto="1234567890"), "invalid", ["proto"], note="a version is at most 9 digits"),
    t("proto_missing", w(proto="__drop__"), "invalid", ["proto"]),
    t("proto_1_incompatible", w(proto="1", mem="8GB"), "incompatible", ["proto"],
      fields={"name": "p0", "proto": 1}, note="protocol version 1 (unsealed): its other keys are not checked"),
    t("proto_3_incompatible", w(proto="3"), "incompatible", ["proto"], fields={"name": "p0", "proto": 3}),
    t("proto_0_incompatible", w(proto="0"), "incompatible", ["proto"], fields={"name": "p0", "proto": 0}),
    t("proto_and_mem_bad", w(proto="x", mem="8GB"), "invalid", ["proto", "mem"]),
    t("name_64_bytes", w(name="a" * 64), "invalid", ["name"]),
    t("name_64_bytes_multibyte", w(name="\u96fb" * 21 + "a"), "invalid", ["name"]),
    t("name_empty", w(name=""), "invalid", ["name"]),
    t("name_control_char", w(name="bell\u0007"), "invalid", ["name"]),
    t("name_del_char", w(name="del\u007f"), "invalid", ["name"]),
    t("runtime_empty", w(runtime=""), "invalid", ["runtime"]),
    t("runtime_missing", w(runtime="__drop__"), "invalid", ["runtime"]),
    t("cpu_share_zero", w(cpu_share="0"), "invalid", ["cpu_share"]),
    t("cpu_share_negative", w(cpu_share="-0.5"), "invalid", ["cpu_share"]),
    t("cpu_share_word", w(cpu_share="half"), "invalid", ["cpu_share"]),
    t("cpu_share_nan", w(cpu_share="nan"), "invalid", ["cpu_share"]),
    t("cpu_share_inf", w(cpu_share="inf"), "invalid", ["cpu_share"]),
    t("cpu_share_exponent", w(cpu_share="1e2"), "invalid", ["cpu_share"]),
    t("cpu_share_too_big", w(cpu_share="1024.5"), "invalid", ["cpu_share"]),
    t("cpu_share_no_value", w(cpu_share=None), "invalid", ["cpu_share"]),
    t("cpu_share_empty", w(cpu_share=""), "invalid", ["cpu_share"]),
]
for d in txt:
    if d.get("txt_hex"):
        d["txt"] = {k: v for k, v in d["txt"].items() if k not in d["txt_hex"]}
names = [
    {"label": "p0", "valid": True, "escaped": "p0"},
    {"label": "Pixel 8", "valid": True, "escaped": "Pixel 8"},
    {"label": "Dr. Who's phone", "valid": True, "escaped": "Dr\\. Who's phone"},
    {"label": "a.b.c", "valid": True, "escaped": "a\\.b\\.c"},
    {"label": "back\\slash", "valid": True, "escaped": "back\\\\slash"},
    {"label": "p0 (2)", "valid": True, "escaped": "p0 (2)"},
    {"label": "\u00dcn\u00efc\u00f6d\u00e9 \u96fb\u8a71 \U0001F4F1", "valid": True, "escaped": "\u00dcn\u00efc\u00f6d\u00e9 \u96fb\u8a71 \U0001F4F1"},
    {"label": "a" * 63, "valid": True, "escaped": "a" * 63},
    {"label": "\u96fb" * 21, "valid": True, "escaped": "\u96fb" * 21, "note": "63 bytes of UTF-8"},
    {"label": "a" * 64, "valid": False},
    {"label": "\u96fb" * 21 + "a", "valid": False, "note": "64 bytes of UTF-8 in 22 characters"},
    {"label": "\U0001F4F1" * 16, "valid": False, "note": "64 bytes of UTF-8 in 16 characters"},
    {"label": "", "valid": False},
    {"label": "tab\there", "valid": False},
    {"label": "new\nline", "valid": False},
    {"label": "del\u007f", "valid": False},
]
doc = {
    "about": "docs/PROTOCOL.md section 10 (discovery): the TXT keys and instance name rules. Both the Python host "
             "(zl_mobile/mdns.py check_txt, instance_name_problem, escape_instance) and the Kotlin core "
             "(org.zerolock.core.ZeroLockService / ZeroLockTxt.check) pass every case. txt values: a string, or "
             "null for a key without '='; txt_hex: values given as raw bytes (hex) instead. problems: the keys "
             "that are wrong (the messages are each side's own). fields: what a valid or incompatible record "
             "yields (null: absent).",
    "service_type": "_zerolock._tcp.local.",
    "proto": 2,
    "max_instance_bytes": 63,
    "txt": txt,
    "instance_names": names,
}


def render() -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(), encoding="utf-8")
    print(f"{OUT}: {len(txt)} TXT cases, {len(names)} instance names")
