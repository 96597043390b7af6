"""MobileFaceNet and ViT in arcface_torch's layouts: the state dict of every named size
against the published layout (written out here), the forward of every size against a
float64 reference of its layer arithmetic written with torch.nn.functional, the training
mode's token masking, and the files: arcface_torch's read by content, ours written back."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recognition import checkpoint as ckpt
from recognition.config import ConfigError, ModelConfig, load_config
from recognition.export import main as export_main
from recognition.models import VIT_SIZES, build_backbone
from recognition.models.vit import VisionTransformer, _keep_random_tokens
from recognition.pipeline import plan_stages, unit_costs


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """One thread: many small ops, which two threads on a busy machine slow down."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---- the published layouts, written out from arcface_torch's architecture -----------------

# name: (blocks of layers.1, 3, 5, 7; scale of the outer widths)
MBF = {"mbf": ((1, 4, 6, 2), 2), "mbf_large": ((2, 8, 12, 4), 4)}
# name: (D, depth); every ViT has 8 heads, an MLP of 4 D, 9x9 patches: 144 tokens at 112.
VIT = {"vit_t": (256, 12), "vit_s": (512, 12), "vit_b": (512, 24), "vit_l": (768, 24),
       "vit_h": (1024, 48)}  # fmt: skip


def bn(prefix: str, n: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{prefix}.{k}", (n,)) for k in ("weight", "bias", "running_mean", "running_var")] + [
        (f"{prefix}.num_batches_tracked", ())
    ]


def conv_unit(prefix: str, cin: int, cout: int, k: int, groups: int, act: bool) -> list:
    out = [
        (f"{prefix}layers.0.weight", (cout, cin // groups, k, k)),
        *bn(f"{prefix}layers.1", cout),
    ]
    return out + ([(f"{prefix}layers.2.weight", (cout,))] if act else [])


def depthwise(prefix: str, cin: int, cout: int, inner: int) -> list:
    return (
        conv_unit(f"{prefix}layers.0.", cin, inner, 1, 1, True)
        + conv_unit(f"{prefix}layers.1.", inner, inner, 3, inner, True)
        + conv_unit(f"{prefix}layers.2.", inner, cout, 1, 1, False)
    )


def published_mbf(name: str, embedding: int) -> list[tuple[str, tuple[int, ...]]]:
    (b1, b3, b5, b7), s = MBF[name]
    narrow, wide = 64 * s, 128 * s
    out = conv_unit("layers.0.", 3, narrow, 3, 1, True)
    if b1 == 1:
        out += conv_unit("layers.1.", narrow, narrow, 3, 64, True)
    else:
        out += [
            e for j in range(b1) for e in depthwise(f"layers.1.layers.{j}.", narrow, narrow, 128)
        ]
    out += depthwise("layers.2.", narrow, narrow, 128)
    out += [e for j in range(b3) for e in depthwise(f"layers.3.layers.{j}.", narrow, narrow, 128)]
    out += depthwise("layers.4.", narrow, wide, 256)
    out += [e for j in range(b5) for e in depthwise(f"layers.5.layers.{j}.", wide, wide, 256)]
    out += depthwise("layers.6.", wide, wide, 512)
    out += [e for j in range(b7) for e in depthwise(f"layers.7.layers.{j}.", wide, wide, 256)]
    out += conv_unit("conv_sep.", wide, 512, 1, 1, True)
    out += conv_unit("features.layers.0.", 512, 512, 7, 512, False)
    return out + [
        ("features.layers.2.weight", (embedding, 512)),
        *bn("features.layers.3", embedding),
    ]


def published_vit(name: str, embedding: int) -> list[tuple[str, tuple[int, ...]]]:
    d, depth = VIT[name]
    out = [("pos_embed", (1, 144, d)), ("mask_token", (1, 1, d)),
           ("patch_embed.proj.weight", (d, 3, 9, 9)), ("patch_embed.proj.bias", (d,))]  # fmt: skip
    for i in range(depth):
        p = f"blocks.{i}."
        out += [(p + "norm1.weight", (d,)), (p + "norm1.bias", (d,)), (p + "norm2.weight", (d,)),
                (p + "norm2.bias", (d,)), (p + "attn.qkv.weight", (3 * d, d)),
                (p + "attn.proj.weight", (d, d)), (p + "attn.proj.bias", (d,)),
                (p + "mlp.fc1.weight", (4 * d, d)), (p + "mlp.fc1.bias", (4 * d,)),
                (p + "mlp.fc2.weight", (d, 4 * d)), (p + "mlp.fc2.bias", (d,))]  # fmt: skip
    out += [("norm.weight", (d,)), ("norm.bias", (d,)), ("feature.0.weight", (d, 144 * d))]
    return out + [
        *bn("feature.1", d),
        ("feature.2.weight", (embedding, d)),
        *bn("feature.3", embedding),
    ]


def entries(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


@pytest.mark.parametrize("name", [*MBF, *VIT])
def test_every_full_size_has_the_published_keys_and_shapes(name):
    with torch.device("meta"):
        model = build_backbone(name, embedding_size=384)
    published = published_mbf(name, 384) if name in MBF else published_vit(name, 384)
    assert entries(model) == published


def test_parameter_counts_are_the_published_models():
    # Counted from the layouts above (and by arcface_torch's own modules, 512-d).
    counts = {"mbf": 2_059_520, "mbf_large": 6_314_880, "vit_t": 19_137_792}
    for name, count in counts.items():
        with torch.device("meta"):
            model = build_backbone(name, embedding_size=512)
        assert sum(p.numel() for p in model.parameters()) == count, name


# ---- the forward against a float64 reference of the layer arithmetic ----------------------


def randomised(model: nn.Module, seed: int) -> nn.Module:
    """`model` in float64 and eval mode, every norm's statistics and affine made random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
            if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d | nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.2, 0.2, generator=g)
            if isinstance(m, nn.PReLU):
                m.weight.uniform_(0.0, 0.5, generator=g)
        model.pos_embed.normal_(0, 0.5, generator=g) if hasattr(model, "pos_embed") else None
    return model.double().eval()


def ref_conv_unit(x, sd, prefix, stride, padding, groups, act):
    x = F.conv2d(x, sd[prefix + "layers.0.weight"], stride=stride, padding=padding, groups=groups)
    b = prefix + "layers.1."
    x = F.batch_norm(x, sd[b + "running_mean"], sd[b + "running_var"], sd[b + "weight"],
                     sd[b + "bias"], False, 0.0, 1e-5)  # fmt: skip
    return F.prelu(x, sd[prefix + "layers.2.weight"]) if act else x


def ref_depthwise(x, sd, prefix, stride, residual):
    inner = sd[prefix + "layers.0.layers.0.weight"].shape[0]
    y = ref_conv_unit(x, sd, prefix + "layers.0.", 1, 0, 1, True)
    y = ref_conv_unit(y, sd, prefix + "layers.1.", stride, 1, inner, True)
    y = ref_conv_unit(y, sd, prefix + "layers.2.", 1, 0, 1, False)
    return x + y if residual else y


def mbf_reference(x, sd, blocks):
    x = ref_conv_unit(x, sd, "layers.0.", 2, 1, 1, True)
    if blocks[0] == 1:
        x = ref_conv_unit(x, sd, "layers.1.", 1, 1, 64, True)
    for j in range(blocks[0] if blocks[0] > 1 else 0):
        x = ref_depthwise(x, sd, f"layers.1.layers.{j}.", 1, True)
    for stage, count in ((2, blocks[1]), (4, blocks[2]), (6, blocks[3])):
        x = ref_depthwise(x, sd, f"layers.{stage}.", 2, False)
        for j in range(count):
            x = ref_depthwise(x, sd, f"layers.{stage + 1}.layers.{j}.", 1, True)
    x = ref_conv_unit(x, sd, "conv_sep.", 1, 0, 1, True)
    x = ref_conv_unit(x, sd, "features.layers.0.", 1, 0, x.shape[1], False).flatten(1)
    x = F.linear(x, sd["features.layers.2.weight"])
    b = "features.layers.3."
    return F.batch_norm(x, sd[b + "running_mean"], sd[b + "running_var"], sd[b + "weight"],
                        sd[b + "bias"], False, 0.0, 1e-5)  # fmt: skip


def vit_reference(x, sd, depth):
    d = sd["pos_embed"].shape[-1]
    heads, hd = 8, d // 8
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=9)
    t = t.flatten(2).transpose(1, 2) + sd["pos_embed"]  # (B, N, D)
    batch, n, _ = t.shape
    for i in range(depth):
        p = f"blocks.{i}."
        h = F.layer_norm(t, (d,), sd[p + "norm1.weight"], sd[p + "norm1.bias"], 1e-5)
        q, k, v = (h @ sd[p + "attn.qkv.weight"].T).split(d, dim=-1)
        q, k, v = (z.reshape(batch, n, heads, hd).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1) @ v
        t = t + a.transpose(1, 2).reshape(batch, n, d) @ sd[p + "attn.proj.weight"].T
        t = t + sd[p + "attn.proj.bias"]
        h = F.layer_norm(t, (d,), sd[p + "norm2.weight"], sd[p + "norm2.bias"], 1e-5)
        h = torch.clamp(h @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"], 0.0, 6.0)
        t = t + h @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"]
    t = F.layer_norm(t, (d,), sd["norm.weight"], sd["norm.bias"], 1e-5)
    f = t.reshape(batch, -1) @ sd["feature.0.weight"].T
    for i, weight in ((1, None), (2, "feature.2.weight"), (3, None)):
        if weight is not None:
            f = f @ sd[weight].T
            continue
        b = f"feature.{i}."
        f = F.batch_norm(f, sd[b + "running_mean"], sd[b + "running_var"], sd[b + "weight"],
                         sd[b + "bias"], False, 0.0, 2e-5)  # fmt: skip
    return f


@pytest.mark.parametrize("name, side", [("mbf", 112), ("mbf_large", 64)])
def test_mobilefacenet_matches_the_functional_reference_in_float64(name, side):
    torch.manual_seed(0)
    model = randomised(build_backbone(name, embedding_size=64, image_size=side), 1)
    x = torch.randn(2, 3, side, side, dtype=torch.float64)
    with torch.no_grad():
        got = model(x)
        expected = mbf_reference(x, model.state_dict(), MBF[name][0])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(VIT))
def test_vit_matches_the_functional_reference_in_float64(name):
    # Each size's width, heads and MLP, at 2 blocks (1 for the widest) and 27x27 inputs
    # (3 x 3 tokens): the arithmetic of every block is the same at any depth.
    depth = 1 if VIT[name][0] >= 768 else 2
    torch.manual_seed(0)
    size = dataclasses.replace(VIT_SIZES[name], depth=depth)
    model = randomised(VisionTransformer(size, embedding_size=48, image_size=27), 2)
    with torch.no_grad():
        for block in model.blocks:  # MLP inputs beyond ReLU6's 6 (trained weights reach it)
            block.mlp.fc1.weight.normal_(0, 4 / math.sqrt(block.mlp.fc1.in_features))
    x = torch.randn(2, 3, 27, 27, dtype=torch.float64)
    with torch.no_grad():
        got = model(x)
        expected = vit_reference(x, model.state_dict(), depth)
        first = model.blocks[0]
        hidden = first.mlp.fc1(first.norm2(model.patch_embed(x) + model.pos_embed))
    assert (hidden > 6).any() and (hidden < 0).any()  # both ends of ReLU6 are used
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_training_masks_tokens_and_puts_mask_token_in_their_place():
    tokens = torch.arange(2 * 10 * 3, dtype=torch.float64).reshape(2, 10, 3)
    torch.manual_seed(0)
    kept, restore = _keep_random_tokens(tokens, 0.3)
    assert kept.shape == (2, 7, 3)  # int(10 x 0.7)
    # Put back as the model does: the kept tokens and fillers, gathered by `restore`.
    filler = torch.full((2, 3, 3), -1.0, dtype=torch.float64)
    back = torch.gather(torch.cat([kept, filler], 1), 1, restore.unsqueeze(-1).expand(-1, -1, 3))
    for b in range(2):
        is_kept = (back[b] >= 0).all(dim=1)
        assert int(is_kept.sum()) == 7
        assert torch.equal(back[b][is_kept], tokens[b][is_kept])  # each in its own place
        assert (back[b][~is_kept] == -1).all()

    # The model's own put-back: with no blocks, every row of the flattened tokens is either
    # its own token (normalised) or the mask token, which stands in for 16 - 14 of them.
    torch.manual_seed(0)
    size = dataclasses.replace(VIT_SIZES["vit_t"], depth=0)
    bare = VisionTransformer(size, embedding_size=8, width=0.125, image_size=36).train()
    rows = []
    bare.dropout.register_forward_hook(lambda m, args, out: rows.append(out.reshape(3, 16, 32)))
    x = torch.randn(3, 3, 36, 36)
    bare(x)
    with torch.no_grad():
        own = bare.norm(bare.patch_embed(x) + bare.pos_embed)  # (3, 16, 32)
    for b in range(3):
        is_mask = torch.isclose(rows[0][b], bare.mask_token[0]).all(dim=1)
        assert int(is_mask.sum()) == 2
        torch.testing.assert_close(rows[0][b][~is_mask], own[b][~is_mask])

    model = build_backbone("vit_t", embedding_size=16, width=0.125, image_size=36)  # 16 tokens
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    model.train()(torch.randn(3, 3, 36, 36)).sum().backward()
    assert seen == [14] and model.mask_token.grad is not None  # int(16 x 0.9) tokens
    model.eval()(torch.randn(3, 3, 36, 36))
    assert seen[-1] == 16
    assert not build_backbone("vit_h", width=0.125, image_size=18).mask_token.requires_grad


# ---- files: arcface_torch's read by content, ours written back ----------------------------


@pytest.mark.parametrize(
    "name, width, side, told",
    [("mbf", 0.25, 64, ("mbf", 0.25, 64)),
     ("mbf_large", 0.125, (48, 32), ("mbf_large", 0.125, (48, 32))),
     ("vit_t", 1.0, 112, ("vit_t", 1.0, 112)), ("vit_b", 0.0625, 27, ("vit_b", 0.0625, 27)),
     # The same layout as vit_t at 1/8 (32 wide, 12 blocks): the first name of that depth.
     ("vit_s", 0.0625, 36, ("vit_t", 0.125, 36))],
)  # fmt: skip
def test_an_arcface_torch_file_is_told_by_content_and_gives_the_same_embeddings(
    tmp_path, name, width, side, told
):
    torch.manual_seed(0)
    model = randomised(build_backbone(name, embedding_size=24, width=width, image_size=side), 3)
    model = model.float()
    # As arcface_torch saves a DataParallel model: every key under "module.".
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "b.pth")
    model_cfg, image_size, state = ckpt.load_backbone_file(tmp_path / "b.pth")
    told_name, told_width, told = told
    assert model_cfg == dataclasses.asdict(
        ModelConfig(backbone=told_name, embedding_size=24, width=told_width)
    )
    assert image_size == told
    loaded, _ = ckpt.load_backbone(tmp_path / "b.pth", torch.device("cpu"))
    height, w = (side, side) if isinstance(side, int) else side
    images = torch.randn(2, 3, height, w)
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))


def test_export_to_arcface_torch_and_back(tmp_path, caplog):
    torch.manual_seed(0)
    model = randomised(build_backbone("mbf", embedding_size=32), 4).float()
    cfg = dataclasses.asdict(ModelConfig(backbone="mbf", embedding_size=32, width=1.0))
    ckpt.export_backbone(tmp_path / "backbone.pt", model, cfg, 112)
    out = tmp_path / "mbf.pth"
    with caplog.at_level("INFO"):
        assert (
            export_main(
                ["--checkpoint", str(tmp_path / "backbone.pt"), "--arcface-torch", str(out)]
            )
            == 0
        )
    assert "get_model('mbf', num_features=32) loads it" in caplog.text
    written = torch.load(out, weights_only=True)
    assert [(k, tuple(v.shape)) for k, v in written.items()] == published_mbf("mbf", 32)
    loaded, size = ckpt.load_backbone(out, torch.device("cpu"))
    images = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        assert size == 112 and torch.equal(loaded(images), model(images))

    vit = build_backbone("vit_l", embedding_size=16, width=1 / 96, image_size=27)
    vcfg = dataclasses.asdict(ModelConfig(backbone="vit_l", embedding_size=16, width=1 / 96))
    ckpt.export_backbone(tmp_path / "vit.pt", vit, vcfg, 27)
    caplog.clear()
    with caplog.at_level("INFO"):
        assert (
            export_main(
                [
                    "--checkpoint",
                    str(tmp_path / "vit.pt"),
                    "--arcface-torch",
                    str(tmp_path / "v.pth"),
                ]
            )
            == 0
        )
    assert "vit_l_dp005_mask_005" in caplog.text and "will not take this file" in caplog.text


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda s: [s.pop(k) for k in list(s) if k.startswith("layers.3.layers.3.")],
         "of a known size: its blocks are (1, 3, 6, 2)"),
        (lambda s: s.__setitem__("conv_sep.layers.1.bias", torch.zeros(3)),
         "conv_sep.layers.1.bias has shape (3,)"),
        (lambda s: s.__setitem__("extra.weight", torch.zeros(1)), "unexpected key extra.weight"),
    ],
)  # fmt: skip
def test_a_mobilefacenet_file_that_does_not_fit_is_refused_in_one_line(tmp_path, edit, named):
    state = build_backbone("mbf", embedding_size=8, width=0.125, image_size=32).state_dict()
    edit(state)
    torch.save(state, tmp_path / "m.pth")
    with pytest.raises(ValueError, match=r"checkpoint .*m\.pth: not a") as error:
        ckpt.load_backbone_file(tmp_path / "m.pth")
    assert named in str(error.value) and "\n" not in str(error.value)


def test_a_vit_file_with_tokens_not_on_a_square_is_refused(tmp_path):
    state = build_backbone("vit_t", embedding_size=8, width=0.125, image_size=(27, 18)).state_dict()
    torch.save(state, tmp_path / "v.pth")
    with pytest.raises(ValueError, match="pos_embed holds 6 tokens, not a square grid"):
        ckpt.load_backbone_file(tmp_path / "v.pth")


# ---- pipeline stages ----------------------------------------------------------------------


def test_mobilefacenet_cuts_into_stages_that_compose_to_the_whole():
    cfg = ModelConfig(backbone="mbf_large", embedding_size=16, width=0.125)
    units, costs = unit_costs(cfg, (32, 32))
    assert units[:3] == ["stem", "layers.1.layers.0", "layers.1.layers.1"]
    assert units[-2:] == ["conv_sep", "embedding"] and len(units) == 1 + 2 + 3 + 8 + 12 + 4 + 2
    ranges = plan_stages(units, costs, 3)
    torch.manual_seed(0)
    whole = build_backbone("mbf_large", embedding_size=16, width=0.125, image_size=32).eval()
    stages = []
    for first, stop in ranges:
        torch.manual_seed(0)
        stage = build_backbone("mbf_large", embedding_size=16, width=0.125, image_size=32)
        stage.keep_units(first, stop)
        stages.append(stage.eval())
    names = [k for s in stages for k in s.state_dict()]
    assert sorted(names) == sorted(whole.state_dict())  # every entry in one stage, same name
    x = torch.randn(2, 3, 32, 32)
    y = x
    with torch.no_grad():
        for stage in stages:
            y = stage(y)
        torch.testing.assert_close(y, whole(x), rtol=0, atol=0)


def test_a_pipelined_vit_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"model.pipeline_stages=2: a ViT \(vit_b\) is not cut"):
        load_config("default", ["model.backbone=vit_b", "model.pipeline_stages=2"])


# ---- every precision level ----------------------------------------------------------------


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["mbf", "vit_t"])
def test_a_step_at_every_precision_level(name, level):
    from recognition.config import HeadConfig, OptimConfig
    from recognition.heads import build_head
    from recognition.optim import build_optimizer, param_groups
    from recognition.precision import Precision
    from recognition.training.step import train_step

    torch.manual_seed(0)
    backbone = build_backbone(name, embedding_size=16, width=0.125, image_size=32)
    head = build_head(HeadConfig(margin="cosface"), 10, 16, seed=0, device="cpu")
    precision = Precision(level, "bf16", torch.device("cpu"))
    precision.prepare(backbone, head)
    groups = precision.param_groups(param_groups([backbone, head], 5e-4))
    optimizer = build_optimizer(groups, OptimConfig(name="sgd", lr=0.1))
    head.attach_optimizer(optimizer, precision.optimizer_param(head.weight))
    before = {k: v.detach().float().clone() for k, v in backbone.state_dict().items()}
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    result = train_step(backbone, head, [(x, y)], optimizer, precision, 5.0)
    assert bool(result.stepped) and bool(torch.isfinite(result.loss))
    half = level in ("O2", "O3")
    for module in backbone.modules():
        for p in module.parameters(recurse=False):
            kept = level == "O2" and isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d)
            assert p.dtype == (torch.bfloat16 if half and not kept else torch.float32)
    moved = [k for k, v in backbone.state_dict().items() if not torch.equal(v.float(), before[k])]
    assert "feature.0.weight" in moved or "features.layers.2.weight" in moved
