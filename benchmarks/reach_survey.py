"""Reach on libraries' own attention code: what ``smxcompile.explain`` (``{"cpu": "rewrite"}``) does with every
softmax site of small random models of timm, x_transformers, vit_pytorch and diffusers; one line per model and every
site not rewritten, with its reason and location. A library that is not installed is skipped. Install them beside the
CPU torch: ``pip install --no-deps timm x-transformers vit-pytorch einops einx frozendict torch-einops-utils loguru``
(torchvision is stood in for). docs/DESIGN.md ("Reach on libraries' code") records a run.

    python benchmarks/reach_survey.py --family x_transformers --json reach.json"""

import argparse
import collections
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

import torch

import common
import smxcompile

TIMM = ("vit_tiny_patch16_224 deit_tiny_patch16_224 beit_base_patch16_224 swin_tiny_patch4_window7_224 "
        "swinv2_tiny_window8_256 cait_xxs24_224 xcit_nano_12_p16_224 pvt_v2_b0 twins_svt_small coat_lite_tiny "
        "crossvit_tiny_240 eva02_tiny_patch14_224 mvitv2_tiny mvitv2_small_cls levit_128s maxvit_tiny_tf_224 "
        "convit_tiny tnt_s_patch16_224 nest_tiny efficientformer_l1 efficientformerv2_s0 visformer_tiny volo_d1_224 "
        "gcvit_xxtiny davit_tiny fastvit_sa12 coatnet_0_rw_224 edgenext_xx_small hiera_tiny_224 samvit_base_patch16_224"
        " sam2_hiera_tiny vit_relpos_small_patch16_224 mobilevit_xxs mobilevitv2_050 nextvit_small tiny_vit_5m_224 "
        "vitamin_small_224 efficientvit_m0 pit_ti_224 vit_base_patch16_rope_224 vit_base_patch16_siglip_224").split()
XTF = {"decoder": {}, "alibi": dict(alibi_pos_bias=True), "rel_pos_bias": dict(rel_pos_bias=True),
       "dynamic_pos_bias": dict(dynamic_pos_bias=True), "rotary": dict(rotary_pos_emb=True),
       "qk_norm": dict(attn_qk_norm=True), "num_mem_kv": dict(attn_num_mem_kv=2), "gqa": dict(attn_kv_heads=2),
       "one_kv_head": dict(attn_one_kv_head=True), "cross_attend": dict(cross_attend=True),
       "softclamp_logits": dict(attn_softclamp_logits=True), "head_scale": dict(attn_head_scale=True),
       "residual_attn": dict(residual_attn=True), "gate_values": dict(attn_gate_values=True),
       "value_residual": dict(add_value_residual=True), "max_attend_past": dict(attn_max_attend_past=4),
       "data_dependent_alibi": dict(attn_data_dependent_alibi=True), "add_zero_kv": dict(attn_add_zero_kv=True),
       "learned_sink": dict(attn_head_learned_sink=True),
       # beyond one attention call: reported, never rewritten
       "talking_heads": dict(attn_pre_talking_heads=True, attn_post_talking_heads=True),
       "sparse_topk": dict(attn_sparse_topk=4), "selective": dict(attn_selective=True),
       "cope": dict(attn_use_cope=True)}
VITPT_COMMON = dict(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64, dim_head=16)
#: vit_pytorch model -> its arguments beyond VITPT_COMMON's
VITPT = {"vit.ViT": {}, "simple_vit.SimpleViT": {}, "cait.CaiT": dict(cls_depth=1), "deepvit.DeepViT": {},
         "pit.PiT": dict(depth=(1, 1)), "vit_for_small_dataset.ViT": {}, "simple_vit_with_qk_norm.SimpleViT": {},
         "vit_with_patch_merger.ViT": dict(patch_merge_layer=1, patch_merge_num_tokens=4),
         "simple_vit_with_register_tokens.SimpleViT": dict(num_register_tokens=2)}
#: vit_pytorch models of another signature -> all their arguments
VITPT_OWN = {"nest.NesT": dict(image_size=32, patch_size=4, num_classes=10, dim=32, heads=2, num_hierarchies=2,
                               block_repeats=(1, 1)),
             "max_vit.MaxViT": dict(num_classes=10, dim=32, depth=(1,), dim_head=16, window_size=4),
             "levit.LeViT": dict(image_size=64, num_classes=10, dim=(32, 48, 64), depth=1, heads=(2, 2, 2), mlp_mult=2,
                                 stages=3, dim_key=16, dim_value=16),
             "sep_vit.SepViT": dict(num_classes=10, dim=32, depth=(1, 1), heads=(2, 2), dim_head=16)}


def _torchvision_stand_in() -> None:
    """timm and vit-pytorch import torchvision for data transforms and FrozenBatchNorm2d only; PyPI's torchvision
    breaks next to the CPU torch, so a missing one is stood in for in this process."""
    try:
        importlib.import_module("torchvision")
        return
    except Exception:
        pass

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "InterpolationMode":
            return type(attr, (), {k: k.lower() for k in ("NEAREST", "NEAREST_EXACT", "BILINEAR", "BICUBIC", "BOX",
                                                          "HAMMING", "LANCZOS")})
        return type(attr, (torch.nn.Identity,), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            is_tv = name.split(".")[0] == "torchvision"
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if is_tv else None

        def create_module(self, spec):
            mod = types.ModuleType(spec.name)
            mod.__path__, mod.__getattr__ = [], missing
            return mod

        def exec_module(self, module):
            pass

    sys.meta_path.append(Finder())


def timm_models():
    _torchvision_stand_in()
    import timm
    from timm.layers import set_fused_attn
    set_fused_attn(False)
    for name in TIMM:
        def make(name=name):
            m = timm.create_model(name, pretrained=False, num_classes=10)
            return m, (torch.randn(1, *m.pretrained_cfg.get("input_size", (3, 224, 224))),), {}
        yield f"timm/{name}", make


def x_transformers_models():
    import x_transformers as X
    for name, kw in XTF.items():
        def make(kw=kw):
            cls = X.Encoder if kw.get("cross_attend") else X.Decoder
            m = X.TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=cls(
                dim=32, depth=2, heads=4, attn_dim_head=8, attn_flash=False, **kw))
            extra = {"context": torch.randn(2, 7, 32)} if kw.get("cross_attend") else {}
            return m, (torch.randint(0, 64, (2, 12)),), {"mask": torch.arange(12) < torch.tensor([[12], [7]]), **extra}
        yield f"x_transformers/{name}", make


def vit_pytorch_models():
    _torchvision_stand_in()
    importlib.import_module("vit_pytorch")  # missing: the whole family is skipped
    for path, kw in {**{p: {**VITPT_COMMON, **kw} for p, kw in VITPT.items()}, **VITPT_OWN}.items():
        def make(path=path, kw=kw):
            mod, cls = path.rsplit(".", 1)
            m = getattr(importlib.import_module(f"vit_pytorch.{mod}"), cls)(**kw)
            # SepViT's blocks keep their default 7x7 windows: 56 pixels, 14 then 7 tokens a side
            side = 56 if path == "sep_vit.SepViT" else kw.get("image_size", 32)
            return m, (torch.randn(2, 3, side, side),), {}
        yield f"vit_pytorch/{path}", make


def diffusers_models():
    import diffusers
    from diffusers.models.attention_processor import AttnProcessor

    def make(cls, inputs, **cfg):
        m = getattr(diffusers, cls)(**cfg)
        for mod in m.modules():
            if hasattr(mod, "set_processor") and hasattr(mod, "processor"):
                mod.set_processor(AttnProcessor())
        return m, *inputs()

    unet = dict(sample_size=16, layers_per_block=1, block_out_channels=(32, 64), norm_num_groups=32)
    yield "diffusers/UNet2DConditionModel", lambda: make("UNet2DConditionModel", lambda: (
        (torch.randn(2, 4, 16, 16), torch.tensor([10, 20])), {"encoder_hidden_states": torch.randn(2, 7, 32)}),
        in_channels=4, out_channels=4, cross_attention_dim=32, attention_head_dim=8, **unet,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    yield "diffusers/AutoencoderKL", lambda: make("AutoencoderKL", lambda: ((torch.randn(2, 3, 16, 16),), {}),
                                                  block_out_channels=(32, 64), norm_num_groups=32,
                                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                                  up_block_types=("UpDecoderBlock2D",) * 2)
    yield "diffusers/DiTTransformer2DModel", lambda: make("DiTTransformer2DModel", lambda: (
        (torch.randn(2, 4, 8, 8),), {"timestep": torch.tensor([1, 2]), "class_labels": torch.tensor([0, 1])}),
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10)


# the families that may need the torchvision stand-in come last: transformers (under diffusers) checks for it
FAMILIES = {"diffusers": diffusers_models, "x_transformers": x_transformers_models, "timm": timm_models,
            "vit_pytorch": vit_pytorch_models}


def survey(family: str) -> dict:
    """``{model: [site dicts]}`` of a family, one line per model printed; ``{"missing": why}`` when the library is
    not installed."""
    try:
        models = list(FAMILIES[family]())          # imports the library; builds no model yet
    except ImportError as e:
        print(f"{family}: not installed ({type(e).__name__}: {e}): skipped; the pip command: --help", flush=True)
        return {"missing": str(e)}
    out = {}
    for name, make in models:
        torch.manual_seed(0)
        try:
            model, args, kwargs = make()
            sites = [s.to_dict() for s in smxcompile.explain(model.eval(), *args, options={"cpu": "rewrite"},
                                                              **kwargs)]
        except Exception as e:          # a model this library version cannot build: listed, not counted
            sites = [{"kind": "error", "action": "error", "reason": common.err_text(e), "location": ""}]
        torch._dynamo.reset()
        out[name] = sites
        print(name, dict(collections.Counter((s["kind"], s["action"]) for s in sites)), flush=True)
        for s in {(s["kind"], s["action"], s["reason"], s["location"]) for s in sites if s["action"] != "rewritten"}:
            print("   ", *s[:2], "|", s[2][:200], "|", s[3], flush=True)
    total = collections.Counter((s["kind"], s["action"]) for sites in out.values() for s in sites)
    print(f"{family}: {len(out)} models; attention rewritten {total['attention', 'rewritten']}, skipped "
          f"{total['attention', 'skipped']}; softmax rewritten alone {total['softmax', 'rewritten']}; errors "
          f"{total['error', 'error']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), action="append", help="library (repeatable; default all)")
    p.add_argument("--json", help="write every site of every model here")
    a = p.parse_args(argv)
    common.write_json(a.json, {f: survey(f) for f in FAMILIES if f in (a.family or FAMILIES)})


if __name__ == "__main__":
    main()
