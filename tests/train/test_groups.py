"""``TrainConfig``'s field groups (``fp4jax.train.groups``): every field belongs to exactly
one group or to the loop's top level, each group is the config's values, and each checks
its own values without a ``TrainConfig`` (the same ``ConfigError`` field and message)."""

from __future__ import annotations

import dataclasses

import pytest

from fp4jax.train import groups as G
from fp4jax.train.config import LOOP_INTS, ConfigError, TrainConfig, model_config

GROUPS = {"arch": G.ArchConfig, "dataset": G.DataConfig, "optim": G.OptimConfig,
          "precision": G.PrecisionConfig, "rundir": G.RunDirConfig,
          "parallel": G.ParallelConfig}
TOP = {*LOOP_INTS, "seed", "stop_at", "progress", "compare"}


def _flat(group) -> dict:
    out = {}
    for f in dataclasses.fields(group):
        v = getattr(group, f.name)
        out.update(_flat(v) if isinstance(v, G.Group) else {f.name: v})
    return out


def test_every_field_in_one_group():
    cfg = TrainConfig(preset="micro")
    seen: dict[str, str] = {}
    for name in [*GROUPS, "research"]:
        for k in _flat(getattr(cfg, name)):
            assert k not in seen, f"{k} in {seen[k]} and {name}"
            seen[k] = name
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(seen) | TOP == fields, (fields - set(seen) - TOP, set(seen) - fields)
    assert not set(seen) & TOP


def test_groups_hold_the_configs_values():
    cfg = TrainConfig(preset="micro", lr=1e-3, seq_len=64, switch_at=0.5, switch="fwd",
                      steps=100, fsdp=2, fp4_param_gather=True)
    oc = TrainConfig(preset="micro", outcontrol=0.1, outcontrol_start=3, steps=100)
    for c in (cfg, oc):
        for name in [*GROUPS, "research"]:
            for k, v in _flat(getattr(c, name)).items():
                assert v == getattr(c, k), (name, k)
    assert oc.research.outcontrol.on and oc.research.outcontrol.split_step == 53
    assert not cfg.research.outcontrol.on and not cfg.research.osci.on
    assert cfg.arch.llama(cfg.seq_len) == model_config(cfg)
    assert cfg.dataset.batch_ids == cfg.batch_size * 65


@pytest.mark.parametrize("field, value, match", [
    ("beta1", 1.0, r"must be a number in \[0, 1\)"),
    ("schedule", "linear", "unknown schedule"),
    ("warmup_steps", -1, "integer >= 0"),
])
def test_optim_checks_itself(field, value, match):
    good = TrainConfig(preset="micro").optim
    good.validate()
    bad = dataclasses.replace(good, **{field: value})
    with pytest.raises(ConfigError, match=match) as e:
        bad.validate()
    assert e.value.field == field
    with pytest.raises(ConfigError) as e2:  # the config says the same
        TrainConfig(preset="micro", **{field: value})
    assert str(e2.value) == str(e.value)


@pytest.mark.parametrize("group, changes, field", [
    ("dataset", {"batch_size": 1 << 20, "seq_len": 1 << 10}, "batch_size"),
    ("dataset", {"tokenizer": "bpe:1"}, "tokenizer"),
    ("arch", {"n_experts": 2, "top_k": 3}, "top_k"),
    ("arch", {"model": "m:f", "ffn": "relu2"}, "ffn"),
    ("arch", {"model_args": "{}"}, "model_args"),
    ("precision", {"switch": "half"}, "switch"),
    ("precision", {"switch_at": "soon"}, "switch_at"),
    ("rundir", {"resume": True, "overwrite": True}, "overwrite"),
    ("rundir", {"resume_override": "lr"}, "resume_override"),
    ("parallel", {"fp4_param_gather": True}, "fp4_param_gather"),
])
def test_groups_refuse_bad_values(group, changes, field):
    g = dataclasses.replace(getattr(TrainConfig(preset="micro"), group), **changes)
    with pytest.raises(ConfigError) as e:
        g.validate()
    assert e.value.field == field


def test_research_checks_its_parts():
    r = TrainConfig(preset="micro").research
    r.validate()
    bad = dataclasses.replace(r, osci=dataclasses.replace(r.osci, osci_reset=0.5,
                                                          osci_iters=9, osci_period=10))
    with pytest.raises(ConfigError, match="osci-period - 2 = 8") as e:
        bad.validate()
    assert e.value.field == "osci_iters"
    bad = dataclasses.replace(r, outcontrol=dataclasses.replace(
        r.outcontrol, outcontrol=0.1, outcontrol_multiple=24))
    with pytest.raises(ConfigError, match="multiple of 16"):
        bad.validate()


def test_optimizer_is_the_groups():
    """``make_optimizer``/``make_schedule`` are the group's (one definition): the same
    learning rates along a run."""
    from fp4jax.train.config import make_schedule

    cfg = TrainConfig(preset="micro", steps=200, warmup_steps=10, lr=2e-3, min_lr_ratio=0.1)
    s = make_schedule(cfg)
    lrs = [float(s(i)) for i in (0, 5, 10, 100, 160, 199)]
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(2e-3) and lrs[3] == pytest.approx(2e-3)
    assert lrs[1] == pytest.approx(1e-3)
    assert 2e-4 < lrs[5] < lrs[4] < 2e-3  # WSD: the last 20% decays toward 0.1 lr
    assert float(cfg.optim.schedule_fn(200)(160)) == lrs[4]
