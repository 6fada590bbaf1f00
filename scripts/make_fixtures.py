#!/usr/bin/env python3
"""Generate the small recurrent-model fixtures under ffi_examples/testdata/.

Usage: scripts/make_fixtures.py [--out DIR]

DIR defaults to ffi_examples/testdata of the repository holding this script. The script
(re)writes three model directories there, each with `model.toml`, `weights.safetensors` and
`expected.json`, so that the Rust tests can check libserve's outputs without Python:

  lstm_small/       kind = "lstm"      vocab 50, embed 8, hidden 16, 2 layers
  seq2seq_small/    kind = "seq2seq"   vocab 40, embed 8, hidden 16, 2 layers, bos 1, eos 2,
                                       max_decode 12
  treelstm_small/   kind = "treelstm"  vocab 50, embed 8, hidden 16

Requirements: Python 3 and numpy only (no torch, no safetensors package: the safetensors file
is written by hand). The output is deterministic: fixed seeds (np.random.default_rng), a fixed
request list, sorted tensor names and json.dumps with a fixed layout, so running the script
twice gives byte-identical files.

Weights
-------
All tensors are float32, little-endian, C-contiguous, named as in a PyTorch state_dict.
Matrices and biases are drawn uniform(-k, k) with k = 1/sqrt(hidden) (PyTorch's default init
for nn.LSTM / nn.Linear(hidden, .)); embeddings are drawn standard normal (nn.Embedding's
init). Expected outputs are computed in float64 from the float32-rounded weights.

safetensors layout: u64 little-endian N, N bytes of JSON header
{"__metadata__": {"generator": ...}, name: {"dtype": "F32", "shape": [...],
"data_offsets": [begin, end]}, ...} padded with trailing spaces so that 8 + N is a multiple of
8, then the tensor data packed back to back in sorted name order (offsets relative to the
start of the data section).

Semantics implemented (the reference the Rust implementation must match)
------------------------------------------------------------------------
lstm: exactly torch.nn.LSTM (batch_first irrelevant: one sequence, zero initial h and c).
  Tensors embedding.weight [vocab, E]; for layer k: lstm.weight_ih_l{k} [4H, in_k]
  (in_0 = E, in_k = H for k > 0), lstm.weight_hh_l{k} [4H, H], lstm.bias_ih_l{k} [4H],
  lstm.bias_hh_l{k} [4H]. Per step, with the torch.nn.LSTM gate order i, f, g, o:
      gates = W_ih x + b_ih + W_hh h + b_hh;  i, f, g, o = split(gates, 4)
      i, f, o = sigmoid(.), g = tanh(.);  c = f*c + i*g;  h = o*tanh(c)
  x of layer 0 is embedding.weight[token]; x of layer k > 0 is layer k-1's new h at the same
  step. Output: the top layer's h after the last token (length H).

seq2seq: encoder.embedding.weight, encoder.lstm.* (as above), decoder.embedding.weight,
  decoder.lstm.* (same shapes), decoder.proj.weight [vocab, H], decoder.proj.bias [vocab].
  The encoder LSTM runs over the source tokens from zero state. Greedy decoding starts from
  the encoder's final (h, c) of every layer with input token bos; each step runs the decoder
  LSTM one step on decoder.embedding.weight[prev], logits = proj.weight . h_top + proj.bias,
  next = argmax (ties -> lowest id). The output list includes eos if emitted and stops right
  after it, or stops when max_decode tokens have been produced. The script asserts that at
  every decode step the best logit beats the second best by >= 1e-3, so fp32 implementations
  agree on every argmax.

treelstm: Child-Sum Tree-LSTM of Tai, Socher & Manning 2015 ("Improved Semantic
  Representations From Tree-Structured Long Short-Term Memory Networks", section 3.1).
  Tensors embedding.weight [vocab, E], tree.W_iou.weight [3H, E], tree.W_iou.bias [3H],
  tree.U_iou.weight [3H, H], tree.W_f.weight [H, E], tree.W_f.bias [H], tree.U_f.weight [H, H].
  Request: tokens[n], parents[n] (parent index, -1 for the root; nodes in any order). Token
  4294967295 (u32::MAX) means "no input": x = 0. Per node, children first:
      h~ = sum_k h_k;  [i, o, u] = W_iou x + b_iou + U_iou h~  (three H-chunks, in that order)
      i, o = sigmoid(.), u = tanh(.);  f_k = sigmoid(W_f x + b_f + U_f h_k) for each child k
      c = i*u + sum_k f_k*c_k;  h = o*tanh(c)
  Leaves have no children (h~ = 0, no f terms). Output: the root's h (length H).

Self-checks: the lstm reference is compared against a second formulation (one matmul with the
concatenated [W_ih | W_hh] and summed biases) to 1e-12; each safetensors file is parsed back
and compared with the arrays written; the seq2seq stop/gap requirements are asserted.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

GENERATOR = "scripts/make_fixtures.py"
NO_TOKEN = 4294967295  # u32::MAX: treelstm node without input (x = 0)

# Seeds and tuning. Randomly initialised decoders barely depend on their state, so the
# seq2seq seed and the constant added to decoder.proj.bias[eos] were picked by an offline scan
# (seeds 2002..12001, offsets halfway between observed eos-vs-best logit differences) so that
# make_seq2seq's assertions hold with a margin: 6 requests stop at eos after 1-3 other tokens,
# 2 run to max_decode, and every decode step's top-2 logit gap is >= 2.7e-3.
LSTM_SEED = 1001
SEQ2SEQ_SEED = 11477
SEQ2SEQ_EOS_BIAS_OFFSET = 0.36  # added to decoder.proj.bias[eos] (stored in the weights)
TREELSTM_SEED = 3003
REQUEST_SEED = 4004  # request token streams / tree shapes

MIN_LOGIT_GAP = 1e-3


# ----------------------------------------------------------------------------- weights / io


def uniform(rng, k, shape):
    return rng.uniform(-k, k, size=shape).astype(np.float32)


def normal(rng, shape):
    return rng.standard_normal(size=shape).astype(np.float32)


def lstm_params(rng, prefix, embed, hidden, layers):
    """torch.nn.LSTM state_dict (in its order) with PyTorch's uniform(-1/sqrt(H), 1/sqrt(H))."""
    k = 1.0 / math.sqrt(hidden)
    out = {}
    for layer in range(layers):
        inp = embed if layer == 0 else hidden
        out[f"{prefix}weight_ih_l{layer}"] = uniform(rng, k, (4 * hidden, inp))
        out[f"{prefix}weight_hh_l{layer}"] = uniform(rng, k, (4 * hidden, hidden))
        out[f"{prefix}bias_ih_l{layer}"] = uniform(rng, k, (4 * hidden,))
        out[f"{prefix}bias_hh_l{layer}"] = uniform(rng, k, (4 * hidden,))
    return out


def safetensors_bytes(tensors):
    names = sorted(tensors)
    header = {"__metadata__": {"generator": GENERATOR}}
    chunks = []
    offset = 0
    for name in names:
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        data = a.tobytes(order="C")
        header[name] = {
            "dtype": "F32",
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-(8 + len(text))) % 8)
    assert (8 + len(text)) % 8 == 0
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def parse_safetensors(blob):
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    data = blob[8 + n :]
    out = {}
    end_prev = 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        info = header[name]
        assert info["dtype"] == "F32"
        begin, end = info["data_offsets"]
        assert begin == end_prev, "tensors must be packed without gaps"
        end_prev = end
        count = int(np.prod(info["shape"], dtype=np.int64))
        assert end - begin == 4 * count
        out[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(info["shape"])
    assert end_prev == len(data)
    return out


def write_model(out_dir, name, config, tensors, requests):
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    toml = "".join(
        f'{k} = "{v}"\n' if isinstance(v, str) else f"{k} = {int(v)}\n" for k, v in config
    )
    blob = safetensors_bytes(tensors)
    back = parse_safetensors(blob)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].shape == v.shape and np.array_equal(back[k], v), k
    expected = json.dumps({"generator": GENERATOR, "requests": requests}, indent=2) + "\n"
    with open(os.path.join(d, "model.toml"), "w", encoding="utf-8", newline="\n") as f:
        f.write(toml)
    with open(os.path.join(d, "weights.safetensors"), "wb") as f:
        f.write(blob)
    with open(os.path.join(d, "expected.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(expected)
    return [os.path.join(d, x) for x in ("model.toml", "weights.safetensors", "expected.json")]


# ----------------------------------------------------------------------------- references


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def f64(tensors):
    return {k: v.astype(np.float64) for k, v in tensors.items()}


def lstm_step(p, prefix, layers, x, state):
    """One torch.nn.LSTM time step over all layers; state = [(h, c)] per layer (float64)."""
    new = []
    inp = x
    for layer in range(layers):
        h, c = state[layer]
        gates = (
            p[f"{prefix}weight_ih_l{layer}"] @ inp
            + p[f"{prefix}bias_ih_l{layer}"]
            + p[f"{prefix}weight_hh_l{layer}"] @ h
            + p[f"{prefix}bias_hh_l{layer}"]
        )
        i, f, g, o = np.split(gates, 4)  # torch.nn.LSTM order: input, forget, cell, output
        i, f, g, o = sigmoid(i), sigmoid(f), np.tanh(g), sigmoid(o)
        c = f * c + i * g
        h = o * np.tanh(c)
        new.append((h, c))
        inp = h
    return new


def zero_state(layers, hidden):
    return [(np.zeros(hidden), np.zeros(hidden)) for _ in range(layers)]


def lstm_run(p, prefix, emb, layers, hidden, tokens, state=None):
    state = zero_state(layers, hidden) if state is None else state
    for t in tokens:
        state = lstm_step(p, prefix, layers, emb[t], state)
    return state


def lstm_run_concat(p, prefix, emb, layers, hidden, tokens):
    """Second formulation for the self-check: gates = [W_ih | W_hh] [x; h] + (b_ih + b_hh),
    sigmoid via tanh, whole sequence per layer (layer-major instead of time-major)."""
    seq = [emb[t] for t in tokens]
    for layer in range(layers):
        w = np.concatenate(
            [p[f"{prefix}weight_ih_l{layer}"], p[f"{prefix}weight_hh_l{layer}"]], axis=1
        )
        b = p[f"{prefix}bias_ih_l{layer}"] + p[f"{prefix}bias_hh_l{layer}"]
        h = np.zeros(hidden)
        c = np.zeros(hidden)
        out = []
        for x in seq:
            z = w @ np.concatenate([x, h]) + b
            sig = lambda v: 0.5 * (1.0 + np.tanh(0.5 * v))  # noqa: E731
            i = sig(z[0:hidden])
            f = sig(z[hidden : 2 * hidden])
            g = np.tanh(z[2 * hidden : 3 * hidden])
            o = sig(z[3 * hidden : 4 * hidden])
            c = f * c + i * g
            h = o * np.tanh(c)
            out.append(h)
        seq = out
    return seq[-1]


def seq2seq_decode(p, cfg, tokens):
    """Greedy decode; returns (output tokens, min best-vs-second logit gap over the steps)."""
    layers, hidden = cfg["layers"], cfg["hidden"]
    state = lstm_run(p, "encoder.lstm.", p["encoder.embedding.weight"], layers, hidden, tokens)
    prev = cfg["bos"]
    out = []
    min_gap = math.inf
    while len(out) < cfg["max_decode"]:
        state = lstm_step(p, "decoder.lstm.", layers, p["decoder.embedding.weight"][prev], state)
        logits = p["decoder.proj.weight"] @ state[-1][0] + p["decoder.proj.bias"]
        nxt = int(np.argmax(logits))  # first maximum: ties -> lowest id
        top2 = np.sort(logits)[-2:]
        min_gap = min(min_gap, float(top2[1] - top2[0]))
        out.append(nxt)
        if nxt == cfg["eos"]:
            break
        prev = nxt
    return out, min_gap


def treelstm_run(p, hidden, tokens, parents):
    n = len(tokens)
    assert n >= 1 and len(parents) == n
    children = [[] for _ in range(n)]
    roots = [v for v in range(n) if parents[v] == -1]
    assert len(roots) == 1, "exactly one root"
    for v, par in enumerate(parents):
        if par != -1:
            assert 0 <= par < n and par != v
            children[par].append(v)
    # Post-order from the root (iterative); also proves the graph is a tree (all reached once).
    order, stack, seen = [], [(roots[0], False)], set()
    while stack:
        v, done = stack.pop()
        if done:
            order.append(v)
            continue
        assert v not in seen, "cycle"
        seen.add(v)
        stack.append((v, True))
        stack.extend((ch, False) for ch in children[v])
    assert len(order) == n, "every node must reach the root"
    emb = p["embedding.weight"]
    h = [None] * n
    c = [None] * n
    for v in order:
        x = np.zeros(emb.shape[1]) if tokens[v] == NO_TOKEN else emb[tokens[v]]
        h_sum = np.zeros(hidden)
        for ch in children[v]:
            h_sum = h_sum + h[ch]
        iou = p["tree.W_iou.weight"] @ x + p["tree.W_iou.bias"] + p["tree.U_iou.weight"] @ h_sum
        i, o, u = np.split(iou, 3)
        i, o, u = sigmoid(i), sigmoid(o), np.tanh(u)
        cv = i * u
        wf = p["tree.W_f.weight"] @ x + p["tree.W_f.bias"]
        for ch in children[v]:
            f = sigmoid(wf + p["tree.U_f.weight"] @ h[ch])
            cv = cv + f * c[ch]
        c[v] = cv
        h[v] = o * np.tanh(cv)
    return h[roots[0]]


def floats(v):
    return [float(x) for x in v]  # json.dumps writes repr(float): full precision


# ----------------------------------------------------------------------------- fixtures


def make_lstm(out_dir):
    cfg = dict(vocab=50, embed=8, hidden=16, layers=2)
    rng = np.random.default_rng(LSTM_SEED)
    tensors = {"embedding.weight": normal(rng, (cfg["vocab"], cfg["embed"]))}
    tensors.update(lstm_params(rng, "lstm.", cfg["embed"], cfg["hidden"], cfg["layers"]))
    p = f64(tensors)
    req_rng = np.random.default_rng([REQUEST_SEED, 1])
    lengths = [1, 2, 3, 5, 8, 13, 21, 40]
    requests = []
    for n in lengths:
        tokens = [int(t) for t in req_rng.integers(0, cfg["vocab"], size=n)]
        if n == 3:
            tokens[1] = cfg["vocab"] - 1  # the last embedding row is used at least once
            tokens[2] = 0
        h = lstm_run(p, "lstm.", p["embedding.weight"], cfg["layers"], cfg["hidden"], tokens)[-1][0]
        h2 = lstm_run_concat(p, "lstm.", p["embedding.weight"], cfg["layers"], cfg["hidden"], tokens)
        err = float(np.max(np.abs(h - h2)))
        assert err <= 1e-12, f"lstm self-check failed: {err}"
        requests.append({"tokens": tokens, "output": floats(h)})
    config = [("kind", "lstm")] + [(k, cfg[k]) for k in ("vocab", "embed", "hidden", "layers")]
    return write_model(out_dir, "lstm_small", config, tensors, requests), {}


def seq2seq_tensors(cfg, seed, eos_offset):
    rng = np.random.default_rng(seed)
    v, e, hd, nl = cfg["vocab"], cfg["embed"], cfg["hidden"], cfg["layers"]
    k = 1.0 / math.sqrt(hd)
    tensors = {"encoder.embedding.weight": normal(rng, (v, e))}
    tensors.update(lstm_params(rng, "encoder.lstm.", e, hd, nl))
    tensors["decoder.embedding.weight"] = normal(rng, (v, e))
    tensors.update(lstm_params(rng, "decoder.lstm.", e, hd, nl))
    tensors["decoder.proj.weight"] = uniform(rng, k, (v, hd))
    bias = uniform(rng, k, (v,))
    bias[cfg["eos"]] = np.float32(bias[cfg["eos"]] + np.float32(eos_offset))
    tensors["decoder.proj.bias"] = bias
    return tensors


SEQ2SEQ_CFG = dict(vocab=40, embed=8, hidden=16, layers=2, bos=1, eos=2, max_decode=12)


def seq2seq_sources(cfg):
    rng = np.random.default_rng([REQUEST_SEED, 2])
    lengths = [1, 2, 4, 6, 9, 12, 17, 25]
    # Source tokens avoid the special ids 0 (pad), bos, eos.
    return [[int(t) for t in rng.integers(3, cfg["vocab"], size=n)] for n in lengths]


def seq2seq_results(cfg, seed, eos_offset):
    tensors = seq2seq_tensors(cfg, seed, eos_offset)
    p = f64(tensors)
    results = [(src, *seq2seq_decode(p, cfg, src)) for src in seq2seq_sources(cfg)]
    return tensors, results


def make_seq2seq(out_dir):
    cfg = SEQ2SEQ_CFG
    tensors, results = seq2seq_results(cfg, SEQ2SEQ_SEED, SEQ2SEQ_EOS_BIAS_OFFSET)
    n_eos = sum(1 for _, out, _ in results if out[-1] == cfg["eos"] and len(out) < cfg["max_decode"])
    n_max = sum(1 for _, out, _ in results if len(out) == cfg["max_decode"] and cfg["eos"] not in out)
    min_gap = min(g for _, _, g in results)
    assert n_eos >= 3, f"only {n_eos} requests stop at eos before max_decode"
    assert n_max >= 2, f"only {n_max} requests run to max_decode without eos"
    assert min_gap >= MIN_LOGIT_GAP, f"logit gap {min_gap} < {MIN_LOGIT_GAP}"
    requests = [{"tokens": src, "output_tokens": out} for src, out, _ in results]
    keys = ("vocab", "embed", "hidden", "layers", "bos", "eos", "max_decode")
    config = [("kind", "seq2seq")] + [(k, cfg[k]) for k in keys]
    stats = {"stop_at_eos": n_eos, "run_to_max_decode": n_max, "min_logit_gap": min_gap}
    return write_model(out_dir, "seq2seq_small", config, tensors, requests), stats


def random_binary_tree(rng, n_leaves, vocab, internal_token_prob):
    """A random full binary tree in pre-order (root first); returns (tokens, parents)."""
    tokens, parents = [], []

    def build(parent, leaves):
        v = len(tokens)
        parents.append(parent)
        if leaves == 1:
            tokens.append(int(rng.integers(0, vocab)))
            return
        has_tok = rng.random() < internal_token_prob
        tokens.append(int(rng.integers(0, vocab)) if has_tok else NO_TOKEN)
        left = int(rng.integers(1, leaves))
        build(v, left)
        build(v, leaves - left)

    build(-1, n_leaves)
    return tokens, parents


def shuffled(rng, tokens, parents):
    """The same tree with its nodes listed in a random order (root not first)."""
    n = len(tokens)
    while True:
        perm = [int(x) for x in rng.permutation(n)]  # perm[new] = old
        if n == 1 or parents[perm[0]] != -1:
            break
    new_of = {old: new for new, old in enumerate(perm)}
    t = [tokens[old] for old in perm]
    par = [-1 if parents[old] == -1 else new_of[parents[old]] for old in perm]
    return t, par


def make_treelstm(out_dir):
    cfg = dict(vocab=50, embed=8, hidden=16)
    v, e, hd = cfg["vocab"], cfg["embed"], cfg["hidden"]
    k = 1.0 / math.sqrt(hd)
    rng = np.random.default_rng(TREELSTM_SEED)
    tensors = {
        "embedding.weight": normal(rng, (v, e)),
        "tree.W_iou.weight": uniform(rng, k, (3 * hd, e)),
        "tree.W_iou.bias": uniform(rng, k, (3 * hd,)),
        "tree.U_iou.weight": uniform(rng, k, (3 * hd, hd)),
        "tree.W_f.weight": uniform(rng, k, (hd, e)),
        "tree.W_f.bias": uniform(rng, k, (hd,)),
        "tree.U_f.weight": uniform(rng, k, (hd, hd)),
    }
    p = f64(tensors)
    rng = np.random.default_rng([REQUEST_SEED, 3])
    trees = []
    # 1. a single node
    trees.append(([7], [-1]))
    # 2. a chain of 6 (node i's parent is i+1: the root is listed last)
    trees.append(([3, 14, 15, 9, 26, 49], [1, 2, 3, 4, 5, -1]))
    # 3. a balanced binary tree of 15 nodes in heap order
    trees.append(([int(t) for t in rng.integers(0, v, size=15)], [-1] + [(i - 1) // 2 for i in range(1, 15)]))
    # 4. a random binary tree (constituency-like: internal nodes mostly without input), 39 nodes
    trees.append(random_binary_tree(rng, 20, v, 0.25))
    # 5. a random binary tree of 25 nodes, every node with a token, listed in shuffled order
    trees.append(shuffled(rng, *random_binary_tree(rng, 13, v, 1.0)))
    # 6. wide nodes: root with 4 children, one of which has 3 children; a leaf without input
    trees.append(([10, 11, 12, 13, 0, 21, 22, NO_TOKEN], [-1, 0, 0, 0, 0, 1, 1, 1]))
    # 7. a shuffled tree mixing 3-ary, unary and binary nodes, internal nodes without input
    base_tokens = [NO_TOKEN, 5, NO_TOKEN, 30, NO_TOKEN, 8, 40, 41, 42, NO_TOKEN, 17, 2]
    base_parents = [-1, 0, 0, 0, 2, 4, 2, 3, 3, 3, 9, 9]
    trees.append(shuffled(rng, base_tokens, base_parents))
    # 8. a shuffled random binary tree of 31 nodes, internal nodes without input
    trees.append(shuffled(rng, *random_binary_tree(rng, 16, v, 0.0)))
    requests = []
    for tokens, parents in trees:
        h = treelstm_run(p, hd, tokens, parents)
        requests.append({"tokens": tokens, "parents": parents, "output": floats(h)})
    assert any(NO_TOKEN in r["tokens"] for r in requests)
    assert any(len(r["tokens"]) == 1 for r in requests)
    assert any(r["parents"][0] != -1 for r in requests)
    config = [("kind", "treelstm")] + [(k, cfg[k]) for k in ("vocab", "embed", "hidden")]
    return write_model(out_dir, "treelstm_small", config, tensors, requests), {}


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(os.path.dirname(here), "ffi_examples", "testdata")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=default_out, help="output directory (default: %(default)s)")
    args = ap.parse_args(argv)
    for make in (make_lstm, make_seq2seq, make_treelstm):
        files, stats = make(args.out)
        for path in files:
            print(f"{os.path.getsize(path):8d}  {path}")
        for key, val in stats.items():
            print(f"          {key}: {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
