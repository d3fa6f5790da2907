"""The table of target families (dflash.models.families): every entry's tiny model taps, stops and reports its
fast path as the table says; an unknown family is refused; and a fictional family, added as one entry, works
through the target, the layer split, the compiler, the drafter and the fast-path check with no other change."""

import ast
from dataclasses import replace
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from dflash.errors import BadInput
from dflash.models import families
from dflash.models.families import FAMILIES, Family, KernelPackage, Mixer, family_of, text_config_of
from dflash.models.target import (
    Target,
    build_hf_model,
    fast_path_report,
    num_layers_of,
    require_fast_path,
    target_config,
)

PACKAGE = Path(__file__).resolve().parents[1] / "dflash"
CUDA = torch.device("cuda", 0)  # require_fast_path only reads the device type: no GPU is touched


# ------------------------------------------------------------------------------------------ the real entries
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_each_family_taps_its_layers_and_reports_its_fast_path(family):
    """The entry's tiny config builds a model of the family; the target finds the layer list where the entry
    says, its features are the tapped layers' hidden states, and the fast-path report counts the mixers that
    need kernels as the layer kinds say."""
    model = build_hf_model(None, dict(family.tiny), "float32", seed=0)
    assert family_of(model.config) is family
    kinds = family.layer_kinds(model.config)
    taps = [1, len(kinds) - 2]
    ids = torch.randint(0, int(text_config_of(model.config).vocab_size), (2, 9))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states  # entry i+1: output of layer i
    target = Target(model, taps)
    path, _ = family.decoder_layers(model)
    assert path in family.layers and target.layers is model.get_submodule(path)
    torch.testing.assert_close(target.features(ids), torch.cat([hidden[i + 1] for i in taps], dim=-1))
    report = target.fast_path_report()
    fast_kinds = {m.kind for m in family.fast_mixers}
    assert report.hybrid == bool(fast_kinds)
    assert report.linear_layers == sum(k in fast_kinds for k in kinds) and report.total_layers == len(kinds)
    assert list(report.packages) == [k.name for k in family.kernels]


def test_an_unknown_model_type_is_refused_naming_the_supported_ones():
    with pytest.raises(BadInput, match=r"model_type 'gpt2' .* not a supported target family; supported model "
                                       r"types: llama, qwen2, qwen3, .*qwen3_next"):
        target_config(None, {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64})


def test_a_layer_kind_the_family_does_not_declare_is_refused():
    llama = families.family_named("llama")
    cfg = target_config(None, dict(llama.tiny))
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(BadInput, match="'linear_attention', which the llama family does not declare"):
        llama.layer_kinds(cfg)


def test_a_vision_language_model_reads_its_text_config_and_its_language_models_layers():
    """A Qwen3.5 checkpoint is a vision-language model: its decoder's config and layers sit one level down."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    family = families.family_named("qwen3_5")
    text = {k: v for k, v in family.tiny.items() if k != "model_type"}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 4, "num_position_embeddings": 16}
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    assert family_of(model.config) is family and family_of(model.config.text_config) is family
    assert text_config_of(model.config) is model.config.text_config
    assert text_config_of(model.config.text_config) is model.config.text_config
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    target = Target(model, [2])
    assert target.layers is model.model.language_model.layers and target.num_layers == 4
    torch.testing.assert_close(target.features(ids), hidden[3])


def _assignments(name: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found.append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_one_dtypes_table_and_one_text_config_helper():
    """DTYPES is defined once (the config's dtype names are its keys); only the family table reads a config's
    nested text config."""
    from dflash.config import TargetConfig
    from dflash.models.target import DTYPES

    assert _assignments("DTYPES") == ["dflash/models/target.py"]
    assert set(get_args(get_type_hints(TargetConfig)["dtype"])) == set(DTYPES)
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "families.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("text_config", "get_text_config"):
                readers.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value in ("text_config", "get_text_config"):
                readers.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not readers, "read the text config through dflash.models.families.text_config_of: " + ", ".join(readers)


# ------------------------------------------------------------------------------------- a fictional family
# "toy": a vision-language-style config whose decoder config sits under `language` (not a name transformers'
# get_text_config knows), a causal LM whose decoder layers are `trunk.blocks` (not `*.layers`), and a
# "toy_recurrence" mixer that needs a kernels package of its own.
class ToyTextConfig(PreTrainedConfig):
    model_type = "toy_text"
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    layer_types: list[str] | None = None


class ToyConfig(PreTrainedConfig):
    model_type = "toy"
    language: dict | PreTrainedConfig | None = None

    def __post_init__(self, **kwargs):
        if not isinstance(self.language, PreTrainedConfig):
            self.language = ToyTextConfig(**(self.language or {}))
        super().__post_init__(**kwargs)


class ToyRecurrence(nn.Module):
    """A running mean of a projection: causal, no attention."""

    def __init__(self, h: int):
        super().__init__()
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return self.proj(x).cumsum(1) / steps


class ToyAttention(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)

    def forward(self, x):
        b, n, h = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, h))


class ToyBlock(nn.Module):
    def __init__(self, tc: ToyTextConfig, kind: str):
        super().__init__()
        self.norm = nn.LayerNorm(tc.hidden_size)
        h = tc.hidden_size
        self.mixer = ToyRecurrence(h) if kind == "toy_recurrence" else ToyAttention(h, tc.num_attention_heads)
        self.mlp = nn.Sequential(nn.Linear(h, tc.intermediate_size), nn.SiLU(), nn.Linear(tc.intermediate_size, h))

    def forward(self, x):
        x = x + self.mixer(self.norm(x))
        return x + self.mlp(x)


class ToyTrunk(nn.Module):
    def __init__(self, tc: ToyTextConfig):
        super().__init__()
        self.embed = nn.Embedding(tc.vocab_size, tc.hidden_size)
        kinds = tc.layer_types or ["full_attention"] * tc.num_hidden_layers
        self.blocks = nn.ModuleList(ToyBlock(tc, kind) for kind in kinds)
        self.norm = nn.LayerNorm(tc.hidden_size)

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, use_cache=False):
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        states = [x]
        for block in self.blocks:
            x = block(x)
            states.append(x)
        return self.norm(x), tuple(states)


class ToyForCausalLM(PreTrainedModel):
    config_class = ToyConfig
    base_model_prefix = "trunk"

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        self.trunk = ToyTrunk(config.language)
        self.head = nn.Linear(config.language.hidden_size, config.language.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.trunk.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids=None, attention_mask=None, output_hidden_states=False, **_kwargs):
        x, states = self.trunk(input_ids=input_ids)
        return CausalLMOutputWithPast(logits=self.head(x), hidden_states=states if output_hidden_states else None)


TOY_KERNELS = KernelPackage("toy-kernels", "dflash_toy_kernels_not_installed")
TOY_RECURRENCE = Mixer("toy_recurrence", module="ToyRecurrence", kernels=(TOY_KERNELS,),
                       kernel_names=("toy_scan",), eager_in_compile=True)
TOY_SPEC = {"model_type": "toy", "language": {
    "layer_types": ["toy_recurrence", "toy_recurrence", "full_attention", "toy_recurrence"]}}
TOY = Family("toy", ("toy", "toy_text"), tiny=TOY_SPEC, mixers=(families.FULL_ATTENTION, TOY_RECURRENCE),
             layers=("trunk.blocks",), text_config_key="language",
             defaults={"rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "max_position_embeddings": 128})


@pytest.fixture
def toy_architecture(monkeypatch):
    """The toy model as transformers' Auto classes know it (what a real new architecture already is)."""
    monkeypatch.setitem(CONFIG_MAPPING._extra_content, "toy", ToyConfig)
    monkeypatch.setitem(MODEL_FOR_CAUSAL_LM_MAPPING._extra_content, ToyConfig, ToyForCausalLM)


def test_a_fictional_family_is_refused_until_it_has_an_entry(toy_architecture):
    with pytest.raises(BadInput, match="model_type 'toy' .* not a supported target family"):
        build_hf_model(None, dict(TOY_SPEC), "float32")


def test_a_fictional_family_is_one_entry_of_the_table(toy_architecture, monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", (*FAMILIES, TOY))  # the one change: the new entry

    # text config and layer access, as the entry says
    model = build_hf_model(None, dict(TOY_SPEC), "float32", seed=0)
    assert type(model) is ToyForCausalLM and family_of(model.config) is TOY
    assert text_config_of(model.config) is model.config.language and num_layers_of(None, dict(TOY_SPEC)) == 4
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    target = Target(model, [2, 1])
    assert target.layers is model.trunk.blocks and target.backbone is model.trunk and target.hidden_size == 32
    assert target.embed_tokens is model.trunk.embed and target.lm_head is model.head

    # the features: the tapped blocks' outputs; the forward stops after the deepest tapped block
    ran = []
    for i, block in enumerate(model.trunk.blocks):
        block.register_forward_pre_hook(lambda *_a, i=i: ran.append(i))
    feats = target.features(ids)
    torch.testing.assert_close(feats, torch.cat([states[2], states[3]], dim=-1))
    assert ran == [0, 1, 2]

    # the fast path: the mixers the entry names, the kernels package it names
    report = target.fast_path_report()
    assert report.hybrid and report.linear_layers == 3 and report.total_layers == 4
    assert report.packages == {"toy-kernels": False} and not report.fast
    assert "3 of 4 layers are ToyRecurrence" in report.describe() and "toy-kernels MISSING" in report.describe()
    with pytest.raises(BadInput, match=r"slow PyTorch path .* install toy-kernels \(the `kernels` role, or "
                                       r"`pip install toy-kernels`\)"):
        require_fast_path(report, CUDA, allow_slow_path=False)
    require_fast_path(report, CUDA, allow_slow_path=True)
    require_fast_path(report, torch.device("cpu"), allow_slow_path=False)
    installed = replace(TOY, mixers=(families.FULL_ATTENTION,
                                     replace(TOY_RECURRENCE, kernels=(KernelPackage("toy-kernels", "json"),))))
    monkeypatch.setattr(families, "FAMILIES", (*FAMILIES, installed))  # its kernels importable: the fast path
    assert fast_path_report(model, 4).fast
    monkeypatch.setattr(families, "FAMILIES", (*FAMILIES, TOY))
    from dflash.runtime import doctor

    info = doctor.collect()  # the doctor lists every family's kernels packages
    assert info["toy_kernels"] is False and "toy-kernels: no" in doctor.render(info)

    # the drafter takes the target's geometry and the family's defaults where the config has none
    from dflash.models.drafter import arch_from_target

    arch = arch_from_target(model.config, num_layers=1, block_size=4, layer_ids=[1, 2], mask_token_id=0,
                            vocab_size=64)
    assert (arch.hidden_size, arch.num_target_layers, arch.num_key_value_heads) == (32, 4, 2)
    assert (arch.rms_norm_eps, arch.rope_theta, arch.max_position_embeddings) == (1e-5, 10_000.0, 128)


def test_a_fictional_family_splits_by_layers_and_compiles_around_its_mixer(toy_architecture, monkeypatch):
    from dflash.compile import compile_target_layers
    from dflash.runtime.stages import TargetStage

    monkeypatch.setattr(families, "FAMILIES", (*FAMILIES, TOY))
    ids = torch.randint(0, 64, (2, 7))
    taps = [0, 2]
    want = Target(build_hf_model(None, dict(TOY_SPEC), "float32", seed=1), taps).features(ids)

    # two stages of a layer-split target chain to the unsplit features; the second holds no embedding
    first = TargetStage(build_hf_model(None, dict(TOY_SPEC), "float32", seed=1), taps, 0, 2, True, True)
    second = TargetStage(build_hf_model(None, dict(TOY_SPEC), "float32", seed=1), taps, 2, 3, False, False)
    assert len(first.layers) == 2 and len(second.layers) == 1 and second.model.trunk.embed is None
    hidden, got = first(ids, None)
    _, more = second(None, None, hidden)
    torch.testing.assert_close(torch.cat(got + more, dim=-1), want)
    assert first.fast_path_report().linear_layers == 2 and second.fast_path_report().linear_layers == 0

    # compiled: the blocks compile, the entry's eager mixer stays eager, the features do not change
    target = Target(build_hf_model(None, dict(TOY_SPEC), "float32", seed=1), taps)
    guard = compile_target_layers(target, mode="default", backend="eager")
    torch.testing.assert_close(target.features(ids), want)
    assert guard.failed is None
    kept = [type(m).__name__ for m in target.model.modules() if getattr(m, "_dflash_kept_eager", False)]
    assert kept == ["ToyRecurrence"] * 3
