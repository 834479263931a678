"""RunConfig in sections: every setting lives in exactly one section and says why it exists, settings named
alone reach their section, and a config written flat by an earlier schema reads as today's."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json

import pytest

import core.config
from core.config import SECTION_OF, SECTIONS, TOP_LEVEL, RunConfig, migrate_config
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit


def tiny(**settings) -> RunConfig:
    return RunConfig.build(
        "torch-ddp", workload="tiny", spec=PRESETS["tiny"], world_size=2, device="cpu", **settings
    )


def test_every_setting_lives_in_exactly_one_section():
    names = [f.name for section in SECTIONS.values() for f in dataclasses.fields(section)]
    assert len(names) == len(set(names)) == len(SECTION_OF)
    top = {f.name for f in dataclasses.fields(RunConfig)}
    assert top == {*TOP_LEVEL, *SECTIONS}
    assert not top & set(SECTION_OF)


def test_every_field_has_a_docstring():
    """torchtitan's JobConfig rule: a field says what it holds and why, right below it."""
    tree = ast.parse(inspect.getsource(core.config))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    undocumented = []
    for section in [*SECTIONS.values(), RunConfig]:
        body = classes[section.__name__].body
        for i, statement in enumerate(body):
            if not isinstance(statement, ast.AnnAssign):
                continue
            name = statement.target.id  # type: ignore[union-attr]
            following = body[i + 1] if i + 1 < len(body) else None
            documented = (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            )
            if not documented and name not in SECTIONS:  # a section's own class docstring says it
                undocumented.append(f"{section.__name__}.{name}")
    assert undocumented == []


def test_settings_named_alone_reach_their_section():
    cfg = tiny(steps=7, micro_batch=3, nodes=1, precision="bf16", compute_method="none")
    assert cfg.measurement.steps == 7 and cfg.measurement.compute_method == "none"
    assert (cfg.batch.micro_batch, cfg.model.precision, cfg.topology.world_size) == (3, "bf16", 2)
    assert cfg.topology.gpus_per_node == 2  # derived from world size and nodes
    assert cfg.setting("steps") == 7 and cfg.setting("backend") == "torch-ddp"
    changed = cfg.evolve(steps=9, node_rank=1, backend_options={"bucket_cap_mb": 1})
    assert (changed.measurement.steps, changed.topology.node_rank) == (9, 1)
    assert changed.backend_options == {"bucket_cap_mb": 1} and cfg.measurement.steps == 7  # a copy
    assert changed.batch is cfg.batch  # untouched sections are shared, not rebuilt
    with pytest.raises(TypeError, match="no setting stpes"):
        tiny(stpes=5)
    with pytest.raises(TypeError, match="no setting fault"):
        cfg.evolve(fault={"rank": 0})  # test hooks are not part of a user's config


def test_a_config_round_trips_through_json():
    cfg = tiny(steps=4, hosts=["a", "b"], commbench={"ops": ["all_reduce"], "sizes": [8]})
    again = RunConfig.from_dict(__import__("json").loads(cfg.to_json()))
    assert again == cfg
    assert set(cfg.to_dict()) == {*TOP_LEVEL, *SECTIONS}
    tuned = cfg.evolve(variant="tuned", backend_options={"compile": True})
    assert RunConfig.from_dict(json.loads(tuned.to_json())) == tuned


def test_a_flat_config_of_an_earlier_schema_reads_as_today_s():
    cfg = tiny(steps=4, grad_accum=2, tf32=True, master_port=29600)
    flat = {"backend": "torch-ddp", "backend_options": {}}
    for name in SECTIONS:
        flat.update(dataclasses.asdict(getattr(cfg, name)))
    flat["spec"] = cfg.model.spec.to_dict()
    flat["retired_setting"] = 1  # a setting this version no longer has is left out
    assert RunConfig.from_dict(flat) == cfg
    schema1 = {k: v for k, v in flat.items() if k not in ("world_size", "gpus_per_node")} | {"gpus": 2}
    assert RunConfig.from_dict(schema1) == cfg
    assert migrate_config(cfg.to_dict()) == cfg.to_dict()  # today's layout passes through
