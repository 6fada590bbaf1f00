# libserve's PyTorch peer for `serve bench seq2seq|treelstm` (issue 19): the models and requests
# torch_lstm_server.py serves with `--model seq2seq|treelstm`. The bench embeds this file and writes
# it beside torch_lstm_server.py, which imports it.
"""The seq2seq and TreeLSTM of `serve bench seq2seq|treelstm`, in PyTorch eager, with the bench's
own weights and requests.

Weights: `--model-dir DIR` holds `weights.safetensors` as libserve writes it (`Network::save`,
PyTorch layouts and names; src/model/seq2seq.rs, src/model/treelstm.rs). It is read here with
the standard library and numpy (no `safetensors` package) and loaded with load_state_dict(strict).

Requests: `--requests FILE`, JSON from the bench: {"sources": [[token, ...], ...]} (seq2seq) or
{"trees": [{"tokens": [...], "parents": [...]}, ...]} (treelstm: parent -1 = the root; token
4294967295 = no input, x = 0), libserve's exact requests in libserve's order.

seq2seq (src/model/seq2seq.rs): nn.Embedding + nn.LSTM encoder over the source (a batch of
different lengths through pack_padded_sequence, so every row's final (h, c) of every layer is its
own); the decoder (nn.Embedding, the LSTM, nn.Linear proj) starts from those states and token bos;
each step feeds the previous output; next = argmax of proj(h_top) (torch's argmax: the first
maximum, i.e. ties -> lowest id); a row ends at eos (included) or max_decode. A decoder step runs
one nn.LSTMCell per layer sharing the decoder nn.LSTM's parameters, as OpenNMT-py's StackedLSTM
decoder does (--decoder-step cell, the default): one nn.LSTM call per step costs ~0.3 ms more at
small batches on this CPU (it is about even at 256 rows); --decoder-step lstm calls the nn.LSTM.
Rows that ended are dropped from the batch (h, c and the fed tokens are compacted with index_select
whenever some row ends), as a careful PyTorch user would; the batch's results are returned together
when its last row ends (one synchronous handler call per batch, as TorchServe's).

treelstm (src/model/treelstm.rs): Child-Sum TreeLSTM without DGL, level by level over the batch:
node tensors of the batch's trees are concatenated (per-tree index tensors prepared when a request
is parsed); W_iou x + b_iou and W_f x + b_f are computed once for the nodes that carry a token
(others get the biases: x = 0); then for each height 0, 1, ... all nodes of that height in every
tree run as one batched step: children's h gathered and summed with index_add_, per-child forget
gates sigma(W_f x + b_f + U_f h_k), c = i*u + sum f_k*c_k, h = o*tanh(c). Output = the root's h.
"""

import json
import math
import struct

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

NO_TOKEN = 2**32 - 1
WEIGHTS_FILE = "weights.safetensors"


def read_safetensors(path):
    """{name: float32 tensor} of a safetensors file: 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}}, then the raw little-endian data."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"{path}: header of {n} bytes runs past the end of the file")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t.get("dtype") != "F32":
            raise ValueError(f"{path}: tensor {name} is {t.get('dtype')}, only F32 is read")
        a, b = t["data_offsets"]
        count = math.prod(t["shape"])
        if b - a != 4 * count or 8 + n + b > len(data):
            raise ValueError(f"{path}: tensor {name} of shape {t['shape']} has bytes {a}..{b}")
        arr = np.frombuffer(data, dtype="<f4", count=count, offset=8 + n + a)
        out[name] = torch.from_numpy(arr.reshape(t["shape"]).astype(np.float32))
    return out


def load_weights(module, model_dir):
    """Load libserve's tensors into `module` (same names and shapes; strict)."""
    module.load_state_dict(read_safetensors(f"{model_dir}/{WEIGHTS_FILE}"), strict=True)
    return module.eval()


# ------------------------------------------------------------------------------------------------
# seq2seq
# ------------------------------------------------------------------------------------------------


class Seq2SeqModel:
    """Greedy seq2seq; `run_batch(mode, reqs, idxs)` gives each request's output tokens."""

    def __init__(self, a):
        self.bos, self.eos, self.max_decode = a.bos, a.eos, a.max_decode
        m = nn.Module()
        m.encoder, m.decoder = nn.Module(), nn.Module()
        m.encoder.embedding = nn.Embedding(a.vocab, a.embed)
        m.encoder.lstm = nn.LSTM(a.embed, a.hidden, num_layers=a.layers, batch_first=True)
        m.decoder.embedding = nn.Embedding(a.vocab, a.embed)
        m.decoder.lstm = nn.LSTM(a.embed, a.hidden, num_layers=a.layers, batch_first=True)
        m.decoder.proj = nn.Linear(a.hidden, a.vocab)
        self.m = load_weights(m, a.model_dir)
        self.cells = None
        if getattr(a, "decoder_step", "cell") == "cell":
            lstm, self.cells = m.decoder.lstm, []
            for k in range(a.layers):
                cell = nn.LSTMCell(a.embed if k == 0 else a.hidden, a.hidden).eval()
                for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    setattr(cell, name, getattr(lstm, f"{name}_l{k}"))
                self.cells.append(cell)

    def encode(self, seqs, lens):
        enc = self.m.encoder
        x = enc.embedding(pad_sequence(seqs, batch_first=True))
        if int(lens.min()) == x.shape[1]:  # one length: no padding to skip
            _, state = enc.lstm(x)
            return state
        _, state = enc.lstm(pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False))
        return state  # h_n, c_n in the input order

    def step(self, prev, h, c):
        """One decoder step of every row: (top h, h, c); h and c per layer, [rows, H] each."""
        x = self.m.decoder.embedding(prev)
        if self.cells is None:
            y, (hs, cs) = self.m.decoder.lstm(x.unsqueeze(1), (torch.stack(h), torch.stack(c)))
            return y[:, 0], list(hs.unbind(0)), list(cs.unbind(0))
        h, c = list(h), list(c)
        for k, cell in enumerate(self.cells):
            h[k], c[k] = cell(x, (h[k], c[k]))
            x = h[k]
        return x, h, c

    def run(self, seqs, lens):
        """(tokens [B, steps] int64, -1 past a row's end; lengths [B])."""
        h, c = self.encode(seqs, lens)
        h, c = list(h.unbind(0)), list(c.unbind(0))
        b = len(seqs)
        out = torch.full((b, self.max_decode), -1, dtype=torch.int64)
        n_out = torch.full((b,), self.max_decode, dtype=torch.int64)
        rows = torch.arange(b)  # the batch rows still decoding
        prev = torch.full((b,), self.bos, dtype=torch.int64)
        for t in range(self.max_decode):
            top, h, c = self.step(prev, h, c)
            prev = self.m.decoder.proj(top).argmax(dim=1)
            out[rows, t] = prev
            ended = prev == self.eos
            if bool(ended.any()):
                n_out[rows[ended]] = t + 1
                keep = (~ended).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                rows, prev = rows[keep], prev[keep]
                h = [x.index_select(0, keep) for x in h]
                c = [x.index_select(0, keep) for x in c]
        return out, n_out

    def run_batch(self, mode, reqs, idxs):
        seqs = [reqs.get(i)[0] for i in idxs]
        lens = torch.tensor([reqs.get(i)[1] for i in idxs], dtype=torch.int64)
        return self.run(seqs, lens)

    @staticmethod
    def outputs(result):
        """Per-request output token lists of a run_batch result."""
        out, n = result
        return [row[:k] for row, k in zip(out.tolist(), n.tolist())]


class SourceRequests:
    """The bench's seq2seq sources; request i of every run is sources[i % n]."""

    def __init__(self, sources):
        if not sources or any(len(s) == 0 for s in sources):
            raise ValueError("the requests file needs non-empty sources")
        self.lengths = [len(s) for s in sources]
        self.tokens = [torch.tensor(s, dtype=torch.int64) for s in sources]

    def __len__(self):
        return len(self.lengths)

    def get(self, i):
        k = i % len(self.lengths)
        return self.tokens[k], self.lengths[k]

    def describe(self):
        return f"mean source length {sum(self.lengths) / len(self.lengths):.2f}", sum(self.lengths) / len(self)


# ------------------------------------------------------------------------------------------------
# treelstm
# ------------------------------------------------------------------------------------------------


class Tree:
    """One request, parsed: row 0 tokens (NO_TOKEN -> 0), 1 has a token, 2 height (leaves 0),
    3 parent (-1 at the root); `root` its index."""

    def __init__(self, tokens, parents):
        n = len(parents)
        if n == 0 or len(tokens) != n:
            raise ValueError(f"a tree of {len(tokens)} tokens and {n} parents")
        children = [[] for _ in range(n)]
        roots = [v for v, p in enumerate(parents) if p == -1]
        for v, p in enumerate(parents):
            if p != -1:
                children[p].append(v)
        if len(roots) != 1:
            raise ValueError(f"a tree needs one root, this one has {len(roots)}")
        height = [0] * n
        order, stack = [], [roots[0]]
        while stack:  # pre-order; reversed, children come before their parents
            v = stack.pop()
            order.append(v)
            stack.extend(children[v])
        if len(order) != n:
            raise ValueError("a tree's nodes must all reach its root")
        for v in reversed(order):
            if children[v]:
                height[v] = 1 + max(height[k] for k in children[v])
        has = [t != NO_TOKEN for t in tokens]
        tok = [t if h else 0 for t, h in zip(tokens, has)]
        self.n, self.root = n, roots[0]
        self.arr = torch.tensor([tok, has, height, parents], dtype=torch.int64)


class TreeRequests:
    """The bench's trees; request i of every run is trees[i % n] (its length = its node count)."""

    def __init__(self, trees):
        if not trees:
            raise ValueError("the requests file has no trees")
        self.trees = [Tree(t["tokens"], t["parents"]) for t in trees]
        self.lengths = [t.n for t in self.trees]

    def __len__(self):
        return len(self.trees)

    def get(self, i):
        t = self.trees[i % len(self.trees)]
        return t, t.n

    def describe(self):
        mean = sum(self.lengths) / len(self)
        return f"mean {mean:.2f} nodes", mean


class TreeLstmModel:
    """Child-Sum TreeLSTM run level by level; `run_batch(mode, reqs, idxs)` gives the roots' h."""

    def __init__(self, a):
        self.h = a.hidden
        m = nn.Module()
        m.embedding = nn.Embedding(a.vocab, a.embed)
        m.tree = nn.Module()
        m.tree.W_iou = nn.Linear(a.embed, 3 * a.hidden)
        m.tree.U_iou = nn.Linear(a.hidden, 3 * a.hidden, bias=False)
        m.tree.W_f = nn.Linear(a.embed, a.hidden)
        m.tree.U_f = nn.Linear(a.hidden, a.hidden, bias=False)
        self.m = load_weights(m, a.model_dir)

    def run(self, trees):
        cell, hid = self.m.tree, self.h
        sizes = torch.tensor([t.n for t in trees])
        offs = torch.cumsum(sizes, 0) - sizes
        tok, has, height, parent = torch.cat([t.arr for t in trees], dim=1)
        parent = torch.where(parent >= 0, parent + torch.repeat_interleave(offs, sizes), parent)
        roots = offs + torch.tensor([t.root for t in trees])
        n = tok.numel()
        # The input parts, once for every node that carries a token; x = 0 gives the biases.
        iou_x = cell.W_iou.bias.expand(n, 3 * hid).clone()
        f_x = cell.W_f.bias.expand(n, hid).clone()
        xi = has.nonzero().squeeze(1)
        if xi.numel():
            x = self.m.embedding(tok[xi])
            iou_x[xi] = cell.W_iou(x)
            f_x[xi] = cell.W_f(x)
        # Levels: nodes by height; edges (child -> parent) by their parent's height.
        order = torch.argsort(height, stable=True)
        counts = torch.bincount(height)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(height)
        pos[order] = torch.arange(n) - starts[height[order]]  # a node's row within its level
        child = (parent >= 0).nonzero().squeeze(1)
        ph = height[parent[child]]
        child = child[torch.argsort(ph, stable=True)]
        ecounts = torch.bincount(ph, minlength=counts.numel()).tolist()
        e_parent = parent[child]
        e_pos = pos[e_parent]
        h = torch.empty(n, hid)
        c = torch.empty(n, hid)
        s = e = 0
        for level, k in enumerate(counts.tolist()):
            nodes = order[s:s + k]
            s += k
            iou = iou_x[nodes]
            fc = None
            if level > 0:
                ek = ecounts[level]
                ch, pp = child[e:e + ek], e_pos[e:e + ek]
                hk = h[ch]
                h_sum = torch.zeros(k, hid).index_add_(0, pp, hk)
                iou = iou + cell.U_iou(h_sum)
                f = torch.sigmoid(f_x[e_parent[e:e + ek]] + cell.U_f(hk))
                fc = torch.zeros(k, hid).index_add_(0, pp, f * c[ch])
                e += ek
            i, o, u = iou.chunk(3, dim=1)
            cl = torch.sigmoid(i) * torch.tanh(u)
            if fc is not None:
                cl = cl + fc
            h[nodes] = torch.sigmoid(o) * torch.tanh(cl)
            c[nodes] = cl
        return h[roots]

    def run_batch(self, mode, reqs, idxs):
        return self.run([reqs.get(i)[0] for i in idxs])

    @staticmethod
    def outputs(result):
        return result.tolist()


# ------------------------------------------------------------------------------------------------
# Loading, self-check and the outputs the bench compares with libserve's
# ------------------------------------------------------------------------------------------------


def load(a):
    """(model, requests) of `--model seq2seq|treelstm` from --model-dir and --requests."""
    with open(a.requests) as f:
        spec = json.load(f)
    if a.model == "seq2seq":
        if "sources" not in spec:
            raise ValueError(f"{a.requests}: a seq2seq requests file needs `sources`")
        return Seq2SeqModel(a), SourceRequests(spec["sources"])
    if "trees" not in spec:
        raise ValueError(f"{a.requests}: a treelstm requests file needs `trees`")
    return TreeLstmModel(a), TreeRequests(spec["trees"])


def run_all(model, reqs, mode, idxs, batch=64):
    """Per-request outputs of requests `idxs`, served in batches of `batch` (mode `mode`)."""
    out = []
    for k in range(0, len(idxs), batch):
        out += model.outputs(model.run_batch(mode, reqs, idxs[k:k + batch]))
    return out


def self_check(model, reqs, modes, kind):
    """Batched runs give each request what it gets alone. Returns a message on failure."""
    idxs = list(range(min(12, len(reqs))))
    alone = [model.outputs(model.run_batch(modes[0], reqs, [i]))[0] for i in idxs]
    for mode in modes:
        got = model.outputs(model.run_batch(mode, reqs, idxs))
        if kind == "seq2seq":
            differ = sum(g != r for g, r in zip(got, alone))
            if 2 * differ > len(idxs):  # an argmax near-tie may flip one; a bug flips most
                return f"mode {mode}: {differ} of {len(idxs)} decodes differ from unbatched runs"
        else:
            err = float((torch.tensor(got) - torch.tensor(alone)).abs().max())
            if err > 1e-4:
                return f"mode {mode}: roots' h differ from unbatched runs by {err}"
    return None


def write_outputs(model, reqs, mode, kind, n, path):
    """The outputs of the first n distinct requests (batches of 64, `mode`'s path), for the bench to
    compare with libserve's; returns the report's `check` object."""
    idxs = list(range(min(n, len(reqs))))
    out = run_all(model, reqs, mode, idxs)
    check = {"requests": len(idxs), "mode": mode}
    if kind == "seq2seq":
        check["mean_decode_tokens"] = sum(len(t) for t in out) / max(1, len(out))
        doc = {"model": kind, "tokens": out}
    else:
        doc = {"model": kind, "h": out}
    if path:
        with open(path, "w") as f:
            json.dump(doc, f)
    return check
