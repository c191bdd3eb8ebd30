"""Plan files: strict loading, layout validation, round-trip, and a property test over mutated plan dicts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import PLANS
from rackcast.errors import RackcastError
from rackcast.plan import Plan, load_plan, plan_to_yaml, validate
from rackcast.strict import from_data, load_yaml, to_data

EXAMPLES = sorted(PLANS.glob("*.yaml"))
HERO = PLANS / "marin-535b-hero.yaml"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_plan_loads_validates_and_round_trips_byte_for_byte(path, tmp_path):
    plan = load_plan(str(path))
    text = plan_to_yaml(plan)
    again = tmp_path / "again.yaml"
    again.write_text(text)
    reloaded = load_plan(str(again))
    assert reloaded == plan
    assert plan_to_yaml(reloaded) == text


def test_hero_plan_is_ep64_fsdp64_across_11_racks():
    plan = load_plan(str(HERO))
    assert plan.parallel.expert == 64 and plan.parallel.data == 11 and plan.parallel.gpus == 704
    assert plan.batch.global_batch * plan.model_spec().seq_len == 11264 * 4096
    assert plan.optimizer.name == "muonh" and plan.optimizer.state_location == "host"
    assert plan.expert_transport.mode == "dropless"


def _hero_dict():
    return load_yaml(HERO)


def _write(tmp_path: Path, data) -> str:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(colour="red"), "colour: unknown key"),
    (lambda d: d["parallel"].update(expert=5), "parallel.expert: 384 experts are not divisible by expert=5"),
    (lambda d: d["parallel"].update(data=12), "parallel: data x fsdp x context x tensor x pipeline = 768 GPUs"),
    (lambda d: d["batch"].update(global_batch="many"), "batch.global_batch: expected int"),
    (lambda d: d["batch"].update(global_batch=11265), "batch.global_batch: 11265 sequences are not divisible"),
    (lambda d: d.update(model="marin-9000"), "unknown model preset 'marin-9000'"),
    (lambda d: d["topology"].update(name="tpu-v9"), "unknown topology preset 'tpu-v9'"),
    (lambda d: d.update(schedule="2f2b"), "schedule: expected one of"),
    (lambda d: d["parallel"].update(tensor=64, fsdp=1), "parallel.tensor: 48 attention heads are not divisible by tensor=64"),
    (lambda d: d.pop("batch"), "batch: required key is missing"),
])
def test_bad_plan_is_refused_with_one_line_naming_file_and_field(tmp_path, mutate, message):
    data = _hero_dict()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(RackcastError) as info:
        load_plan(path)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nparallel: [1, 2\n")
    with pytest.raises(RackcastError, match=r"broken.yaml: line \d+"):
        load_plan(str(path))


def test_pipeline_must_divide_layers():
    plan = load_plan(str(PLANS / "tiny-2proc-pp.yaml"))
    bad = from_data(Plan, {**to_data(plan), "parallel": {"pipeline": 3}})
    with pytest.raises(RackcastError, match="parallel.pipeline: 4 layers are not divisible"):
        validate(bad, plan.model_spec(), 3)


def test_inline_model_spec_is_accepted(tmp_path):
    data = load_yaml(PLANS / "tiny-1proc.yaml")
    data["model"] = to_data(load_yaml_model("tiny-moe"))
    plan = load_plan(_write(tmp_path, data))
    assert plan.model_spec().name == "tiny-moe"


def load_yaml_model(name):
    from rackcast.presets import load_model
    return load_model(name)


# Property: any mutation of a valid plan dict either loads or raises RackcastError (never another exception).
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 2000), st.floats(allow_nan=True),
                     st.text(max_size=6), st.lists(st.integers(0, 3), max_size=3), st.dictionaries(
                         st.text(max_size=4), st.integers(0, 3), max_size=2))


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


BASE = load_yaml(PLANS / "tiny-4proc.yaml")
ALL_PATHS = list(_paths(BASE)) + [("parallel", "tensor"), ("parallel", "virtual"), ("optimizer", "name"),
                                  ("expert_transport", "capacity_factor"), ("bogus",)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(ALL_PATHS), _scalars, st.booleans()), min_size=1, max_size=4))
def test_mutated_plans_load_or_raise_rackcast_error(tmp_path, edits):
    data = copy.deepcopy(BASE)
    for path, value, delete in edits:
        node = data
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        if delete:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        load_plan(str(path))
    except RackcastError as exc:
        assert "\n" not in str(exc)
