"""Tests for the backbones: shapes, published state-dict layout, and forward semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recognition.models import BACKBONES, build_backbone
from recognition.models.iresnet import IBasicBlock, iresnet18, iresnet50
from recognition.models.resnet import resnet50_reid


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """Run this module's tests on one thread, and restore the setting afterwards.

    These models run hundreds of tiny ops; with two OpenMP threads on a busy two-core
    machine every op waits at a barrier for a descheduled thread, which made the file
    30x slower (90 s instead of 3 s) while other jobs were running.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Written out from the published architecture (arcface_torch), not read from our code.
BLOCKS_PER_STAGE = {
    "iresnet18": [2, 2, 2, 2],
    "iresnet34": [3, 4, 6, 3],
    "iresnet50": [3, 4, 14, 3],
    "iresnet100": [3, 13, 30, 3],
    "iresnet200": [6, 26, 60, 6],
}


def bn_entries(prefix: str, channels: int) -> list[tuple[str, tuple[int, ...]]]:
    """The five state-dict entries of a BatchNorm layer."""
    return [
        (f"{prefix}.weight", (channels,)),
        (f"{prefix}.bias", (channels,)),
        (f"{prefix}.running_mean", (channels,)),
        (f"{prefix}.running_var", (channels,)),
        (f"{prefix}.num_batches_tracked", ()),
    ]


def published_iresnet_entries(
    blocks_per_stage: list[int], embedding_size: int = 512
) -> list[tuple[str, tuple[int, ...]]]:
    """State-dict keys and shapes of an insightface IResNet for 112x112 input, in order."""
    entries = [("conv1.weight", (64, 3, 3, 3))]
    entries += bn_entries("bn1", 64)
    entries += [("prelu.weight", (64,))]
    in_channels = 64
    for stage, (num_blocks, channels) in enumerate(
        zip(blocks_per_stage, [64, 128, 256, 512], strict=True)
    ):
        for index in range(num_blocks):
            p = f"layer{stage + 1}.{index}"
            entries += bn_entries(f"{p}.bn1", in_channels)
            entries += [(f"{p}.conv1.weight", (channels, in_channels, 3, 3))]
            entries += bn_entries(f"{p}.bn2", channels)
            entries += [(f"{p}.prelu.weight", (channels,))]
            entries += [(f"{p}.conv2.weight", (channels, channels, 3, 3))]
            entries += bn_entries(f"{p}.bn3", channels)
            if index == 0:  # every stage starts with stride 2, so it projects its shortcut
                entries += [(f"{p}.downsample.0.weight", (channels, in_channels, 1, 1))]
                entries += bn_entries(f"{p}.downsample.1", channels)
            in_channels = channels
    entries += bn_entries("bn2", 512)
    entries += [("fc.weight", (embedding_size, 512 * 7 * 7)), ("fc.bias", (embedding_size,))]
    entries += bn_entries("features", embedding_size)
    return entries


def test_iresnet50_state_dict_matches_published_layout() -> None:
    model = iresnet50(embedding_size=512)
    expected = published_iresnet_entries(BLOCKS_PER_STAGE["iresnet50"])
    actual = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert actual == expected

    # A checkpoint with exactly those keys loads strictly, and its values arrive.
    generator = torch.Generator().manual_seed(0)
    checkpoint = {
        key: (
            torch.randint(0, 100, shape, generator=generator)
            if key.endswith("num_batches_tracked")
            else torch.randn(shape, generator=generator)
        )
        for key, shape in expected
    }
    model.load_state_dict(checkpoint, strict=True)
    loaded = model.state_dict()
    for key in ("conv1.weight", "layer3.13.conv2.weight", "fc.weight", "features.running_var"):
        assert torch.equal(loaded[key], checkpoint[key])

    # One key missing or one extra must be refused.
    del checkpoint["layer4.2.bn3.bias"]
    with pytest.raises(RuntimeError, match="layer4.2.bn3.bias"):
        model.load_state_dict(checkpoint, strict=True)


def test_batchnorm_epsilon_and_feature_scale_frozen() -> None:
    model = iresnet18(width=0.125, image_size=32, embedding_size=16)
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
            assert module.eps == 1e-5
    # The feature BN's scale is a frozen 1 (as in insightface); its shift is trained.
    assert not model.features.weight.requires_grad
    assert torch.equal(model.features.weight, torch.ones(16))
    assert model.features.bias.requires_grad
    model(torch.randn(4, 3, 32, 32)).square().sum().backward()
    assert model.features.weight.grad is None
    assert model.features.bias.grad is not None


def count_iresnet_parameters(blocks_per_stage: list[int], embedding_size: int) -> int:
    """Parameter count of an IResNet at width 1 for 112x112, from the architecture alone."""

    def bn(c: int) -> int:
        return 2 * c

    total = 3 * 64 * 9 + bn(64) + 64  # stem conv, BN, PReLU
    in_channels = 64
    for num_blocks, c in zip(blocks_per_stage, [64, 128, 256, 512], strict=True):
        for index in range(num_blocks):
            total += bn(in_channels) + 9 * in_channels * c + bn(c) + c + 9 * c * c + bn(c)
            if index == 0:
                total += in_channels * c + bn(c)
            in_channels = c
    total += bn(512) + 512 * 49 * embedding_size + embedding_size + bn(embedding_size)
    return total


def test_iresnet50_parameter_count() -> None:
    model = iresnet50(embedding_size=512)
    num_params = sum(p.numel() for p in model.parameters())
    expected = count_iresnet_parameters(BLOCKS_PER_STAGE["iresnet50"], 512)
    assert num_params == expected
    # The published figure for arcface_torch's r50 is 43.6M parameters.
    assert abs(num_params - 43.6e6) < 0.05e6
    # Only the frozen feature scale (512 values) is not trainable.
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert num_trainable == expected - 512


@pytest.mark.parametrize("name", sorted(BLOCKS_PER_STAGE))
def test_iresnet_depths(name: str) -> None:
    model = build_backbone(name, embedding_size=8, width=0.125, image_size=16)
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    assert [len(stage) for stage in stages] == BLOCKS_PER_STAGE[name]


def test_stride_is_in_second_conv_of_first_block() -> None:
    model = iresnet18(width=0.125, image_size=32, embedding_size=8)
    for stage in [model.layer1, model.layer2, model.layer3, model.layer4]:
        first = stage[0]
        assert first.conv1.stride == (1, 1)
        assert first.conv2.stride == (2, 2)
        assert first.downsample is not None and first.downsample[0].stride == (2, 2)
        for block in stage[1:]:
            assert block.conv2.stride == (1, 1) and block.downsample is None
    # And functionally: conv1 keeps the 16x16 map that enters layer2, conv2 halves it.
    sizes: dict[str, tuple[int, ...]] = {}

    def record(name: str):  # a forward hook that returns None leaves the output alone
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            sizes[name] = tuple(output.shape[-2:])

        return hook

    block = model.layer2[0]
    block.conv1.register_forward_hook(record("conv1"))
    block.conv2.register_forward_hook(record("conv2"))
    model(torch.randn(2, 3, 32, 32))
    assert sizes == {"conv1": (16, 16), "conv2": (8, 8)}


def test_width_scales_channels() -> None:
    model = iresnet18(width=0.25, image_size=48, embedding_size=10)
    assert model.conv1.out_channels == 16
    assert [stage[-1].conv2.out_channels for stage in [model.layer1, model.layer4]] == [16, 128]
    assert model.layer2[0].conv1.in_channels == 16 and model.layer2[0].conv1.out_channels == 32
    # fc input = 512 * width * (image_size / 16) ** 2
    assert model.fc.in_features == 128 * 3 * 3
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 10)


@pytest.mark.parametrize("image_size", [100, 8, 0, 120])
def test_bad_image_size_raises(image_size: int) -> None:
    with pytest.raises(ValueError, match="image_size"):
        iresnet18(width=0.125, image_size=image_size)


def test_iresnet_takes_height_and_width() -> None:
    model = iresnet18(width=0.125, image_size=(32, 16), embedding_size=8)
    # fc input = 512 * width * (H / 16) * (W / 16): the 2x1 map is flattened, not pooled
    assert model.fc.in_features == 64 * 2 * 1
    assert model(torch.randn(2, 3, 32, 16)).shape == (2, 8)
    with pytest.raises(ValueError, match="32x16"):
        model(torch.randn(2, 3, 16, 32))


@pytest.mark.parametrize("image_size", [(32, 20), (32,), (32, 16, 16), (0, 16)])
def test_bad_height_width_raises(image_size: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="image_size"):
        iresnet18(width=0.125, image_size=image_size)


def test_resnet50_reid_non_square_input() -> None:
    torch.manual_seed(0)
    model = resnet50_reid(embedding_size=16, image_size=(64, 32)).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 32)).shape == (2, 16)
    with pytest.raises(ValueError, match="image_size"):
        resnet50_reid(image_size=(64, 32, 3))


def test_wrong_input_size_raises() -> None:
    model = iresnet18(width=0.125, image_size=32, embedding_size=8)
    with pytest.raises(ValueError, match="32x32"):
        model(torch.randn(1, 3, 48, 48))


def reference_block(block: IBasicBlock, x: torch.Tensor, stride: int) -> torch.Tensor:
    """IBasicBlock in eval mode, written with functional ops from the published design."""

    def bn(layer: nn.BatchNorm2d, t: torch.Tensor) -> torch.Tensor:
        scale = layer.weight / torch.sqrt(layer.running_var + 1e-5)
        shift = layer.bias - layer.running_mean * scale
        return t * scale[None, :, None, None] + shift[None, :, None, None]

    out = bn(block.bn1, x)
    out = F.conv2d(out, block.conv1.weight, stride=1, padding=1)
    out = bn(block.bn2, out)
    slope = block.prelu.weight[None, :, None, None]
    out = torch.where(out > 0, out, slope * out)
    out = F.conv2d(out, block.conv2.weight, stride=stride, padding=1)
    out = bn(block.bn3, out)
    shortcut = x
    if block.downsample is not None:
        shortcut = F.conv2d(x, block.downsample[0].weight, stride=stride)
        shortcut = bn(block.downsample[1], shortcut)
    return out + shortcut


def randomise_batchnorms(model: nn.Module, generator: torch.Generator) -> None:
    """Give every BN non-trivial statistics and affine values, so the reference tests them."""
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=generator))
            module.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
            module.bias.data.copy_(torch.randn(c, generator=generator))
            if module.weight.requires_grad:
                module.weight.data.copy_(torch.rand(c, generator=generator) + 0.5)
        elif isinstance(module, nn.PReLU):
            module.weight.data.copy_(torch.rand(module.weight.shape, generator=generator))


def test_iresnet_forward_matches_functional_reference() -> None:
    generator = torch.Generator().manual_seed(1)
    model = iresnet18(width=0.125, image_size=32, embedding_size=12, dropout=0.3).double()
    with torch.no_grad():
        randomise_batchnorms(model, generator)
    model.eval()
    x = torch.randn(3, 3, 32, 32, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        actual = model(x)

        def bn(layer: nn.Module, t: torch.Tensor) -> torch.Tensor:
            shape = [1, -1] + [1] * (t.dim() - 2)
            scale = layer.weight / torch.sqrt(layer.running_var + 1e-5)
            shift = layer.bias - layer.running_mean * scale
            return t * scale.view(shape) + shift.view(shape)

        h = bn(model.bn1, F.conv2d(x, model.conv1.weight, padding=1))
        h = torch.where(h > 0, h, model.prelu.weight.view(1, -1, 1, 1) * h)
        for stage in [model.layer1, model.layer2, model.layer3, model.layer4]:
            for index, block in enumerate(stage):
                h = reference_block(block, h, stride=2 if index == 0 else 1)
        assert h.shape == (3, 64, 2, 2)
        # Flatten in (channel, row, column) order, as the published fc expects.
        h = bn(model.bn2, h).reshape(3, 64 * 2 * 2)
        expected = bn(model.features, h @ model.fc.weight.T + model.fc.bias)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def test_zero_init_residual_makes_blocks_identity() -> None:
    model = iresnet18(width=0.125, image_size=32, embedding_size=8, zero_init_residual=True)
    block = model.layer1[1]  # no projection: the block must return its input exactly
    x = torch.randn(2, 8, 16, 16)
    torch.testing.assert_close(block(x), x)
    plain = iresnet18(width=0.125, image_size=32, embedding_size=8)
    assert not torch.allclose(plain.layer1[1](x), x)


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_every_backbone_forward_backward(name: str) -> None:
    torch.manual_seed(0)
    if name == "resnet50_reid":
        model = build_backbone(name, embedding_size=24, image_size=64)
        x = torch.randn(2, 3, 64, 32)
    else:
        model = build_backbone(name, embedding_size=24, width=0.125, image_size=32)
        x = torch.randn(2, 3, 32, 32)
    out = model(x)
    assert out.shape == (2, 24)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for param_name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, param_name
            assert torch.isfinite(param.grad).all(), param_name


def test_build_backbone_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"model.backbone: unknown backbone 'r51' \(choose from"):
        build_backbone("r51", embedding_size=8)


def test_resnet50_reid_last_stride_and_bn_neck() -> None:
    model = resnet50_reid(embedding_size=2048)
    assert model.fc is None
    model.eval()
    with torch.no_grad():
        feature_map = model.forward_features(torch.randn(1, 3, 256, 128))
    assert feature_map.shape == (1, 2048, 16, 8)

    # BN neck: BatchNorm1d(2048) whose bias is frozen at zero and stays there.
    assert isinstance(model.bnneck, nn.BatchNorm1d) and model.bnneck.num_features == 2048
    assert not model.bnneck.bias.requires_grad
    assert model.bnneck.weight.requires_grad
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(4, 3, 64, 32)).sum().backward()
    optimizer.step()
    assert model.bnneck.bias.grad is None
    assert torch.equal(model.bnneck.bias, torch.zeros(2048))


def test_resnet50_reid_embedding_is_bn_of_pooled_features() -> None:
    generator = torch.Generator().manual_seed(2)
    model = resnet50_reid(embedding_size=64).eval()
    with torch.no_grad():
        model.bnneck.running_mean.copy_(torch.randn(2048, generator=generator))
        model.bnneck.running_var.copy_(torch.rand(2048, generator=generator) + 0.5)
        model.bnneck.weight.copy_(torch.rand(2048, generator=generator) + 0.5)
        x = torch.randn(2, 3, 64, 32, generator=generator)
        pooled = model.forward_features(x).double().mean(dim=(2, 3))
        neck = model.bnneck
        normed = (pooled - neck.running_mean.double()) / torch.sqrt(
            neck.running_var.double() + neck.eps
        ) * neck.weight.double() + neck.bias.double()
        expected = normed @ model.fc.weight.double().T + model.fc.bias.double()
        actual = model(x)
    assert actual.shape == (2, 64)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-4)


def test_resnet50_reid_rejects_width() -> None:
    with pytest.raises(ValueError, match="width"):
        build_backbone("resnet50_reid", embedding_size=8, width=0.5)


def test_resnet50_reid_loads_local_torchvision_weights(tmp_path) -> None:
    from torchvision.models import resnet50

    torch.manual_seed(3)
    source = resnet50(weights=None)
    path = tmp_path / "resnet50.pth"
    torch.save(source.state_dict(), path)  # includes fc.*, which must be ignored
    model = resnet50_reid(embedding_size=2048, pretrained_path=str(path))
    assert torch.equal(model.base.layer3[2].conv2.weight, source.layer3[2].conv2.weight)
    # The last-stride change survives loading.
    assert model.base.layer4[0].conv2.stride == (1, 1)

    with pytest.raises(FileNotFoundError, match="missing.pth"):
        resnet50_reid(pretrained_path=str(tmp_path / "missing.pth"))
    bad = tmp_path / "bad.pth"
    torch.save({"conv1.weight": torch.zeros(1)}, bad)
    with pytest.raises(ValueError, match="bad.pth"):
        resnet50_reid(pretrained_path=str(bad))


def _with_torch_batch_norm(model: nn.Module) -> nn.Module:
    """A copy of `model` whose BatchNorm layers are torch's own, holding the same state."""
    import copy

    plain = copy.deepcopy(model)
    for name, layer in list(plain.named_modules()):
        if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
            kind = nn.BatchNorm2d if isinstance(layer, nn.BatchNorm2d) else nn.BatchNorm1d
            twin = kind(layer.num_features, eps=layer.eps, momentum=layer.momentum)
            twin.load_state_dict(layer.state_dict())
            twin.weight.requires_grad_(layer.weight.requires_grad)
            parent_path, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent_path) if parent_path else plain, child, twin)
    return plain


SMALL = {"iresnet18": {"width": 0.25}, "mbf": {}}


@pytest.mark.parametrize("name", ["iresnet18", "mbf"])
def test_batch_counters_advanced_at_once_match_torch_batch_norm(name: str) -> None:
    # The backbone advances every BatchNorm's counter with one operation per forward
    # (models/batch_norm.py): outputs, gradients, running statistics and counters must be
    # torch's BatchNorm's, value for value, also with a layer frozen in eval mode.
    torch.manual_seed(0)
    model = build_backbone(name, embedding_size=8, image_size=32, **SMALL[name])
    reference = _with_torch_batch_norm(model)
    frozen, trained = [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)][:2]
    assert not any(type(m).__module__.startswith("recognition") for m in reference.modules()
                   if isinstance(m, nn.BatchNorm2d))  # fmt: skip
    for copy_ in (model, reference):
        copy_.get_submodule(frozen).eval()  # a frozen stem layer keeps its counter
    for step in range(3):
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(step))
        out, expected = model(x), reference(x)
        assert torch.equal(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
    assert model.state_dict().keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for (key, param), twin in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (param.grad is None) == (twin.grad is None), key
        if param.grad is not None:
            assert torch.equal(param.grad, twin.grad), key
    assert reference.state_dict()[f"{frozen}.num_batches_tracked"].item() == 0
    assert reference.state_dict()[f"{trained}.num_batches_tracked"].item() == 3
