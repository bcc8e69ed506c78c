"""Config-driven replacement: the generic plan (megaloom.models.replace) and the low_precision section."""
import io

import pytest
import torch
from torch import nn

from megaloom.models.plan import apply_low_precision, low_precision_rules
from megaloom.ops.mxfp8 import GroupedExperts, MXFP8GroupedExperts, MXFP8Linear
from megaloom.models.replace import ReplacementPlan, Rule
from megaloom.runtime.errors import ConfigError


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleDict({"q": nn.Linear(64, 64), "gate": nn.Linear(64, 8)})
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64, bias=False))
        self.experts = GroupedExperts(2, 64, 32)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(64, 100)

    def forward(self, x):
        for b in self.layers:
            x = x + b.mlp(b.attn["q"](x)) + b.experts(x, [x.shape[0] // 2, x.shape[0]])
        return self.lm_head(x)


def snapshot(model):
    return {n: p for n, p in model.named_parameters()}, [n for n, _ in model.named_modules()]


def test_low_precision_swaps_selected_modules_keeping_parameters():
    torch.manual_seed(0)
    model = Toy()
    params, names = snapshot(model)
    sd = io.BytesIO()
    torch.save(model.state_dict(), sd)
    x = torch.randn(48, 64)
    y0 = model(x)
    done = apply_low_precision(model, {"format": "mxfp8", "scale_mode": "rceil",
                                       "include": ["*.mlp.*", "*.experts"], "exclude": ["lm_head"]})
    assert sorted(r.path for r in done) == ["layers.0.experts", "layers.0.mlp.0", "layers.0.mlp.2",
                                            "layers.1.experts", "layers.1.mlp.0", "layers.1.mlp.2"]
    assert type(model.layers[0].mlp[0]) is MXFP8Linear and model.layers[0].mlp[0].scale_mode == "rceil"
    assert type(model.layers[1].experts) is MXFP8GroupedExperts
    assert type(model.layers[0].attn["q"]) is nn.Linear and type(model.lm_head) is nn.Linear  # unmatched: kept
    after, names_after = snapshot(model)
    assert names_after == names and list(after) == list(params)
    assert all(after[n] is params[n] for n in params)  # the very same Parameter objects
    sd.seek(0)
    model.load_state_dict(torch.load(sd, weights_only=True), strict=True)  # a checkpoint from before loads
    y = model(x)
    assert ((y - y0).norm() / y0.norm()).item() < 0.1
    y.sum().backward()
    assert params["layers.0.mlp.0.weight"].grad is not None and params["layers.1.experts.w_down"].grad is not None
    assert apply_low_precision(model, {"format": "mxfp8", "include": ["*.mlp.*"]}) == []  # applies once


def test_odd_sized_modules_are_skipped_and_listed_and_every_problem_is_reported():
    model = Toy()
    plan = ReplacementPlan(low_precision_rules({"format": "mxfp8", "include": ["*"], "exclude": ["*.experts"]}))
    done = plan.apply(model)
    assert len(done) == 6 and type(model.lm_head) is nn.Linear  # 2 x (q, mlp.0, mlp.2) swapped
    skipped = {path: reason for path, _, reason in plan.skipped}
    assert sorted(skipped) == ["layers.0.attn.gate", "layers.1.attn.gate", "lm_head"]
    assert skipped["lm_head"] == "out_features=100 is not a multiple of 32" and "out_features=8" in skipped["layers.0.attn.gate"]
    model = Toy()
    before = [type(m) for m in model.modules()]
    with pytest.raises(ConfigError) as e:
        apply_low_precision(model, {"format": "mxfp8", "include": ["*", "*.mlpp.*"], "exclude": ["*.experts"]})
    assert "include glob '*.mlpp.*' matches no Linear/GroupedExperts/RoutedExperts module" in str(e.value)
    assert [type(m) for m in model.modules()] == before
    with pytest.raises(ConfigError) as e:
        low_precision_rules({"format": "mxfp4", "scale_mode": "up", "include": ["layers.[0"], "exclude": "lm_head",
                             "colour": 1})
    msg = str(e.value)
    for part in ("unknown key 'colour'", "unknown format 'mxfp4'", "unknown mode 'up'", "unclosed '['",
                 "exclude must be a list"):
        assert part in msg
    assert low_precision_rules({"linear": "none"}) == [] and low_precision_rules(None) == []
    assert len(low_precision_rules({"linear": "mxfp8", "include": ["*"], "exclude": ["lm_head", "*router*"]})) == 1


def test_generic_plan_conflicts_nesting_and_bad_factories():
    model = Toy()
    to_silu = Rule("act", (nn.GELU,), lambda m: nn.SiLU())
    assert [r.path for r in ReplacementPlan([to_silu]).apply(model)] == ["layers.0.mlp.1", "layers.1.mlp.1"]
    assert isinstance(model.layers[1].mlp[1], nn.SiLU)
    ident = Rule("a", (nn.Linear,), lambda m: m, include=("*.q",))
    with pytest.raises(ConfigError, match="matched by rules 'a' and 'b'"):
        ReplacementPlan([ident, Rule("b", (nn.Linear,), lambda m: m, include=("layers.0.attn.*",))]).match(model)
    with pytest.raises(ConfigError, match="lies inside 'layers.0.mlp'"):
        ReplacementPlan([Rule("seq", (nn.Sequential,), lambda m: m, include=("*.mlp",)),
                         Rule("lin", (nn.Linear,), lambda m: m, include=("*.mlp.*",))]).match(model)
    copying = Rule("copy", (nn.Linear,), lambda m: nn.Linear(m.in_features, m.out_features), include=("*.q",))
    with pytest.raises(ConfigError, match="does not re-use the Parameter objects"):
        ReplacementPlan([copying]).apply(model)
    renaming = Rule("rename", (nn.Linear,), lambda m: nn.Sequential(m), include=("lm_head",))
    with pytest.raises(ConfigError, match="state_dict keys"):
        ReplacementPlan([renaming]).apply(model)
    assert type(model.layers[0].attn["q"]) is nn.Linear and type(model.lm_head) is nn.Linear


def test_shared_module_is_replaced_under_every_name():
    lin = nn.Linear(32, 32)
    model = nn.ModuleDict({"a": lin, "b": nn.Sequential(lin)})
    done = ReplacementPlan([Rule("mx", (nn.Linear,), MXFP8Linear.from_float, skip=(MXFP8Linear,))]).apply(model)
    assert done[0].paths == ("a", "b.0")
    assert model["a"] is model["b"][0] and model["a"].weight is lin.weight
