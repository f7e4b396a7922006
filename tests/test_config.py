"""supervisor.config: the embedded default, every validation rule, sizes, channel specs."""
from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import config
from supervisor.config import ConfigFileError, Problem, format_size, load, loads, parse_size
from supervisor.config._values import _SIZE_UNITS
from supervisor.ipc.errors import ConfigError
from supervisor.ipc.spec import ChannelSpec

SRC = "cars/test.toml"


# ------------------------------------------------------------------ helpers

def to_toml(doc: dict) -> str:
    """Just enough TOML writing for these tests: [section.name] tables of scalars/arrays."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        return "[" + ", ".join(value(x) for x in v) + "]"

    def key(k):
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)

    lines = []
    for section, body in doc.items():
        if not isinstance(body, dict):
            lines.append(f"{key(section)} = {value(body)}")
            continue
        flat = {k: v for k, v in body.items() if not isinstance(v, dict)}
        if flat or not body:
            lines.append(f"[{key(section)}]")
            lines += [f"{key(k)} = {value(v)}" for k, v in flat.items()]
        for name, table in body.items():
            if isinstance(table, dict):
                lines.append(f"[{key(section)}.{key(name)}]")
                lines += [f"{key(k)} = {value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


BASE = {
    "domains": {
        "control": {"actuates": True, "failure_policy": "fail_safe"},
        "research": {},
    },
    "channels": {
        "frames": {"slot_size": "1MiB", "kind": "frame", "pixel_formats": ["nv12"]},
        "plan": {"slot_size": 4096, "dtype": "float32"},
        "cmd": {"slot_size": 4096, "dtype": "float32"},
        "shadow": {"slot_size": 4096, "dtype": "float32", "shadow": True},
    },
    "workers": {
        "cam": {"domain": "control", "module": "workers.camerad", "publishes": ["frames"]},
        "model": {"domain": "control", "module": "workers.modeld",
                  "subscribes": ["frames"], "publishes": ["plan"]},
        "ctl": {"domain": "control", "command": ["/usr/bin/ctl", "-v"],
                "subscribes": ["plan"], "publishes": ["cmd"]},
        "lab": {"domain": "research", "module": "workers.research", "optional": True,
                "subscribes": ["frames"], "publishes": ["shadow"]},
    },
}


def base() -> dict:
    return copy.deepcopy(BASE)


def load_doc(doc: dict) -> config.Config:
    return loads(to_toml(doc), SRC)


def problems(doc_or_text) -> list[Problem]:
    text = doc_or_text if isinstance(doc_or_text, str) else to_toml(doc_or_text)
    with pytest.raises(ConfigFileError) as info:
        loads(text, SRC)
    err = info.value
    for p in err.problems:          # every problem also appears, file-qualified, in the message
        assert p.file == SRC
        assert str(p) in str(err)
    return err.problems


def one_problem(doc_or_text, key: str) -> str:
    found = problems(doc_or_text)
    matching = [p for p in found if p.key == key]
    assert matching, f"no problem at {key!r}; got {[str(p) for p in found]}"
    assert str(matching[0]).startswith(f"{SRC}: {key}: ")
    return matching[0].reason


# ------------------------------------------------------------------ the default

def test_default_loads_with_start_order():
    """The embedded default is the car: three cameras, the driving model on road + wide,
    the driver monitor, controls (tests/test_vehicle_config.py checks the car's wiring)."""
    cfg = load()
    order = cfg.start_order()
    assert sorted(order) == sorted(cfg.workers) == [
        "camerad", "camerad_driver", "camerad_wide", "controlsd", "dmonitoringd", "modeld",
        "research"]
    assert order.index("camerad") < order.index("modeld") < order.index("controlsd")
    assert order.index("camerad_wide") < order.index("modeld")
    assert order.index("camerad_driver") < order.index("dmonitoringd") < order.index("controlsd")
    assert order.index("camerad") < order.index("research")
    assert cfg.domains["control"].failure_policy == "fail_safe"
    assert cfg.domains["control"].actuates and not cfg.domains["control"].network
    assert not cfg.domains["research"].network and not cfg.domains["research"].actuates
    assert cfg.workers["research"].optional and cfg.workers["research"].domain == "research"
    assert cfg.workers["modeld"].watchdog_ms == 500
    assert cfg.workers["controlsd"].watchdog_ms == 200
    assert cfg.workers["modeld"].argv("py") == ["py", "-m", "workers.modeld"]
    assert cfg.workers["dmonitoringd"].argv("py") == ["py", "-m", "workers.modeld"]
    assert cfg.supervisor.maps_scan_interval_s == 1.0 and cfg.supervisor.log_format == "json"


def test_default_channels():
    cfg = load()
    specs = cfg.channel_specs()
    cameras = ["driver_frames", "road_frames", "wide_frames"]
    assert sorted(specs) == sorted(["control_cmd", "driver_state", "model_out", "shadow_out",
                                    *cameras])
    for name in cameras:
        frames = specs[name]
        assert frames.kind == "frame" and frames.pixel_formats == ("nv12",)
        assert frames.dtype == "uint8" and frames.slot_count == 6 and frames.max_age_ms == 100
        assert frames.slot_size >= 1928 * 1208 * 3 // 2
        assert frames.slot_size == parse_size("3.5MiB")
    assert specs["road_frames"].max_readers == 3            # modeld + research + 1 spare
    assert cfg.readers_of("road_frames") == ["modeld", "research"]
    assert cfg.readers_of("wide_frames") == ["modeld"]
    assert cfg.readers_of("driver_frames") == ["dmonitoringd"]
    assert cfg.writer_of("road_frames") == "camerad"
    assert cfg.writer_of("driver_state") == "dmonitoringd"
    assert cfg.channels["shadow_out"].shadow and not cfg.channels["model_out"].shadow
    assert all(specs[n].dtype == "float32"
               for n in ("model_out", "driver_state", "control_cmd", "shadow_out"))
    # channel ids: sorted names, 1-based
    assert [specs[n].channel_id for n in sorted(specs)] == list(range(1, 8))


def test_minimal_config_is_the_one_camera_pipeline():
    """configs/minimal.toml (`minimal_doc()`): what tests of the mechanics run."""
    cfg = loads(config.dumps(config.minimal_doc()), "minimal.toml")
    assert cfg.start_order() == ["camerad", "modeld", "controlsd", "research"]
    assert sorted(cfg.channels) == ["control_cmd", "model_out", "road_frames", "shadow_out"]
    assert cfg.workers["modeld"].model == "lane-offset"
    assert dict(cfg.workers["controlsd"].roles) == {"model": "model_out", "command": "control_cmd"}


def test_load_path_and_default_agree(tmp_path):
    from importlib import resources
    text = resources.files("supervisor").joinpath("default.toml").read_text()
    path = tmp_path / "copy.toml"
    path.write_text(text)
    assert load(path).channel_specs() == load().channel_specs()
    assert load(str(path)).source == str(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigFileError) as info:
        load(tmp_path / "nope.toml")
    assert "nope.toml" in str(info.value) and "cannot read" in str(info.value)


def test_invalid_toml_names_file():
    with pytest.raises(ConfigFileError) as info:
        loads("[workers\n", SRC)
    assert str(info.value).startswith(SRC) and "not valid TOML" in str(info.value)


def test_errors_are_ipc_config_errors():
    with pytest.raises(ConfigError):
        loads("[nonsense]\n", SRC)


# ------------------------------------------------------------------ channel specs

def test_channel_specs_are_valid_with_derived_max_readers():
    doc = base()
    doc["workers"]["viz"] = {"domain": "research", "module": "v", "optional": True,
                             "subscribes": ["plan"], "shadow_subscribes": ["shadow"]}
    doc["channels"]["frames"]["slot_count"] = 8
    cfg = load_doc(doc)
    specs = cfg.channel_specs()
    assert all(isinstance(s, ChannelSpec) for s in specs.values())
    assert specs["frames"].max_readers == 3          # model, lab + spare
    assert specs["plan"].max_readers == 3            # ctl, viz + spare
    assert specs["shadow"].max_readers == 2          # viz (shadow read) + spare
    assert specs["cmd"].max_readers == 1             # nobody reads: just the spare
    assert cfg.readers_of("shadow") == ["viz"]
    for s in specs.values():                          # every one passes ChannelSpec's own checks
        assert ChannelSpec(**{f: getattr(s, f) for f in
                              ("name", "slot_size", "slot_count", "dtype", "kind",
                               "pixel_formats", "max_readers", "max_leases", "lease_ms",
                               "max_age_ms", "crc", "channel_id")}) == s


def test_explicit_max_readers_and_integrity_alias():
    doc = base()
    doc["channels"]["plan"].update(max_readers=3, integrity=True, slot_count=5, lease_ms=20)
    spec = load_doc(doc).channel_specs()["plan"]
    assert spec.max_readers == 3 and spec.crc and spec.lease_ms == 20


def test_max_readers_below_reader_count():
    doc = base()
    doc["channels"]["frames"]["max_readers"] = 1
    reason = one_problem(doc, "channels.frames.max_readers")
    assert "less than the 2 workers that read it (model, lab)" in reason


def test_slot_count_too_small_for_derived_readers():
    doc = base()
    doc["channels"]["frames"]["slot_count"] = 3       # needs > 3 readers * 1 lease
    reason = one_problem(doc, "channels.frames.slot_count")
    assert "must exceed max_readers * max_leases = 3 * 1" in reason
    assert "slot_count = 4 or more" in reason


def test_crc_and_integrity_together():
    doc = base()
    doc["channels"]["plan"].update(crc=True, integrity=True)
    assert "set only one" in one_problem(doc, "channels.plan.integrity")


def test_channel_field_checks():
    doc = base()
    doc["channels"]["plan"].update(dtype="float31", pixel_formats=["nv12"])
    doc["channels"]["frames"]["pixel_formats"] = ["nv12", "yuyv"]
    doc["channels"]["cmd"]["slot_size"] = "2GiB"
    assert "did you mean 'float32'" in one_problem(doc, "channels.plan.dtype")
    assert "'yuyv' is not one of" in one_problem(doc, "channels.frames.pixel_formats[1]")
    assert "2GiB is out of range" in one_problem(doc, "channels.cmd.slot_size")


def test_quoted_key_paths():
    doc = base()
    doc["channels"]["bad.name"] = {"slot_size": 64}
    doc["workers"]["cam"]["publishes"].append("bad.name")
    assert "must match" in one_problem(doc, 'channels."bad.name"')


def test_bad_channel_name():
    doc = base()
    doc["channels"]["Bad-Name"] = {"slot_size": 64}
    doc["workers"]["cam"]["publishes"].append("Bad-Name")
    assert "must match" in one_problem(doc, "channels.Bad-Name")


# ------------------------------------------------------------------ structural errors

def test_unknown_key_suggests_close_match():
    doc = base()
    doc["workers"]["model"]["subscribe"] = doc["workers"]["model"].pop("subscribes")
    reason = one_problem(doc, "workers.model.subscribe")
    assert reason == "unknown key; did you mean 'subscribes'?"


def test_unknown_keys_everywhere():
    doc = base()
    doc["supervisor"] = {"maps_scan_interval": 2.0}
    doc["domains"]["control"]["netwrok"] = False
    doc["channels"]["plan"]["slotsize"] = 10
    doc["workers"]["cam"]["zzz"] = 1
    doc["workres"] = {"x": {"domain": "control"}}
    found = {p.key: p.reason for p in problems(doc)}
    assert found["supervisor.maps_scan_interval"].endswith("did you mean 'maps_scan_interval_s'?")
    assert found["domains.control.netwrok"].endswith("did you mean 'network'?")
    assert found["channels.plan.slotsize"].endswith("did you mean 'slot_size'?")
    assert found["workers.cam.zzz"] == "unknown key"
    assert found["workres"].endswith("did you mean 'workers'?")


def test_missing_required_fields():
    doc = base()
    del doc["workers"]["cam"]["domain"]
    del doc["workers"]["model"]["module"]
    del doc["channels"]["plan"]["slot_size"]
    found = {p.key: p.reason for p in problems(doc)}
    assert found["workers.cam.domain"] == "required key is missing"
    assert found["channels.plan.slot_size"] == "required key is missing"
    assert "set exactly one of module" in found["workers.model"]


def test_module_and_command_both_set():
    doc = base()
    doc["workers"]["cam"]["command"] = ["/bin/cam"]
    assert "only one of module" in one_problem(doc, "workers.cam.command")


def test_wrong_types():
    doc = base()
    doc["workers"]["cam"].update(watchdog_ms="500", optional="yes", args=["-v", 3],
                                 restart="sometimes", cpu_quota="lots")
    doc["domains"]["research"]["network"] = 0
    doc["supervisor"] = {"status_interval_s": "fast", "log_format": "xml"}
    found = {p.key: p.reason for p in problems(doc)}
    assert found["workers.cam.watchdog_ms"] == "expected an integer, got string '500'"
    assert found["workers.cam.optional"] == "expected true or false, got string 'yes'"
    assert found["workers.cam.args[1]"] == "expected a string, got integer 3"
    assert "'sometimes' is not one of 'always', 'on-failure', 'never'" in found["workers.cam.restart"]
    assert "not a percentage" in found["workers.cam.cpu_quota"]
    assert found["domains.research.network"] == "expected true or false, got integer 0"
    assert found["supervisor.status_interval_s"] == "expected a number, got string 'fast'"
    assert "nan must be at least 0.01 s and finite" in one_problem(
        to_toml(base()) + "[supervisor]\nmaps_scan_interval_s = nan\n",
        "supervisor.maps_scan_interval_s")
    assert "'xml' is not one of 'json', 'text'" in found["supervisor.log_format"]


def test_section_entries_must_be_tables():
    doc = base()
    doc["workers"]["cam"] = "camerad"
    found = {p.key: p.reason for p in problems(doc)}
    assert "expected a table [workers.cam]" in found["workers.cam"]


def test_invalid_sizes():
    doc = base()
    doc["workers"]["model"]["memory_max"] = "512"          # bytes: surely meant MiB
    doc["workers"]["ctl"]["memory_max"] = "1.5 furlongs"
    doc["channels"]["plan"]["slot_size"] = "3.3KiB"        # not whole bytes
    doc["channels"]["cmd"]["slot_size"] = 0
    doc["channels"]["shadow"]["slot_size"] = 4.5
    found = {p.key: p.reason for p in problems(doc)}
    assert "512 is out of range; must be in 1MiB..1TiB" in found["workers.model.memory_max"]
    assert "unknown unit 'furlongs'" in found["workers.ctl.memory_max"]
    assert "not a whole number" in found["channels.plan.slot_size"]
    assert "out of range" in found["channels.cmd.slot_size"]
    assert "got float 4.5" in found["channels.shadow.slot_size"]


def test_memory_max_floor_for_module_workers():
    doc = base()
    doc["workers"]["cam"]["memory_max"] = "16MiB"
    assert one_problem(doc, "workers.cam.memory_max") == \
        "16MiB cannot host the interpreter (minimum 64MiB)"
    doc["workers"]["cam"]["memory_max"] = "64MiB"                # the floor itself is fine
    doc["workers"]["ctl"]["memory_max"] = "16MiB"                # a command: not Python
    cfg = load_doc(doc)
    assert cfg.workers["cam"].memory_max == config.MIN_WORKER_MEMORY == 64 * 2**20
    assert cfg.workers["ctl"].memory_max == 16 * 2**20


def test_shm_budget_key():
    assert load().supervisor.shm_budget == 2 * 2**30
    doc = base()
    doc["supervisor"] = {"shm_budget": "1GiB"}
    assert load_doc(doc).supervisor.shm_budget == 2**30
    doc["supervisor"] = {"shm_budget": "lots"}
    assert "not a size" in one_problem(doc, "supervisor.shm_budget")
    doc["supervisor"] = {"shm_budget": 4096}
    assert "out of range" in one_problem(doc, "supervisor.shm_budget")


def test_default_channels_fit_the_budget_with_room():
    cfg = load()           # three cameras of 6 slots of 3.5 MiB: ~64 MiB of the 2 GiB
    total = sum(config.channel_shm_bytes(c.spec) for c in cfg.channels.values())
    assert 60 * 2**20 < total < 80 * 2**20 < cfg.supervisor.shm_budget


def test_channels_over_shm_budget_name_the_biggest():
    doc = base()
    doc["supervisor"] = {"shm_budget": "4MiB"}
    reason = one_problem(doc, "channels")
    assert reason.startswith("total ") and "of shared memory for 4 channels" in reason
    assert "(biggest: frames 4 slots of 1MiB = " in reason       # the largest first
    assert "exceeds shm_budget 4MiB" in reason
    doc["channels"]["frames"].update(slot_size="1GiB", slot_count=1024)
    doc["supervisor"] = {}
    reason = one_problem(doc, "channels")
    assert "total 1.0TiB" in reason and "frames 1024 slots of 1GiB = 1.0TiB" in reason
    assert "exceeds shm_budget 2GiB" in reason


def test_no_workers():
    assert "no workers defined" in one_problem("[domains.control]\n", "workers")


def test_backoff_max_below_initial():
    doc = base()
    doc["workers"]["cam"].update(backoff_initial_ms=1000, backoff_max_ms=10)
    assert "below backoff_initial_ms (1000)" in one_problem(doc, "workers.cam.backoff_max_ms")


def test_extra_ro_binds_must_be_absolute():
    doc = base()
    doc["domains"]["research"]["extra_ro_binds"] = ["/opt/models", "data", "/"]
    found = {p.key: p.reason for p in problems(doc)}
    assert "absolute path" in found["domains.research.extra_ro_binds[1]"]
    doc["domains"]["research"]["extra_ro_binds"] = ["/opt/models", "/"]
    assert "whole host" in one_problem(doc, "domains.research.extra_ro_binds[1]")
    doc["domains"]["research"]["extra_ro_binds"] = ["/opt/models"]
    assert load_doc(doc).domains["research"].extra_ro_binds == ("/opt/models",)


# ------------------------------------------------------------------ domain rules

def test_unknown_domain_suggests():
    doc = base()
    doc["workers"]["lab"]["domain"] = "resarch"
    assert one_problem(doc, "workers.lab.domain") == (
        "unknown domain 'resarch'; did you mean 'research'?")


def test_control_domain_must_exist_for_control_workers():
    doc = base()
    del doc["domains"]["control"]
    reason = one_problem(doc, "workers.cam.domain")
    assert "needs a [domains.control] table" in reason


def test_control_network_forbidden_and_only_control_actuates():
    doc = base()
    doc["domains"]["control"]["network"] = True
    doc["domains"]["research"]["actuates"] = True
    assert "must not have network access" in one_problem(doc, "domains.control.network")
    assert "only a 'control'-profile domain may actuate" in one_problem(doc, "domains.research.actuates")


def test_control_failure_policy_defaults_to_fail_safe():
    doc = base()
    del doc["domains"]["control"]["failure_policy"]
    cfg = load_doc(doc)
    assert cfg.domains["control"].failure_policy == "fail_safe"
    assert cfg.domains["research"].failure_policy == "restart"


def test_other_domains_allowed():
    doc = base()
    doc["domains"]["ui"] = {"profile": "research", "network": True}
    doc["workers"]["hud"] = {"domain": "ui", "module": "workers.hud", "subscribes": ["plan"]}
    cfg = load_doc(doc)
    assert cfg.workers_in("ui") == ["hud"] and cfg.domains["ui"].network


# ------------------------------------------------------------------ channel rules

def test_unknown_channel_suggests():
    doc = base()
    doc["workers"]["model"]["subscribes"] = ["frame"]
    assert one_problem(doc, "workers.model.subscribes[0]") == (
        "unknown channel 'frame'; did you mean 'frames'?")


def test_two_writers():
    doc = base()
    doc["workers"]["model"]["publishes"] = ["plan", "cmd"]
    reason = one_problem(doc, "workers.ctl.publishes[0]")
    assert reason == ("channel 'cmd' is already published by worker 'model'; "
                      "a channel has exactly one writer")


def test_channel_nobody_writes():
    doc = base()
    doc["channels"]["orphan"] = {"slot_size": 64}
    assert "no worker publishes channel 'orphan'" in one_problem(doc, "channels.orphan")


def test_subscribing_to_own_channel():
    doc = base()
    doc["workers"]["model"]["subscribes"] = ["frames", "plan"]
    assert one_problem(doc, "workers.model.subscribes[1]") == (
        "worker 'model' subscribes to channel 'plan', which it also publishes")


def test_duplicate_and_overlapping_subscriptions():
    doc = base()
    doc["workers"]["ctl"]["subscribes"] = ["plan", "plan"]
    doc["workers"]["model"]["shadow_subscribes"] = ["frames"]
    found = {p.key: p.reason for p in problems(doc)}
    assert found["workers.ctl.subscribes[1]"] == "'plan' is listed twice"
    assert "also in subscribes" in found["workers.model.shadow_subscribes[0]"]


def test_control_worker_subscribing_research_channel():
    doc = base()
    doc["workers"]["lab"]["publishes"] = ["shadow", "hints"]
    doc["channels"]["hints"] = {"slot_size": 64}
    doc["workers"]["ctl"]["subscribes"] = ["plan", "hints"]
    assert one_problem(doc, "workers.ctl.subscribes[1]") == (
        "control worker 'ctl' subscribes to research channel 'hints'; "
        "mark it shadow_subscribes (log-only) or move it")
    # the same read as a log-only shadow subscription is fine
    doc["workers"]["ctl"]["subscribes"] = ["plan"]
    doc["workers"]["ctl"]["shadow_subscribes"] = ["hints"]
    cfg = load_doc(doc)
    assert cfg.readers_of("hints") == ["ctl"]
    assert cfg.channel_specs()["hints"].max_readers == 2     # shadow readers count too


def test_shadow_channel_subscribed_by_actuating_domain():
    doc = base()
    doc["workers"]["cam"]["publishes"] = ["frames", "shadow"]   # control writes a shadow channel
    doc["workers"]["lab"]["publishes"] = []
    doc["workers"]["ctl"]["subscribes"] = ["plan", "shadow"]
    reason = one_problem(doc, "workers.ctl.subscribes[1]")
    assert reason.startswith("control worker 'ctl' subscribes to shadow channel 'shadow'")
    assert "never drive actuation" in reason


def test_research_data_laundered_through_other_domain():
    """A third domain has a profile: research-profile relays publish research data, and
    a control-profile relay may not read research data at all."""
    doc = base()
    doc["domains"]["tools"] = {"profile": "research"}
    doc["channels"]["relay"] = {"slot_size": 4096}
    doc["workers"]["relayd"] = {"domain": "tools", "module": "relayd",
                                "subscribes": ["shadow"], "publishes": ["relay"]}
    doc["workers"]["lab"]["optional"] = False
    doc["workers"]["ctl"]["subscribes"] = ["plan", "relay"]
    reason = one_problem(doc, "workers.ctl.subscribes[1]")
    assert "subscribes to research channel 'relay'" in reason
    assert "shadow_subscribes" in reason
    doc["domains"]["tools"] = {"profile": "control"}
    reason = one_problem(doc, "workers.relayd.subscribes[0]")
    assert "subscribes to research channel 'shadow'" in reason


def test_required_worker_depending_on_optional():
    doc = base()
    doc["domains"]["ui"] = {"profile": "research"}
    doc["workers"]["hud"] = {"domain": "ui", "module": "hud", "subscribes": ["shadow"]}
    reason = one_problem(doc, "workers.hud.subscribes[0]")
    assert "published by optional worker 'lab'" in reason
    doc["workers"]["hud"]["optional"] = True
    assert load_doc(doc).readers_of("shadow") == ["hud"]


def test_dependency_cycle():
    doc = base()
    doc["channels"]["feedback"] = {"slot_size": 64}
    doc["workers"]["ctl"]["publishes"] = ["cmd", "feedback"]
    doc["workers"]["model"]["subscribes"] = ["frames", "feedback"]
    found = [p for p in problems(doc) if "cycle" in p.reason]
    assert len(found) == 1
    assert found[0].key == "workers.model.subscribes[1]"
    assert found[0].reason.startswith(
        "dependency cycle model -[plan]-> ctl -[feedback]-> model")
    # a log-only read of the feedback breaks the cycle
    doc["workers"]["model"]["subscribes"] = ["frames"]
    doc["workers"]["model"]["shadow_subscribes"] = ["feedback"]
    assert load_doc(doc).start_order() == ["cam", "model", "ctl", "lab"]


def test_two_cycles_both_reported():
    doc = {"domains": {"d": {}}, "channels": {}, "workers": {}}
    for a, b in (("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"), ("e", "a")):
        doc["channels"].setdefault(f"{a}_out", {"slot_size": 64})
        w = doc["workers"].setdefault(a, {"domain": "d", "module": a,
                                          "publishes": [f"{a}_out"], "subscribes": []})
        w["subscribes"].append(f"{b}_out")
    cycles = [p for p in problems(doc) if "cycle" in p.reason]
    assert [p.key for p in cycles] == ["workers.a.subscribes[0]", "workers.c.subscribes[0]"]


# ------------------------------------------------------------------ many at once

def test_all_problems_reported_at_once():
    doc = base()
    doc["workers"]["model"]["subscribes"] = ["framez"]
    doc["workers"]["ctl"]["restart"] = "allways"
    doc["workers"]["lab"]["domain"] = "lab"
    doc["channels"]["cmd"]["slot_count"] = 1
    doc["domains"]["control"]["network"] = True
    with pytest.raises(ConfigFileError) as info:
        load_doc(doc)
    err = info.value
    keys = {p.key for p in err.problems}
    assert {"workers.model.subscribes[0]", "workers.ctl.restart", "workers.lab.domain",
            "channels.cmd.slot_count", "domains.control.network"} <= keys
    message = str(err)
    assert message.startswith(f"{SRC}: {len(err.problems)} config problems")
    assert f"{SRC}: workers.model.subscribes[0]: unknown channel 'framez'" in message
    assert f"{SRC}: domains.control.network: " in message


# ------------------------------------------------------------------ sizes

@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), (4096, 4096), ("4KiB", 4096), ("4 kib", 4096), ("4kB", 4000),
    ("3.5MiB", 3670016), ("3.5MB", 3500000), ("1GiB", 1 << 30), ("2GB", 2 * 10**9),
    ("512MiB", 512 << 20), ("1.5KiB", 1536), ("0", 0), ("10B", 10), ("1TiB", 1 << 40),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4M", "4k", "-1", "1e6", "MiB", "4 MiBs", "", True, 1.5, -3])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_size_round_trips(n):
    assert parse_size(format_size(n)) == n


@given(st.integers(min_value=0, max_value=10**6),
       st.sampled_from(sorted(_SIZE_UNITS.items())),
       st.booleans())
def test_parse_size_units(k, unit_scale, spaced):
    unit, scale = unit_scale
    assert parse_size(f"{k}{' ' if spaced else ''}{unit.upper()}") == k * scale
    assert parse_size(f"{k}{unit}") == k * scale


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=0, max_value=1023),
       st.sampled_from([("KiB", 10), ("MiB", 20), ("GiB", 30)]))
def test_parse_fractional_binary_sizes(whole, frac_kib, unit_shift):
    unit, shift = unit_shift
    frac = frac_kib / 1024            # exactly representable; at most 10 decimals
    text = f"{whole}{f'{frac:.10f}'.rstrip('0')[1:].rstrip('.')}{unit}"
    assert parse_size(text) == (whole << shift) + (frac_kib << (shift - 10))


# ------------------------------------------------------------------ generated pipelines

@st.composite
def pipelines(draw):
    """A random DAG of workers in shuffled declaration order: worker i publishes c<i> and
    subscribes to some channels of lower-numbered workers."""
    n = draw(st.integers(min_value=1, max_value=8))
    subs = {i: draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else set() for i in range(n)}
    order = draw(st.permutations(range(n)))
    doc = {"domains": {"control": {}}, "channels": {}, "workers": {}}
    for i in range(n):
        doc["channels"][f"c{i}"] = {"slot_size": 64, "slot_count": 16}
    for i in order:
        doc["workers"][f"w{i}"] = {"domain": "control", "module": f"m{i}",
                                   "publishes": [f"c{i}"],
                                   "subscribes": [f"c{j}" for j in sorted(subs[i])]}
    return doc, subs


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_start_order_respects_every_edge(pipeline):
    doc, subs = pipeline
    cfg = load_doc(doc)
    order = cfg.start_order()
    assert sorted(order) == sorted(doc["workers"])
    pos = {name: i for i, name in enumerate(order)}
    for i, deps in subs.items():
        for j in deps:
            assert pos[f"w{j}"] < pos[f"w{i}"]
            assert cfg.writer_of(f"c{j}") == f"w{j}"
    specs = cfg.channel_specs()
    assert [specs[n].channel_id for n in sorted(specs)] == list(range(1, len(specs) + 1))
    for name, spec in specs.items():
        assert spec.max_readers == len(cfg.readers_of(name)) + 1


def test_domains_are_declared_with_a_profile(tmp_path):
    """Any domain name, but its rules come from a built-in profile: an undeclared one is
    one config error naming file and key, and the CLI exits 2 without a traceback."""
    import subprocess
    import sys

    body = """
[domains.{name}]
{profile}
[channels.x]
slot_size = "4KiB"
[workers.a]
domain = "{name}"
module = "workers.probe"
publishes = ["x"]
"""
    f = tmp_path / "perception.toml"
    f.write_text(body.format(name="perception", profile=""))
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "check", "--config", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "domains.perception.profile: domain 'perception' needs a profile" in r.stderr
    f.write_text(body.format(name="perception", profile='profile = "sensing"'))
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "check", "--config", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "domains.perception.profile" in r.stderr and "Traceback" not in r.stderr
    cfg = loads(body.format(name="perception", profile='profile = "control"'), "p.toml")
    assert cfg.profile_of("a") == "control" and cfg.domains["perception"].failure_policy == "fail_safe"


def test_a_vehicle_actuation_channel_never_turns_its_age_check_off():
    """max_age_ms = 0 ("no age check") on an actuation channel: a wedged controlsd's
    last ENGAGED command would stay current for every reader, for ever. Refused on the
    vehicle; a simulation (a lockstep replay turns ages off) and a plain channel may."""
    doc = base()
    doc["supervisor"] = {"mode": "vehicle"}
    doc["channels"]["cmd"].update(payload="control_cmd", max_age_ms=0)
    assert "actuation channel" in one_problem(doc, "channels.cmd.max_age_ms")
    doc["channels"]["cmd"]["max_age_ms"] = 50
    doc["channels"]["plan"]["max_age_ms"] = 0
    load_doc(doc)
    doc["supervisor"]["mode"] = "simulation"
    doc["channels"]["cmd"]["max_age_ms"] = 0
    load_doc(doc)
