"""Version guards: pyproject's bounds are the tested ones, and each private-API wrapper refuses clearly."""

import re

import pytest
import torch
from conftest import ROOT

from longsft.train.common import compat
from longsft.train.common.errors import ConfigError


def _requirements() -> dict[str, str]:
    """Distribution -> version specifier of every requirement in pyproject.toml (extras included)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    out = {}
    for r in reqs:
        name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", r).groups()
        out.setdefault(name.lower(), set()).add(spec.replace(" ", ""))
    return out


def test_pyproject_bounds_are_the_supported_versions():
    reqs = _requirements()
    for dist, spec in compat.SUPPORTED.items():
        assert reqs.get(dist) == {spec}, f"pyproject.toml asks for {dist} {reqs.get(dist)}, compat supports {spec}"
    for dist in compat.SUPPORTED:
        if compat.installed(dist):  # what the suite runs on is inside the range it states
            assert compat.supported(dist), f"{dist} {compat.installed(dist)} is outside {compat.SUPPORTED[dist]}"


def test_supported_reads_ranges():
    assert compat.supported("deepspeed", "0.19.8") and not compat.supported("deepspeed", "0.20.0")
    assert compat.supported("torch", "2.13.0+cpu") and not compat.supported("torch", "2.14.0")
    assert compat.supported("ring-flash-attn", "0.1.8") and not compat.supported("ring-flash-attn", "0.1.9")
    assert compat.supported("deepspeed") == compat.supported("deepspeed", compat.installed("deepspeed"))


def test_a_missing_distribution_is_not_supported(monkeypatch):
    monkeypatch.setattr(compat, "installed", lambda dist: None)
    assert not compat.supported("ring-flash-attn")
    with pytest.raises(compat.UnsupportedVersion, match="ring-flash-attn not installed: .*ring-flash-attn==0.1.8"):
        raise compat.unsupported("ring-flash-attn", "x")


@pytest.mark.parametrize("name", sorted(compat.ATEN_OPS))
def test_the_rings_aten_ops_have_the_schemas_it_calls(name):
    op = compat.aten_op(name)
    assert op is getattr(torch.ops.aten, name).default


def test_a_reordered_aten_schema_is_refused():
    swapped = torch._C.parse_schema(
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
        "bool is_causal=False, float dropout_p=0., *, Tensor? attn_mask=None, float? scale=None) "
        "-> (Tensor output, Tensor logsumexp)")
    with pytest.raises(compat.UnsupportedVersion, match=r"torch \S+: aten::_scaled_dot_product_flash_attention_for_cpu "
                                                        r"changed .*passes query, key, value, dropout_p, is_causal by "
                                                        r"position.*longsft supports torch>=2.11,<2.14"):
        compat.check_schema("_scaled_dot_product_flash_attention_for_cpu", swapped)
    no_scale = torch._C.parse_schema(
        "aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0., "
        "bool is_causal=False, bool return_debug_mask=False) -> (Tensor output, Tensor logsumexp)")
    with pytest.raises(compat.UnsupportedVersion, match="and scale by keyword"):
        compat.check_schema("_scaled_dot_product_flash_attention", no_scale)
    assert issubclass(compat.UnsupportedVersion, ConfigError)  # the CLI prints it as one line, exit 2


def test_missing_private_apis_name_the_versions():
    with pytest.raises(compat.UnsupportedVersion, match=r"deepspeed \S+: DeepSpeedEngine."
                                                        r"_zero3_consolidated_16bit_state_dict is missing"):
        compat.zero3_full_state_dict(object())

    class Engine:
        def _zero3_consolidated_16bit_state_dict(self):
            return {"w": 1}

    assert compat.zero3_full_state_dict(Engine()) == {"w": 1}
    from transformers import Qwen3ForCausalLM

    assert compat.routes_attention(Qwen3ForCausalLM)
    assert not compat.routes_attention(torch.nn.Linear)


def test_bare_import_only_for_the_supported_ring_flash_attn(monkeypatch):
    assert compat.installed("ring-flash-attn") == "0.1.8"  # the test extra pins it
    monkeypatch.setitem(compat.SUPPORTED, "ring-flash-attn", "==0.1.7")  # as if 0.1.8 were not the tested one
    monkeypatch.delitem(__import__("sys").modules, "ring_flash_attn.zigzag_ring_flash_attn", raising=False)
    with pytest.raises(compat.UnsupportedVersion, match=r"ring-flash-attn 0.1.8: ring_flash_attn."
                                                        r"zigzag_ring_flash_attn is imported without the package's "
                                                        r"__init__.*supports ring-flash-attn==0.1.7"):
        compat.import_bare("ring_flash_attn", "zigzag_ring_flash_attn", "ring-flash-attn")
