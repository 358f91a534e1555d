"""The one registry of attention normalizers (``smxcompile.NORMALIZERS``): options, kernel codes, ONNX forms and
swap variants derive from it; an unknown name is refused where it enters, with the known names."""

from __future__ import annotations

import pytest
import torch

import smxcompile
from smxcompile import NORMALIZERS, SmxOptions, attention, variants
from smxcompile.export.onnx.attention import refuse
from smxcompile.export.onnx.attention_normalizers import NORMALIZER_NAMES, NormalizerForms, normalizer_forms
from smxcompile.kernels.attention import AttentionError
from smxcompile.kernels.attention.triton_common import NORM_CODES, check_args
from smxcompile.options import ATTENTION_NORMALIZERS

#: The Triton kernels compare ``NORM`` against these values: they must not move.
PINNED_CODES = {"softmax": 0, "softmax1": 1, "ssmax": 2, "sigmoid": 3, "relu": 4, "softpick": 5, "softplus": 6,
                "sparsemax": 7, "entmax15": 8}


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))


def _kernel_code(normalizer: str) -> int:
    q, k, v = _qkv()
    return check_args(q, k, v, None, False, 1.0, None, normalizer, None, 0.0, 0)[-1]


def test_kernel_codes_are_read_from_the_registry_and_unchanged():
    assert {name: entry.code for name, entry in NORMALIZERS.items()} == PINNED_CODES
    assert NORM_CODES == PINNED_CODES
    assert {name: _kernel_code(name) for name in NORMALIZERS} == PINNED_CODES


def test_every_layer_knows_exactly_the_registry_names():
    names = tuple(NORMALIZERS)
    assert ATTENTION_NORMALIZERS == names and NORMALIZER_NAMES == names
    assert all(callable(getattr(NormalizerForms, name, None)) for name in names), "an ONNX form per normalizer"
    assert smxcompile.NORMALIZERS is NORMALIZERS
    reads_n = {name for name, entry in NORMALIZERS.items() if entry.reads_n}
    assert reads_n == {"ssmax", "sigmoid", "relu", "softplus"}


def test_a_normalizer_that_is_a_variant_takes_its_name_and_paper_from_the_registry():
    for name, entry in NORMALIZERS.items():
        if name == "softmax":       # softmax is what a swap replaces, not a variant
            assert name not in variants.names()
            continue
        variant = variants.get(name)
        assert variant.name == entry.name and variant.paper == entry.paper
    for name in ("softmax1", "softpick"):   # written with the attention op's own names
        assert variants.get(name).formula == NORMALIZERS[name].formula


def test_a_name_added_to_the_registry_is_seen_by_options_kernels_and_export(monkeypatch):
    entry = NORMALIZERS["softmax1"]._replace(name="softmax1_copy")
    monkeypatch.setitem(NORMALIZERS, "softmax1_copy", entry)
    assert SmxOptions.from_mapping({"attention_normalizer": "softmax1_copy"}).attention_normalizer == "softmax1_copy"
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, normalizer="softmax1_copy"),
                               attention(q, k, v, normalizer="softmax1"))
    assert _kernel_code("softmax1_copy") == entry.code
    assert refuse("attention", {"normalizer": "softmax1_copy"}, None) is None
    pytest.importorskip("onnx")
    monkeypatch.setattr(NormalizerForms, "softmax1_copy", NormalizerForms.softmax1, raising=False)
    assert set(normalizer_forms(None, None, None, None, None)) == set(NORMALIZERS)


def test_an_unknown_name_is_refused_at_entry_with_the_known_names():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attention_normalizer' must be one of") as options_error:
        SmxOptions.from_mapping({"attention_normalizer": "nope"})
    with pytest.raises(AttentionError, match="unknown normalizer 'nope'") as attention_error:
        attention(q, k, v, normalizer="nope")
    export_refusal = refuse("attention", {"normalizer": "nope"}, None)
    for message in (str(options_error.value), str(attention_error.value), export_refusal):
        assert "nope" in message
    assert all(name in str(options_error.value) + str(attention_error.value) for name in NORMALIZERS)
    with pytest.raises(variants.UnknownVariantError, match=", ".join(variants.names())):
        variants.get("nope")
    with pytest.raises(ValueError, match="normalizer must be one of") as launcher_error:   # the Triton launchers
        _kernel_code("nope")
    assert all(name in str(launcher_error.value) for name in NORMALIZERS)


def test_a_parameter_for_a_parameterless_normalizer_names_those_that_take_one():
    with pytest.raises(ValueError, match="sigmoid, relu, softpick, ssmax and softplus have one"):
        SmxOptions.from_mapping({"attention_normalizer": "softmax", "attention_norm_param": 1.0})
    with pytest.raises(AttentionError, match="these do: sigmoid, relu, softpick, ssmax, softplus"):
        attention(*_qkv(), normalizer="entmax15", norm_param=1.0)
