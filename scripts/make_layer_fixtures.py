#!/usr/bin/env python3
"""Generate the ResNet and BERT parity fixtures under ffi_examples/testdata/ with real PyTorch.

Usage: scripts/make_layer_fixtures.py [--out DIR]

DIR defaults to ffi_examples/testdata of the repository holding this script. The script
(re)writes three model directories there, each with `model.toml`, `weights.safetensors` and
`expected.json`, so that the Rust tests can compare libserve's outputs with what PyTorch
computes, without Python:

  resnet_small/             kind = "resnet"  torchvision BasicBlock, layers [1, 1, 1, 1],
                                             10 classes, image 3x32x40, width 4
  resnet_bottleneck_small/  kind = "resnet"  torchvision Bottleneck, layers [1, 2, 1, 1],
                                             7 classes, image 3x29x33 (odd on purpose), width 4
  bert_small/               kind = "bert"    transformers BertModel with pooler: vocab 100,
                                             hidden 32, 2 layers, 4 heads, intermediate 64,
                                             max_position 40, type_vocab 2, seq_len 16

Requirements: Python 3 with torch, torchvision, transformers, safetensors and numpy. The
models are randomly initialised; nothing is downloaded. CPU only. The lead's venv:

    /root/.cache/libserve/torch-venv/bin/python scripts/make_layer_fixtures.py

Determinism: torch.use_deterministic_algorithms(True), one intra-op and one inter-op thread,
a fixed seed per model (torch.manual_seed before construction) and per random draw (separate
torch.Generator objects), a fixed request list, and json.dumps with a fixed layout. Running
the script twice gives byte-identical files (with the same torch / torchvision / transformers
versions; a different version may initialise or round differently, which changes the files
but not their validity: every expected value is what that PyTorch computes).

All expected outputs are computed by the PyTorch modules themselves in float32, eval mode,
under torch.no_grad(), and stored with float(x) (repr: the float32 value exactly).

model.toml
----------
resnet:  kind = "resnet", block = "basic" | "bottleneck", layers = [a, b, c, d],
         num_classes = N, image = [3, H, W], width = 4
bert:    kind = "bert", vocab, hidden, layers, heads, intermediate, max_position,
         type_vocab, seq_len, layer_norm_eps (= 1e-12)

weights.safetensors
-------------------
Written exactly as a user would: safetensors.torch.save_file(model.state_dict(), path) (no
metadata), so integer buffers are included: every BatchNorm's num_batches_tracked (int64,
shape [], value 7) in the resnet files. For bert, `state_dict()` of recent transformers holds
no integer buffer (embeddings.position_ids and embeddings.token_type_ids are registered with
persistent=False); older transformers versions saved embeddings.position_ids, so when
state_dict() lacks it the script adds embeddings.position_ids (int64, [1, max_position],
arange) before saving. A loader must therefore accept (and may ignore) integer tensors. The
script prints the non-float tensors of every file.

expected.json
-------------
{"generator": "scripts/make_layer_fixtures.py", "requests": [...]}, one request per line.
resnet: 3 requests {"input": [C*H*W floats, row-major CHW], "output": [num_classes logits]};
        inputs are seeded standard-normal float32 values.
bert:   6 requests {"tokens": [ids], "output": [hidden floats]} with lengths 1, 2, 5, 9,
        16 (= seq_len) and 11, ids in [0, vocab) (token 0, the config's pad_token_id whose
        embedding row is zero, and vocab-1 appear), token type 0 everywhere. output is
        pooler_output. Each request is run alone (batch 1, length L, attention_mask all ones)
        and inside one batch of all 6 right-padded with id 0 to seq_len with attention_mask 1
        on the real tokens; the two must agree to 1e-5 (max abs) and the batched value is
        stored. The Rust runtime attends over the real tokens only, which is what the mask does.

Semantics (the reference the Rust implementation must match)
------------------------------------------------------------
resnet: torchvision.models.resnet.ResNet (v1.5: the stride of a Bottleneck sits on its 3x3
  conv2), groups 1, width_per_group 64, no dilation, zero_init_residual False, with every
  channel count scaled by `width`: the stem conv1 (7x7, stride 2, padding 3, no bias) has
  `width` output channels, bn1, ReLU, maxpool 3x3 stride 2 padding 1; stage i (0..3) is
  torchvision's own _make_layer(block, width * 2**i, layers[i], stride 1 for i = 0 else 2),
  i.e. planes = width * 2**i and output channels planes * expansion (1 for BasicBlock, 4 for
  Bottleneck); a stage's first block has downsample = conv1x1(stride) + BatchNorm when the
  stride is not 1 or the channel count changes; then AdaptiveAvgPool2d((1, 1)), flatten, fc.
  The modules are torchvision's BasicBlock / Bottleneck / Conv2d / BatchNorm2d / MaxPool2d /
  AdaptiveAvgPool2d / Linear and the state_dict names are torchvision's (conv1.weight,
  bn1.{weight,bias,running_mean,running_var,num_batches_tracked},
  layer{1..4}.{i}.conv{1,2[,3]}.weight, layer{1..4}.{i}.bn{1,2[,3]}.*,
  layer{1..4}.0.downsample.0.weight, layer{1..4}.0.downsample.1.*, fc.weight, fc.bias).
  With width 64 this is exactly torchvision's ResNet: the script checks that WidthResNet(width
  64) and torchvision's ResNet built from the same seed have the same state_dict (names,
  shapes, values) and the same output. BatchNorm eps is 1e-5 (eval: running statistics).
  Initialisation is torchvision's (kaiming_normal fan_out for convs, nn.Linear default for
  fc), after which every BatchNorm gets seeded random statistics so that folding bugs show:
  weight uniform(0.5, 1.5), bias uniform(-0.2, 0.2), running_mean uniform(-0.2, 0.2),
  running_var uniform(0.5, 1.5), num_batches_tracked 7.
  Input: one float32 image [3, H, W] (no normalisation); output: the fc logits.

bert: transformers BertModel(config, add_pooling_layer=True) with the eager attention
  implementation (softmax(Q K^T / sqrt(head_dim) + mask) V; padded keys get the dtype's
  minimum added), hidden_act "gelu" = the exact erf GELU, dropout 0, absolute position
  embeddings (position ids 0..L-1), token type ids 0, LayerNorm eps 1e-12 (post-LN blocks).
  output = pooler_output = tanh(pooler.dense(last_hidden_state[:, 0])).
  Initialisation: BertModel's own (_init_weights: normal(0, initializer_range) for Linear and
  Embedding weights, the padding_idx row zeroed, Linear biases 0, LayerNorm weight 1 bias 0)
  with initializer_range 0.2 instead of the default 0.02 (0.02 makes every attention score
  ~0.01, i.e. near-uniform attention, and the GELU and pooler tanh near-linear, which would
  hide bugs), then, so that a dropped bias or a swapped LayerNorm gamma/beta shows, every
  Linear bias is redrawn uniform(-0.2, 0.2), every LayerNorm weight uniform(0.5, 1.5) and bias
  uniform(-0.2, 0.2). initializer_range only affects the initialisation; it is not a
  model.toml key.

Self-checks
-----------
* Every weights file is read back with safetensors.torch.load_file, loaded into a fresh
  model of the same config (built from another seed) with load_state_dict(strict=True) (for
  bert, an added non-persistent embeddings.position_ids is checked to be arange and dropped
  first) and the fresh model must reproduce every stored output exactly (bit for bit).
* resnet: a hand-written fold of bn1 into the stem conv1, w' = w * g / sqrt(var + eps),
  b' = beta - mean * g / sqrt(var + eps), eps 1e-5, reproduces bn1(conv1(x)) to 1e-5 (the
  folding the Rust side does); batch-1 and batch-3 logits agree to 1e-5.
* resnet: WidthResNet(width 64) equals torchvision's ResNet (see above).
* bert: alone vs batched pooler outputs agree to 1e-5.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import safetensors
import safetensors.torch
import torch
import torchvision
import transformers
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

GENERATOR = "scripts/make_layer_fixtures.py"

RESNET_BASIC_SEED = 5005
RESNET_BOTTLENECK_SEED = 6006
BERT_SEED = 7007
REQUEST_SEED = 8008  # request inputs / token streams
RELOAD_SEED = 9009  # the fresh model the weights file is loaded into

NUM_BATCHES_TRACKED = 7
BN_EPS = 1e-5
BERT_INIT_RANGE = 0.2  # BertConfig.initializer_range (default 0.02); see the docstring

ALONE_VS_BATCHED_TOL = 1e-5
FOLD_TOL = 1e-5


# ----------------------------------------------------------------------------- models


class WidthResNet(ResNet):
    """torchvision's ResNet with the stem and stage widths scaled: torchvision's
    ResNet.__init__ with 64 replaced by `width` (groups 1, width_per_group 64, no dilation,
    zero_init_residual False). width 64 is exactly torchvision's ResNet."""

    def __init__(self, block, layers, num_classes=1000, width=64):
        nn.Module.__init__(self)  # ResNet.__init__ replicated below, 64 -> width
        norm_layer = nn.BatchNorm2d
        self._norm_layer = norm_layer
        self.inplanes = width
        self.dilation = 1
        self.groups = 1
        self.base_width = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2, dilate=False)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2, dilate=False)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2, dilate=False)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


def randomize_batchnorm(model, gen):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(torch.empty(n).uniform_(0.5, 1.5, generator=gen))
                m.bias.copy_(torch.empty(n).uniform_(-0.2, 0.2, generator=gen))
                m.running_mean.copy_(torch.empty(n).uniform_(-0.2, 0.2, generator=gen))
                m.running_var.copy_(torch.empty(n).uniform_(0.5, 1.5, generator=gen))
                m.num_batches_tracked.fill_(NUM_BATCHES_TRACKED)


def build_resnet(cfg, seed):
    torch.manual_seed(seed)
    model = WidthResNet(BLOCKS[cfg["block"]], cfg["layers"], cfg["num_classes"], cfg["width"])
    randomize_batchnorm(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def bert_config(cfg):
    kwargs = dict(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        intermediate_size=cfg["intermediate"],
        max_position_embeddings=cfg["max_position"],
        type_vocab_size=cfg["type_vocab"],
        hidden_act="gelu",
        layer_norm_eps=cfg["layer_norm_eps"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=BERT_INIT_RANGE,
    )
    try:
        config = transformers.BertConfig(attn_implementation="eager", **kwargs)
    except TypeError:
        config = transformers.BertConfig(**kwargs)
    config._attn_implementation = "eager"  # older versions: set after construction
    return config


def build_bert(cfg, seed):
    torch.manual_seed(seed)
    model = transformers.BertModel(bert_config(cfg), add_pooling_layer=True)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, m in sorted(model.named_modules()):
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.empty(m.bias.shape).uniform_(-0.2, 0.2, generator=gen))
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.empty(m.weight.shape).uniform_(0.5, 1.5, generator=gen))
                m.bias.copy_(torch.empty(m.bias.shape).uniform_(-0.2, 0.2, generator=gen))
    return model.eval()


def attn_impl(model):
    return getattr(model.config, "_attn_implementation", None)


# ----------------------------------------------------------------------------- io


def floats(t):
    return [float(x) for x in t.reshape(-1).tolist()]  # json.dumps writes repr: exact


def toml_value(v):
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(int(v))


def non_float(tensors):
    return [f"{k} {str(v.dtype).replace('torch.', '')} {list(v.shape)}"
            for k, v in sorted(tensors.items()) if not v.dtype.is_floating_point]


def write_model(out_dir, name, config, state_dict, requests):
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, x) for x in ("model.toml", "weights.safetensors", "expected.json")]
    toml = "".join(f"{k} = {toml_value(v)}\n" for k, v in config)
    # One request per line, arrays inline: readable, and the images stay compact.
    lines = [json.dumps(r, separators=(",", ":")) for r in requests]
    expected = (
        '{"generator": ' + json.dumps(GENERATOR) + ', "requests": [\n' + ",\n".join(lines) + "\n]}\n"
    )
    with open(paths[0], "w", encoding="utf-8", newline="\n") as f:
        f.write(toml)
    safetensors.torch.save_file(state_dict, paths[1])
    with open(paths[2], "w", encoding="utf-8", newline="\n") as f:
        f.write(expected)
    return paths


# ----------------------------------------------------------------------------- resnet


def fold_check(model, x):
    """bn1(conv1(x)) against a conv with the BatchNorm folded into weight and bias."""
    conv, bn = model.conv1, model.bn1
    assert bn.eps == BN_EPS
    scale = bn.weight / torch.sqrt(bn.running_var + BN_EPS)
    w = conv.weight * scale.reshape(-1, 1, 1, 1)
    b = bn.bias - bn.running_mean * scale
    ref = bn(conv(x))
    folded = nn.functional.conv2d(x, w, b, stride=conv.stride, padding=conv.padding)
    err = float((ref - folded).abs().max())
    assert err <= FOLD_TOL, f"BatchNorm fold mismatch {err}"
    return err


def width64_check():
    """WidthResNet(width 64) is torchvision's ResNet: same state_dict and output."""
    for block, layers in ((BasicBlock, [1, 1, 1, 1]), (Bottleneck, [1, 1, 1, 1])):
        torch.manual_seed(1)
        tv = ResNet(block, layers, num_classes=10).eval()
        torch.manual_seed(1)
        ours = WidthResNet(block, layers, num_classes=10, width=64).eval()
        a, b = tv.state_dict(), ours.state_dict()
        assert list(a) == list(b), "state_dict names differ from torchvision's"
        for k in a:
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
        assert torch.equal(tv(x), ours(x))


def make_resnet(out_dir, name, cfg, seed, req_stream):
    model = build_resnet(cfg, seed)
    gen = torch.Generator().manual_seed(REQUEST_SEED * 10 + req_stream)
    # Quantised to multiples of 1/16 (exact in fp32 and short in JSON): the images are most of
    # expected.json's bytes.
    xs = torch.round(torch.randn(3, *cfg["image"], generator=gen, dtype=torch.float32) * 16) / 16
    with torch.no_grad():
        alone = torch.cat([model(x.unsqueeze(0)) for x in xs])
        batched = model(xs)
        err_batch = float((alone - batched).abs().max())
        assert err_batch <= ALONE_VS_BATCHED_TOL, f"batch-1 vs batch-3 {err_batch}"
        fold_err = fold_check(model, xs)
    requests = [{"input": floats(x), "output": floats(y)} for x, y in zip(xs, alone)]
    config = [("kind", "resnet")] + [
        (k, cfg[k]) for k in ("block", "layers", "num_classes", "image", "width")
    ]
    state = model.state_dict()
    paths = write_model(out_dir, name, config, state, requests)

    back = safetensors.torch.load_file(paths[1])
    fresh = build_resnet(cfg, RELOAD_SEED)
    fresh.load_state_dict(back, strict=True)
    with torch.no_grad():
        again = torch.cat([fresh(x.unsqueeze(0)) for x in xs])
    assert torch.equal(again, alone), "reloaded weights do not reproduce the outputs"

    stats = {
        "params": sum(v.numel() for v in state.values()),
        "non-float tensors": non_float(back),
        "|logit| max / mean / min": "%.4g / %.4g / %.4g"
        % (alone.abs().max(), alone.abs().mean(), alone.abs().min()),
        "logit std per request": " ".join("%.3g" % s for s in alone.std(dim=1).tolist()),
        "batch-1 vs batch-3 max abs": "%.3g" % err_batch,
        "bn1 fold max abs err": "%.3g" % fold_err,
    }
    return paths, stats


# ----------------------------------------------------------------------------- bert


BERT_CFG = dict(vocab=100, hidden=32, layers=2, heads=4, intermediate=64, max_position=40,
                type_vocab=2, seq_len=16, layer_norm_eps=1e-12)
BERT_LENGTHS = [1, 2, 5, 9, 16, 11]


def bert_requests(cfg):
    gen = torch.Generator().manual_seed(REQUEST_SEED * 10 + 3)
    reqs = [[int(t) for t in torch.randint(0, cfg["vocab"], (n,), generator=gen).tolist()]
            for n in BERT_LENGTHS]
    reqs[2][1] = 0  # the pad_token_id (zero embedding row) as a real token
    reqs[2][3] = cfg["vocab"] - 1  # the last embedding row
    return reqs


def bert_run(model, cfg, reqs):
    """(alone, batched) pooler outputs, [n, hidden] each."""
    with torch.no_grad():
        alone = []
        for toks in reqs:
            ids = torch.tensor([toks], dtype=torch.int64)
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                        token_type_ids=torch.zeros_like(ids))
            alone.append(out.pooler_output[0])
        alone = torch.stack(alone)
        s = cfg["seq_len"]
        ids = torch.zeros(len(reqs), s, dtype=torch.int64)
        mask = torch.zeros(len(reqs), s, dtype=torch.int64)
        for i, toks in enumerate(reqs):
            assert 1 <= len(toks) <= s
            ids[i, : len(toks)] = torch.tensor(toks)
            mask[i, : len(toks)] = 1
        batched = model(input_ids=ids, attention_mask=mask,
                        token_type_ids=torch.zeros_like(ids)).pooler_output
    return alone, batched


def make_bert(out_dir):
    cfg = BERT_CFG
    model = build_bert(cfg, BERT_SEED)
    impl = attn_impl(model)
    assert impl == "eager", f"attention implementation {impl!r}, wanted eager"
    reqs = bert_requests(cfg)
    alone, batched = bert_run(model, cfg, reqs)
    err = float((alone - batched).abs().max())
    assert err <= ALONE_VS_BATCHED_TOL, f"alone vs batched {err}"
    requests = [{"tokens": t, "output": floats(y)} for t, y in zip(reqs, batched)]
    config = [("kind", "bert")] + [
        (k, cfg[k]) for k in ("vocab", "hidden", "layers", "heads", "intermediate",
                              "max_position", "type_vocab", "seq_len", "layer_norm_eps")
    ]
    state = model.state_dict()
    buffers_in_state = non_float(state)
    added = []
    if not buffers_in_state:
        # Recent transformers keep position_ids non-persistent; older versions saved it.
        state = dict(state)
        state["embeddings.position_ids"] = torch.arange(
            cfg["max_position"], dtype=torch.int64).reshape(1, -1)
        added.append("embeddings.position_ids")
    paths = write_model(out_dir, "bert_small", config, state, requests)

    back = safetensors.torch.load_file(paths[1])
    for k in added:
        assert torch.equal(back.pop(k), torch.arange(cfg["max_position"]).reshape(1, -1))
    fresh = build_bert(cfg, RELOAD_SEED)
    fresh.load_state_dict(back, strict=True)
    alone2, batched2 = bert_run(fresh, cfg, reqs)
    assert torch.equal(alone2, alone) and torch.equal(batched2, batched), "reload mismatch"

    pos_type = getattr(model.config, "position_embedding_type", "absolute")  # gone in v5
    assert pos_type == "absolute", pos_type
    with torch.no_grad():  # how far from uniform attention is (uniform: 1 / L)
        ids = torch.tensor([reqs[BERT_LENGTHS.index(cfg["seq_len"])]])
        attn = model(input_ids=ids, output_attentions=True).attentions
    persistent = "embeddings.position_ids" in model.state_dict()
    stats = {
        "params": sum(v.numel() for v in state.values()),
        "attention implementation": impl,
        "position_ids persistent in state_dict()": persistent,
        "integer buffers from state_dict()": buffers_in_state or "none",
        "integer tensors added": added or "none",
        "non-float tensors in file": non_float(safetensors.torch.load_file(paths[1])),
        "position_embedding_type": pos_type,
        "mean max attention prob per layer, L = %d (uniform %.4f)" % (ids.shape[1], 1 / ids.shape[1]):
        " ".join("%.4f" % float(a.max(-1).values.mean()) for a in attn),
        "|output| max / mean / min": "%.4g / %.4g / %.4g"
        % (batched.abs().max(), batched.abs().mean(), batched.abs().min()),
        "alone vs batched max abs": "%.3g" % err,
    }
    return paths, stats


# ----------------------------------------------------------------------------- main


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(os.path.dirname(here), "ffi_examples", "testdata")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=default_out, help="output directory (default: %(default)s)")
    args = ap.parse_args(argv)

    start = time.monotonic()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"transformers {transformers.__version__}, safetensors {safetensors.__version__}, "
          f"numpy {np.__version__}")

    width64_check()
    jobs = [
        lambda: make_resnet(args.out, "resnet_small", dict(
            block="basic", layers=[1, 1, 1, 1], num_classes=10, image=[3, 32, 40], width=4),
            RESNET_BASIC_SEED, 1),
        lambda: make_resnet(args.out, "resnet_bottleneck_small", dict(
            block="bottleneck", layers=[1, 2, 1, 1], num_classes=7, image=[3, 29, 33], width=4),
            RESNET_BOTTLENECK_SEED, 2),
        lambda: make_bert(args.out),
    ]
    for job in jobs:
        files, stats = job()
        for path in files:
            print(f"{os.path.getsize(path):8d}  {path}")
        for key, val in stats.items():
            print(f"          {key}: {val}")
    print(f"done in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
