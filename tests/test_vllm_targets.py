"""The two phases of applying a refit to a vLLM worker's model (layoutlang/integrations/vllm/
targets.py), without vLLM: ``prepare`` checks a received refit against the model as it is now and
writes nothing, ``apply`` writes a prepared one.

The model is a small torch module with vLLM's parameter names and conventions (a fused
``gate_up`` storage whose module post-processes its weights, so it goes through ``load_weights``;
a norm kept as loaded, so it is copied directly). The few vLLM names targets.py reads are stood
in for by modules of this test (vLLM records no created shapes here, and its reload lifecycle
only counts its calls); the live engines are tests/test_vllm_elastic.py's.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from layoutlang.errors import ExecutionError
from layoutlang.lang import loads

pytestmark = pytest.mark.timeout(60)

PROGRAM = """
tensor "gate.weight" [4, 6] fp32
tensor "up.weight" [4, 6] fp32
tensor "norm.weight" [6] fp32
mesh infer [tp = 2] on ranks 0..1
layout engine on infer {
    "gate.weight": tp = shard(0)
    "up.weight": tp = shard(0)
    default: replicate
    storage "mlp.gate_up.weight" = "gate.weight" | "up.weight"
}
"""
RANK = 1  # the second tensor-parallel rank: rows 2..3 of gate and of up


class QuantizeMethodBase:
    """vLLM's base of quantization methods: its post-processing does nothing."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None


class Repacking(QuantizeMethodBase):
    """A method that transforms weights after loading (as the CPU backend's repack does)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None


class Leaf(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...], quant_method: Any = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        if quant_method is not None:
            self.quant_method = quant_method


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.gate_up = Leaf((4, 6), Repacking())
        self.norm = Leaf((6,))
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> None:
        self.loaded.extend((name, tensor.clone()) for name, tensor in weights)


@pytest.fixture
def reloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stand-ins for the vLLM modules targets.py imports; returns the reload calls made."""
    calls: list[str] = []
    modules = {
        "vllm.model_executor.model_loader.reload.layerwise": {"LAYERWISE_INFO": {}},
        "vllm.model_executor.model_loader.reload.meta": {"SKIP_TENSORS": set()},
        "vllm.model_executor.model_loader.reload": {
            "initialize_layerwise_reload": lambda module: calls.append("initialize"),
            "finalize_layerwise_reload": lambda model, config: calls.append("finalize"),
        },
        "vllm.model_executor.layers.quantization.base_config": {"QuantizeMethodBase": QuantizeMethodBase},
        "vllm.platforms": {"current_platform": types.SimpleNamespace(is_cpu=lambda: False)},
    }
    names = {"vllm", "vllm.model_executor", "vllm.model_executor.model_loader", "vllm.model_executor.layers",
             "vllm.model_executor.layers.quantization", *modules}
    for name in sorted(names):
        module = types.ModuleType(name)
        module.__path__ = []  # a package: its submodules import
        for attribute, value in modules.get(name, {}).items():
            setattr(module, attribute, value)
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def targets(model: Model) -> Any:
    from layoutlang.integrations.vllm.targets import EngineTargets

    resolved = EngineTargets(model, loads(PROGRAM).layout("engine"), RANK, engine="the test model")
    assert resolved.problems == []
    assert set(resolved.direct) == {"norm.weight"} and set(resolved.loaded) == {"mlp.gate_up.weight"}
    return resolved


def received() -> dict[str, torch.Tensor]:
    return {
        "mlp.gate_up.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6) + 1,
        "norm.weight": torch.full((6,), 7.0),
    }


def test_a_prepared_refit_is_written_by_apply_only(reloads):
    model = Model()
    resolved = targets(model)
    refit = received()
    prepared = resolved.prepare(refit)
    assert torch.equal(model.norm.weight, torch.zeros(6)) and model.loaded == [] and reloads == []  # nothing yet
    resolved.apply(prepared, model_config=None)
    assert torch.equal(model.norm.weight, refit["norm.weight"])
    assert reloads == ["initialize", "finalize"]
    loaded = dict(model.loaded)
    # whole tensors holding this rank's boxes: rows 2..3 of gate and of up
    assert torch.equal(loaded["gate.weight"][2:4], refit["mlp.gate_up.weight"][0:2])
    assert torch.equal(loaded["up.weight"][2:4], refit["mlp.gate_up.weight"][2:4])


@pytest.mark.parametrize("fault", ["cast", "reshaped", "replaced", "removed"])
def test_a_model_changed_after_resolution_fails_prepare_and_nothing_is_written(reloads, fault):
    model = Model()
    resolved = targets(model)
    kept = model.norm.weight.data
    if fault == "cast":
        model.norm.weight.data = kept.double()
    elif fault == "reshaped":
        model.norm.weight.data = kept.view(2, 3)
    elif fault == "replaced":
        model.norm.weight = torch.nn.Parameter(kept.clone(), requires_grad=False)
    else:
        del model.norm.weight
    with pytest.raises(ExecutionError) as failed:
        resolved.prepare(received())
    message = str(failed.value)
    assert "rank 1 cannot apply the refit" in message and "'norm.weight'" in message
    want = {"cast": "torch.float64", "reshaped": "[2, 3]", "replaced": "replaced", "removed": "no longer has"}[fault]
    assert want in message
    assert model.loaded == [] and reloads == [] and torch.equal(kept, torch.zeros(6))
    if fault in ("cast", "reshaped"):  # the same parameter back as it was: the refit prepares again
        model.norm.weight.data = kept
        resolved.apply(resolved.prepare(received()), model_config=None)
        assert torch.equal(model.norm.weight, received()["norm.weight"])


def test_parameters_that_the_apply_itself_replaces_are_what_the_next_prepare_expects(reloads, monkeypatch):
    model = Model()
    resolved = targets(model)

    def finalize(model: Model, config: Any) -> None:
        # vLLM's post-processing registers a new parameter (replace_parameter, the CPU prepack)
        model.mlp.gate_up.weight = torch.nn.Parameter(model.mlp.gate_up.weight.data.clone(), requires_grad=False)

    reload = sys.modules["vllm.model_executor.model_loader.reload"]
    monkeypatch.setattr(reload, "finalize_layerwise_reload", finalize)
    resolved.apply(resolved.prepare(received()), model_config=None)
    resolved.apply(resolved.prepare(received()), model_config=None)  # no "replaced" refusal
    model.mlp.gate_up.weight = torch.nn.Parameter(torch.zeros(4, 6), requires_grad=False)  # by anyone else
    with pytest.raises(ExecutionError, match=r"parameter 'mlp\.gate_up\.weight' was replaced"):
        resolved.prepare(received())


def test_a_received_storage_of_another_shape_or_dtype_fails_prepare(reloads):
    resolved = targets(Model())
    wrong = received() | {"norm.weight": torch.zeros(6, dtype=torch.float16)}
    with pytest.raises(ExecutionError, match=r"storage 'norm\.weight' was received as \[6\] torch.float16"):
        resolved.prepare(wrong)
    missing = {"norm.weight": torch.zeros(6)}
    with pytest.raises(ExecutionError, match=r"storage 'mlp\.gate_up\.weight' was not received"):
        resolved.prepare(missing)


class UnquantizedLinearMethod(QuantizeMethodBase):
    """vLLM's unquantized linear method: on the CPU its post-processing is the GEMM repack."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    pass


def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
    """vLLM's CPU GEMM dispatch as far as targets.py relies on it: the packed GEMM owns its own
    copy of the weight (oneDNN reorders it), and a linear layer's weight is then removed."""
    packed = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, weight, bias: x @ packed.t()
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def test_a_weight_the_cpu_backend_repacks_is_packed_by_prepare_and_swapped_in_by_apply(reloads, monkeypatch):
    from layoutlang.integrations.vllm.targets import EngineTargets

    monkeypatch.setattr(sys.modules["vllm.platforms"], "current_platform", types.SimpleNamespace(is_cpu=lambda: True))
    stubs = {
        "vllm.model_executor.layers.linear": {"UnquantizedLinearMethod": UnquantizedLinearMethod},
        "vllm.model_executor.layers.vocab_parallel_embedding": {
            "UnquantizedEmbeddingMethod": UnquantizedEmbeddingMethod
        },
        "vllm.model_executor.layers.utils": {"dispatch_cpu_unquantized_gemm": dispatch_cpu_unquantized_gemm},
    }
    for name, attributes in stubs.items():
        module = types.ModuleType(name)
        for attribute, value in attributes.items():
            setattr(module, attribute, value)
        monkeypatch.setitem(sys.modules, name, module)
    model = Model()
    model.mlp.gate_up = Leaf((0,), UnquantizedLinearMethod())  # as vLLM leaves it: repacked, weight removed
    before = model.mlp.gate_up.cpu_linear = lambda x, weight, bias: torch.zeros(len(x), 4)
    info = sys.modules["vllm.model_executor.model_loader.reload.layerwise"].LAYERWISE_INFO
    info[model.mlp.gate_up] = types.SimpleNamespace(restore_metadata=({"weight": torch.empty(4, 6, device="meta")},))
    resolved = EngineTargets(model, loads(PROGRAM).layout("engine"), RANK, engine="the test model")
    assert resolved.problems == [] and resolved.loaded == {}
    assert set(resolved.repacked) == {"mlp.gate_up.weight"} and set(resolved.direct) == {"norm.weight"}
    refit = received()
    want = refit["mlp.gate_up.weight"].clone()
    prepared = resolved.prepare(refit)
    assert model.mlp.gate_up.cpu_linear is before and torch.equal(model.norm.weight, torch.zeros(6))  # nothing yet
    refit["mlp.gate_up.weight"].zero_()  # the next refit lands in the same receive buffer
    resolved.apply(prepared, model_config=None)
    assert torch.equal(model.mlp.gate_up.cpu_linear(torch.eye(6), None, None), want.t())
    assert torch.equal(model.norm.weight, refit["norm.weight"])
    assert model.loaded == [] and reloads == []  # no load_weights, no reload lifecycle


def test_a_packed_gemm_that_reads_its_weight_is_packed_from_a_copy(reloads, monkeypatch):
    """zentorch's unpacked path and the fallback F.linear read the tensor they were given: the
    receive buffer (the next refit's) must not be it."""

    def reading(layer: Any, remove_weight: bool) -> None:
        weight = layer.weight.detach()  # no copy
        layer.cpu_linear = lambda x, w, bias: x @ weight.t()
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    monkeypatch.setitem(globals(), "dispatch_cpu_unquantized_gemm", reading)
    test_a_weight_the_cpu_backend_repacks_is_packed_by_prepare_and_swapped_in_by_apply(reloads, monkeypatch)
